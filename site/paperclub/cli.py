"""``paperclub``: the contributor command line.

    paperclub check                      validate every session, paper, bib entry and claim
    paperclub new-session [options]      scaffold sessions/<date>-<slug>/ (and a paper page and bib entry)
    paperclub claims                     list every claim with its status

Errors are printed one per line as ``file: field 'x': what is wrong (what to do)`` and the
command exits with status 1; no traceback.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import sys
from pathlib import Path

from paperclub import ROOT
from paperclub.bibliography import format_entry


def cmd_check(args: argparse.Namespace) -> int:
    from paperclub.content import load

    content, problems = load(Path(args.root))
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        print(
            f"\n{len(problems)} problem(s) found; fix them and run 'paperclub check' again.", file=sys.stderr
        )
        return 1
    n_claims = len(content.claims)
    print(
        f"ok: {len(content.sessions)} sessions, {len(content.papers)} papers, {len(content.bib)} bib entries, "
        f"{len([r for r in content.repros.values() if not r.planned])} reproductions, {n_claims} claims"
    )
    return 0


def cmd_claims(args: argparse.Namespace) -> int:
    from paperclub.content import load

    content, problems = load(Path(args.root))
    for claim in sorted(content.claims.values(), key=lambda c: c.id):
        status, _ = content.status(claim)
        print(f"{status:17s} {claim.id:45s} {claim.section}")
    return 0


def slugify(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words[:6]) or "session"


def _ask(prompt: str, current: str | None, required: bool = True) -> str | None:
    if current:
        return current
    if not sys.stdin.isatty():
        if required:
            raise SystemExit(
                f"error: {prompt} is required; pass it as an option (see 'paperclub new-session --help')"
            )
        return None
    while True:
        value = input(f"{prompt}: ").strip()
        if value or not required:
            return value or None


def cmd_new_session(args: argparse.Namespace) -> int:
    from paperclub.content import URL, load

    root = Path(args.root)
    title = _ask("title", args.title)
    date = _ask("date (YYYY-MM-DD, or YYYY-MM; empty if not known)", args.date, required=False)
    date_known = args.date_known or (
        "planned" if not date else ("exact" if len(date) == 10 else "approximate")
    )
    if date:
        try:
            _dt.date.fromisoformat(date if len(date) == 10 else date + "-01")
        except ValueError:
            raise SystemExit(f"error: --date '{date}' is not a date; write YYYY-MM-DD or YYYY-MM") from None
    slug = args.slug or slugify(title)
    prefix = date or ("planned" if date_known == "planned" else "undated")
    folder = root / "sessions" / f"{prefix}-{slug}"
    if folder.exists():
        raise SystemExit(
            f"error: {folder.relative_to(root)} already exists; refusing to overwrite it (choose another --slug)"
        )
    content, _ = load(root)
    if any(s.slug == slug for s in content.sessions):
        raise SystemExit(f"error: the slug '{slug}' is already used by another session; pass --slug")

    keys: list[str] = []
    new_bib: list[str] = []
    new_papers: list[tuple[Path, str]] = []
    for arxiv in args.arxiv:
        if not re.fullmatch(r"\d{4}\.\d{4,5}", arxiv):
            raise SystemExit(f"error: --arxiv '{arxiv}' is not an arXiv id like 2507.04786")
        existing = [e for e in content.bib.values() if e.eprint and e.eprint.split("v")[0] == arxiv]
        if existing:
            keys.append(existing[0].key)
            continue
        authors = args.paper_author or ["TODO, Author"]
        year = args.paper_year or "20" + arxiv[:2]
        paper_title = args.paper_title or "TODO: the paper's title"
        last = re.sub(r"[^a-z]", "", authors[0].split(",")[0].lower()) or "author"
        word = next(
            (
                w
                for w in re.findall(r"[a-z0-9]+", paper_title.lower())
                if w not in {"a", "an", "the", "on", "of", "todo"}
            ),
            "paper",
        )
        key = f"{last}{year}{word}"
        if key in content.bib or key in keys:
            key = f"{key}{arxiv.replace('.', '')}"
        keys.append(key)
        new_bib.append(format_entry(key, title=paper_title, authors=authors, year=year, arxiv=arxiv))
        page = root / "papers" / f"{key}.md"
        if page.exists():
            raise SystemExit(f"error: {page.relative_to(root)} already exists; refusing to overwrite it")
        new_papers.append((page, _paper_template(key, paper_title, folder.name)))
    if args.slides and not URL.match(args.slides):
        raise SystemExit(
            f"error: --slides '{args.slides}' must be an https:// URL (put a slides file in the folder by hand)"
        )

    lines = [f"title: {_q(title)}"]
    if args.number:
        lines.insert(0, f"number: {args.number}")
    if date:
        lines.append(f"date: {date}")
    lines.append(f"date_known: {date_known}")
    lines.append(f"presenters: [{', '.join(_q(p) for p in args.presenter)}]")
    lines.append(f"papers: [{', '.join(keys)}]")
    if args.recording:
        lines.append(f"recording: {args.recording}")
    if args.slides:
        lines.append(f"slides: {args.slides}")
    if args.repro:
        lines.append(f"repro: {args.repro}")
    lines.append(f"tags: [{', '.join(args.tag)}]")
    lines.append(f"summary: {_q(args.summary or 'One or two sentences on what the session covers.')}")

    folder.mkdir(parents=True)
    (folder / "session.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "slides.md").write_text(
        f"# {title}\n\n{', '.join(args.presenter) or 'Presenter'}\n\n---\n\n## Why this paper\n\n- ...\n\n---\n\n## The idea\n\n- ...\n",
        encoding="utf-8",
    )
    (folder / "notes.md").write_text("Notes from the discussion go here.\n", encoding="utf-8")
    created = [folder / "session.yaml", folder / "slides.md", folder / "notes.md"]
    if new_bib:
        bib = root / "bib" / "sessions.bib"
        bib.parent.mkdir(exist_ok=True)
        with bib.open("a", encoding="utf-8") as fh:
            for entry in new_bib:
                fh.write("\n" + entry)
        created.append(bib)
    for page, text in new_papers:
        page.parent.mkdir(exist_ok=True)
        page.write_text(text, encoding="utf-8")
        created.append(page)
    for p in created:
        print(f"wrote {p.relative_to(root)}")
    print("next: fill in the files, then run 'paperclub check'")
    return 0


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _paper_template(key: str, title: str, session: str) -> str:
    return (
        f"---\nbibkey: {key}\ntitle: {_q(title)}\nsessions: [{session}]\ntags: []\n---\n\n"
        "## Problem\n\n## Key idea\n\n## Algorithm\n\n## Claimed results\n\n## What this repository reproduces\n\nNothing yet.\n"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paperclub", description="The reading group's knowledge-base tool.")
    parser.add_argument("--root", default=str(ROOT), help="repository root (default: this checkout)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="validate all content").set_defaults(func=cmd_check)
    sub.add_parser("claims", help="list every claim and its last status").set_defaults(func=cmd_claims)
    new = sub.add_parser("new-session", help="scaffold a session folder (prompts for what is missing)")
    new.add_argument("--title")
    new.add_argument(
        "--date", help="YYYY-MM-DD, or YYYY-MM when only the month is known; omit for a planned session"
    )
    new.add_argument("--date-known", choices=["exact", "approximate", "unknown", "planned"])
    new.add_argument("--number", type=int)
    new.add_argument("--slug", help="folder slug (default: from the title)")
    new.add_argument("--presenter", action="append", default=[])
    new.add_argument("--arxiv", action="append", default=[], help="arXiv id of a paper (repeatable)")
    new.add_argument("--paper-title", help="title of the (single) new paper, for its bib entry")
    new.add_argument("--paper-author", action="append", help="'Last, First' (repeatable)")
    new.add_argument("--paper-year")
    new.add_argument("--recording")
    new.add_argument("--slides", help="URL of the presenter's own deck")
    new.add_argument("--repro")
    new.add_argument("--tag", action="append", default=[])
    new.add_argument("--summary")
    new.set_defaults(func=cmd_new_session)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush from failing again
        return 0


if __name__ == "__main__":
    sys.exit(main())
