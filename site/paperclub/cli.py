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
    import shutil
    import textwrap

    from paperclub.claims import NOT_RUN, summary
    from paperclub.content import load

    content, problems = load(args.root)
    if problems:
        print(
            f"note: the content has {len(problems)} problem(s); 'paperclub check' lists them", file=sys.stderr
        )
    width = max(80, min(shutil.get_terminal_size((100, 24)).columns, 160))
    indent = " " * 20

    def out(first: str, rest: str = "") -> None:
        """A claim's line, its long tail (reason, section) wrapped under it to the terminal's width."""
        print(first.rstrip())
        if rest:
            print(textwrap.fill(rest, width, initial_indent=indent, subsequent_indent=indent))

    print(f"{'status':17s} {'claim':45s} {'CPU':9s} GPU")
    counts: dict[str, int] = {}
    on_gpu = 0
    for claim in sorted(content.claims.values(), key=lambda c: c.id):
        rec = content.record(claim)
        counts[rec.status] = counts.get(rec.status, 0) + 1
        if not claim.reproducible:
            out(f"{rec.status:17s} {claim.id:45s} {claim.section}", f"why: {claim.reason}")
            continue
        gpu = rec.gpu if rec.gpu == NOT_RUN else f"{rec.gpu} on {', '.join(rec.gpu_devices)}"
        if rec.gpu != NOT_RUN and rec.gpu_pending:
            gpu += f" ({rec.gpu_pending} not yet run on a GPU)"
        on_gpu += rec.status == "passed" and rec.gpu == "passed"
        line = f"{rec.status:17s} {claim.id:45s} {rec.cpu:9s} {gpu}"
        section = f"   {claim.section}"
        if len(line + section) <= width:
            out(line + section)
        else:
            out(line, claim.section)
        if args.brief:
            continue
        names = [g.name + (f" ({len(g.cases)} cases)" if len(g.cases) > 1 else "") for g in rec.groups]
        name_width = max([43, *map(len, names)])
        for g, name in zip(rec.groups, names, strict=True):
            print(f"{'':17s}   {name:{name_width}s} CPU {summary(g, 'cpu')}; GPU {summary(g, 'gpu')}")
    total = sum(counts.values())
    testable = total - counts.get("not reproducible", 0)
    parts = [f"{counts.get('passed', 0)} of {testable} testable claims pass ({on_gpu} of them on a GPU too)"]
    parts += [f"{counts[k]} {k}" for k in ("failed", "skipped", "no test") if counts.get(k)]
    parts.append(f"{counts.get('not reproducible', 0)} not reproducible here")
    print(f"\n{total} claims: " + "; ".join(parts))
    return 0


def slugify(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words[:6]) or "session"


class Answers:
    """Where new-session's missing answers come from: the person at a terminal (prompts, asked again
    after a bad answer), or one line each from piped standard input (``printf '...\\n' | paperclub
    new-session``). Every answer is checked before anything is written."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())

    def ask(self, prompt: str, check, required: bool = True, option: str = ""):
        """``check(text) -> value`` raises ValueError with what is wrong; an empty answer is None when
        not required. At a terminal a bad answer is asked again; from a pipe it stops the command."""
        while True:
            if self.interactive:
                try:
                    text = input(f"{prompt}: ").strip()
                except EOFError:
                    text = None
            else:
                line = self.stream.readline()
                text = line.strip() if line else None
                if text is not None:
                    print(f"{prompt}: {text}", file=sys.stderr)
            if text is None:  # end of input
                if required:
                    raise SystemExit(
                        f"error: {prompt.split(' (')[0]} is required; pass it as {option or 'an option'} or "
                        "answer the prompt (see 'paperclub new-session --help')"
                    )
                return None
            if not text and not required:
                return None
            try:
                return check(text)
            except ValueError as exc:
                if not self.interactive:
                    raise SystemExit(f"error: {prompt.split(' (')[0]}: {exc}") from None
                print(f"  {exc}; try again", file=sys.stderr)


def parse_date(text: str) -> tuple[str | None, str]:
    """(date, date_known) from 'YYYY-MM-DD', 'YYYY-MM', 'planned' or 'unknown'."""
    text = text.strip()
    if text in ("planned", "unknown"):
        return None, text
    if not text:
        raise ValueError("give a date (YYYY-MM-DD or YYYY-MM), or 'planned' or 'unknown'")
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            _dt.date.fromisoformat(text)
            return text, "exact"
        if re.fullmatch(r"\d{4}-\d{2}", text):
            _dt.date.fromisoformat(text + "-01")
            return text, "approximate"
    except ValueError:
        raise ValueError(f"'{text}' is not a real date") from None
    raise ValueError(f"'{text}' is not a date: write YYYY-MM-DD, YYYY-MM, 'planned' or 'unknown'")


def _title(text: str) -> str:
    if len(text) < 3:
        raise ValueError("a title needs at least 3 characters")
    return text


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _arxiv_ids(text: str) -> list[str]:
    from paperclub.bibliography import valid_arxiv_id

    ids = [
        i.strip().removeprefix("arXiv:").removeprefix("arxiv:")
        for i in re.split(r"[,\s]+", text)
        if i.strip()
    ]
    for i in ids:
        if not valid_arxiv_id(i):
            raise ValueError(f"'{i}' is not an arXiv id like 2507.04786 (YYMM.NNNNN, a real month)")
    return ids


def _tags(text: str) -> list[str]:
    from paperclub.content import TAG

    tags = _names(text)
    for t in tags:
        if not TAG.match(t):
            raise ValueError(f"tag '{t}' must be lowercase words joined by '-', e.g. 'linear-attention'")
    return tags


def _author(text: str) -> str:
    last = text.split(",")[0].strip()
    if not re.search(r"[A-Za-z]", last) or last.upper() == "TODO":
        raise ValueError(f"'{text}' is not a name; write 'Last, First'")
    return text


def cmd_new_session(args: argparse.Namespace) -> int:
    from paperclub.content import URL, load

    root = args.root
    answers = Answers()
    # the options given are checked first; what is missing is asked for, in this order; nothing is
    # written before every answer has been checked
    arxiv_ids: list[str] = []
    tags: list[str] = []
    for option, values, check in (("--arxiv", args.arxiv, _arxiv_ids), ("--tag", args.tag, _tags)):
        if values:
            try:
                parsed = check(",".join(values))
            except ValueError as exc:
                raise SystemExit(f"error: {option}: {exc}") from None
            arxiv_ids, tags = (parsed, tags) if option == "--arxiv" else (arxiv_ids, parsed)
    for option, url in (("--slides", args.slides), ("--recording", args.recording)):
        if url and not URL.match(url):
            raise SystemExit(
                f"error: {option} '{url}' must be an https:// URL"
                + (" (put a slides file in the folder by hand)" if option == "--slides" else "")
            )
    given_date = None
    if args.date:
        try:
            given_date = parse_date(args.date)
        except ValueError as exc:
            raise SystemExit(f"error: --date: {exc}") from None
    title = _title(args.title) if args.title else answers.ask("title", _title, option="--title")
    if given_date:
        date, date_known = given_date
    elif args.date_known in ("planned", "unknown"):
        date, date_known = None, args.date_known
    else:
        date, date_known = answers.ask(
            "date (YYYY-MM-DD; YYYY-MM when only the month is known; 'planned' or 'unknown')",
            parse_date,
            option="--date",
        )
    if args.date_known:
        date_known = args.date_known
    presenters = (
        args.presenter
        or answers.ask(
            "presenters (names separated by commas; empty if not known yet)", _names, required=False
        )
        or []
    )
    if not args.arxiv:
        arxiv_ids = (
            answers.ask(
                "arXiv ids of the papers (separated by commas; empty if none)", _arxiv_ids, required=False
            )
            or []
        )
    if not args.tag:
        tags = (
            answers.ask("tags (lowercase words joined by '-', separated by commas)", _tags, required=False)
            or []
        )
    summary = args.summary or answers.ask(
        "summary (one or two sentences for the sessions index)", lambda t: t, required=False
    )

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
    new_ids = [
        i
        for i in arxiv_ids
        if not any(e.eprint and e.eprint.split("v")[0] == i.split("v")[0] for e in content.bib.values())
    ]
    if len(new_ids) > 1 and (args.paper_title or args.paper_author or args.paper_year):
        raise SystemExit(
            "error: --paper-title, --paper-author and --paper-year describe one new paper; add the others one session at a time or by hand"
        )
    for arxiv in arxiv_ids:
        existing = [
            e for e in content.bib.values() if e.eprint and e.eprint.split("v")[0] == arxiv.split("v")[0]
        ]
        if existing:
            keys.append(existing[0].key)
            continue
        paper_title = args.paper_title or answers.ask(
            f"title of arXiv:{arxiv} (for its bib entry)", _title, option="--paper-title"
        )
        authors = args.paper_author or [
            answers.ask(f"first author of arXiv:{arxiv} ('Last, First')", _author, option="--paper-author")
        ]
        for a in authors:
            try:
                _author(a)
            except ValueError as exc:
                raise SystemExit(f"error: --paper-author: {exc}") from None
        year = args.paper_year or "20" + arxiv[:2]
        last = re.sub(r"[^a-z]", "", authors[0].split(",")[0].lower()) or "author"
        word = next(
            (
                w
                for w in re.findall(r"[a-z0-9]+", paper_title.lower())
                if w not in {"a", "an", "the", "on", "of"}
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

    lines = [f"title: {_q(title)}"]
    if args.number:
        lines.insert(0, f"number: {args.number}")
    if date:
        lines.append(f"date: {date}")
    lines.append(f"date_known: {date_known}")
    lines.append(f"presenters: [{', '.join(_q(p) for p in presenters)}]")
    lines.append(f"papers: [{', '.join(keys)}]")
    if args.recording:
        lines.append(f"recording: {args.recording}")
    if args.slides:
        lines.append(f"slides: {args.slides}")
    if args.repro:
        lines.append(f"repro: {args.repro}")
    lines.append(f"tags: [{', '.join(tags)}]")
    if summary:
        lines.append(f"summary: {_q(summary)}")

    folder.mkdir(parents=True)
    (folder / "session.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "slides.md").write_text(
        f"# {title}\n\n{', '.join(presenters) or 'Presenter'}\n\n---\n\n## Why this paper\n\n- ...\n\n---\n\n## The idea\n\n- ...\n",
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
    if new_papers:
        print("next: write the paper page's sections (check fails on an empty one), the slides and notes,")
        print("      then run 'paperclub check'")
    else:
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
    new = sub.add_parser(
        "new-session",
        help="scaffold a session folder (asks for what is missing: at a terminal, or one answer a line "
        "from piped input)",
    )
    new.add_argument("--title")
    new.add_argument(
        "--date", help="YYYY-MM-DD, YYYY-MM when only the month is known, 'planned' or 'unknown'"
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
