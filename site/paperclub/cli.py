"""``paperclub``: the contributor command line.

    paperclub check                      validate every session, paper, bib entry and claim
    paperclub new-session [options]      scaffold sessions/<date>-<slug>/ (and a paper page and bib entry)
    paperclub claims                     list every claim with its status on CPUs and on a GPU

Every subcommand works on the checkout you stand in: like git and mkdocs, it looks for the
repository root from the current directory upward (the first folder holding both ``mkdocs.yml``
and a ``sessions/`` folder), whichever clone the ``paperclub`` command was installed from.
``--root DIR`` names the repository instead. Outside any checkout it says so and exits with status 2.

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

from paperclub.bibliography import format_entry

ROOT_MARKERS = ("mkdocs.yml", "sessions/")
"""What marks a repository root: the site's config file beside the sessions folder."""


class NotACheckout(Exception):
    """The current directory is not inside a checkout of the repository, and no --root was given."""


def is_root(path: Path) -> bool:
    return (path / "mkdocs.yml").is_file() and (path / "sessions").is_dir()


def find_root(start: Path | None = None) -> Path:
    """The repository root holding ``start`` (default: the current directory), searched upward."""
    try:
        here = Path(start if start is not None else Path.cwd()).resolve()
    except OSError:  # the current directory was deleted under us
        raise NotACheckout("error: the current directory no longer exists; cd into your clone") from None
    for folder in (here, *here.parents):
        if is_root(folder):
            return folder
    raise NotACheckout(
        f"error: {here} is not inside a checkout of the reading group's repository "
        f"(no folder from here upward holds both {' and '.join(ROOT_MARKERS)}); "
        "cd into your clone, or pass --root DIR"
    )


def resolve_root(arg: str | None) -> Path:
    """``--root`` when given (it must be a folder), else the checkout around the current directory."""
    if arg is None:
        return find_root()
    root = Path(arg).expanduser().resolve()
    if not root.is_dir():
        raise NotACheckout(f"error: --root '{arg}' is not a folder")
    return root


WARNINGS_PER_FILE = 3  # the rest of a file's warnings are counted (paperclub check --all to list them)


def cmd_check(args: argparse.Namespace) -> int:
    from paperclub.content import load

    content, problems = load(args.root)
    shown: dict[str, int] = {}
    hidden: dict[str, int] = {}
    for w in content.warnings:
        if args.all or shown.get(w.file, 0) < WARNINGS_PER_FILE:
            shown[w.file] = shown.get(w.file, 0) + 1
            print(f"warning: {w}", file=sys.stderr)
        else:
            hidden[w.file] = hidden.get(w.file, 0) + 1
    for file, n in hidden.items():
        print(f"warning: {file}: {n} more like these ('paperclub check --all' lists them)", file=sys.stderr)
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        print(
            f"\n{len(problems)} problem(s) found in {args.root}; fix them and run 'paperclub check' again.",
            file=sys.stderr,
        )
        return 1
    n_claims = len(content.claims)
    print(
        f"ok: {len(content.sessions)} sessions, {len(content.papers)} papers, {len(content.bib)} bib entries, "
        f"{len([r for r in content.repros.values() if not r.planned])} reproductions, {n_claims} claims "
        f"(in {args.root})" + (f"; {len(content.warnings)} warning(s)" if content.warnings else "")
    )
    return 0


def cmd_claims(args: argparse.Namespace) -> int:
    from paperclub.claims import NOT_RUN, summary
    from paperclub.content import load

    content, problems = load(args.root)
    if problems:
        print(
            f"note: the content has {len(problems)} problem(s); 'paperclub check' lists them", file=sys.stderr
        )
    print(f"{'status':17s} {'claim':45s} {'CPU':9s} GPU")
    for claim in sorted(content.claims.values(), key=lambda c: c.id):
        rec = content.record(claim)
        if not claim.reproducible:
            print(f"{rec.status:17s} {claim.id:45s} {claim.section}: {claim.reason}")
            continue
        gpu = rec.gpu if rec.gpu == NOT_RUN else f"{rec.gpu} on {', '.join(rec.gpu_devices)}"
        if rec.gpu != NOT_RUN and rec.gpu_pending:
            gpu += f" ({rec.gpu_pending} not yet run on a GPU)"
        print(f"{rec.status:17s} {claim.id:45s} {rec.cpu:9s} {gpu}   {claim.section}")
        if args.brief:
            continue
        names = [g.name + (f" ({len(g.cases)} cases)" if len(g.cases) > 1 else "") for g in rec.groups]
        width = max([43, *map(len, names)])
        for g, name in zip(rec.groups, names, strict=True):
            print(f"{'':17s}   {name:{width}s} CPU {summary(g, 'cpu')}; GPU {summary(g, 'gpu')}")
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

    root = args.root
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
    parser.add_argument(
        "--root",
        help="repository root (default: the checkout holding the current directory, found upward "
        "as the first folder with mkdocs.yml and sessions/)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate all content (each mistake with its file and line)")
    check.add_argument("--all", action="store_true", help="list every warning, not the first few per file")
    check.set_defaults(func=cmd_check)
    claims = sub.add_parser(
        "claims", help="list every claim and the last status of its tests on CPUs and on a GPU"
    )
    claims.add_argument("--brief", action="store_true", help="one line per claim, without its tests")
    claims.set_defaults(func=cmd_claims)
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:  # the GPU job has its own options: python -m paperclub.gpu --help
        from paperclub.gpu import main as gpu_main

        return gpu_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        args.root = resolve_root(args.root)
    except NotACheckout as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush from failing again
        return 0


if __name__ == "__main__":
    sys.exit(main())
