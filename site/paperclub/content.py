"""The content model: sessions, paper pages, bibliography and reproductions, loaded and checked.

``load(root)`` reads everything and returns a :class:`Content` plus the list of
:class:`Problem` found; each problem names the file, the field and what to do. ``paperclub check``
prints them; the site build refuses to run while there are any.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from paperclub import ROOT
from paperclub.bench import drawn_rows
from paperclub.bibliography import BibEntry, load_bibliography
from paperclub.claims import (
    GPU_CHECKS_NAME,
    GPU_RESULTS_NAME,
    RESULTS_NAME,
    ClaimRecord,
    ClaimsError,
    UniqueKeyLoader,
    claim_record,
    load_registry,
    load_results,
    package_dirs,
)

SLUG = r"[a-z0-9]+(?:-[a-z0-9]+)*"
FOLDER = re.compile(
    rf"^(?P<prefix>\d{{4}}-\d{{2}}-\d{{2}}|\d{{4}}-\d{{2}}|undated|planned)-(?P<slug>{SLUG})$"
)
TAG = re.compile(rf"^{SLUG}$")
URL = re.compile(r"^https?://[^\s/$.?#][^\s]*\.[^\s]+$")
BIBKEY = re.compile(r"^[a-z][a-z0-9]*$")
FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.S)


@dataclass(frozen=True)
class Problem:
    """One mistake in the content: where it is (file and line), which field, what is wrong, what to do.

    Printed as ``file:line: field 'x': message``; :func:`load` fills in the line of problems made
    without one (the line of the field, entry or claim they name)."""

    file: str
    field: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: field '{self.field}': {self.message}" if self.field else f"{where}: {self.message}"


def check_tags(tags: list[str]) -> list[str]:
    for t in tags:
        if not TAG.match(t):
            raise ValueError(f"tag '{t}' must be lowercase words joined by '-', e.g. 'linear-attention'")
    return tags


class SessionMeta(BaseModel):
    """``sessions/<folder>/session.yaml``."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    number: int | None = Field(default=None, ge=1)
    # the session's number in the group's public archive (which numbers sessions 1-18)
    archive_number: int | None = Field(default=None, ge=1)
    title: str = Field(min_length=3)
    date: str | None = None
    date_known: Literal["exact", "approximate", "unknown", "planned"]
    presenters: list[str] = Field(default_factory=list)
    papers: list[str] = Field(default_factory=list)
    recording: str | None = None
    slides: str | None = None
    repro: str | None = None
    tags: list[str] = Field(default_factory=list)
    summary: str | None = None

    @field_validator("date", mode="before")
    @classmethod
    def _date(cls, v):
        if v is None:
            return None
        if isinstance(v, _dt.datetime):
            raise ValueError("must be a date (YYYY-MM-DD or YYYY-MM), not a date and time")
        if isinstance(v, _dt.date):
            return v.isoformat()
        if isinstance(v, int):
            raise ValueError(f"{v} is not a date; write YYYY-MM-DD, or YYYY-MM when only the month is known")
        v = str(v).strip()
        try:
            if re.fullmatch(r"\d{4}-\d{2}-\d{2}", v):
                _dt.date.fromisoformat(v)
            elif re.fullmatch(r"\d{4}-\d{2}", v):
                _dt.date.fromisoformat(v + "-01")
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"'{v}' is not a real date; write YYYY-MM-DD, or YYYY-MM when only the month is known"
            ) from None
        return v

    @field_validator("presenters", "tags", "papers", mode="before")
    @classmethod
    def _list(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            raise ValueError(f"must be a list, e.g. [{v}]")
        return v

    @field_validator("presenters")
    @classmethod
    def _presenters(cls, v):
        for p in v:
            if not p.strip():
                raise ValueError("a presenter's name is empty")
        return v

    @field_validator("recording")
    @classmethod
    def _url(cls, v):
        if v is not None and not URL.match(v):
            raise ValueError(f"'{v}' is not a URL; give the full https:// address of the recording")
        return v

    _tags = field_validator("tags")(lambda cls, v: check_tags(v))

    @field_validator("papers")
    @classmethod
    def _keys(cls, v):
        for k in v:
            if not BIBKEY.match(k):
                raise ValueError(
                    f"'{k}' is not a bib key (lowercase letters and digits, e.g. dao2022flashattention)"
                )
        if len(set(v)) != len(v):
            raise ValueError("a paper is listed twice")
        return v

    @model_validator(mode="after")
    def _date_consistency(self):
        if self.date_known == "exact" and (self.date is None or len(self.date) != 10):
            raise ValueError("date_known is 'exact' but 'date' is not a full YYYY-MM-DD date")
        if self.date_known == "approximate" and self.date is None:
            raise ValueError("date_known is 'approximate' but there is no 'date'; give the best guess")
        if self.date_known in ("unknown", "planned") and self.date is not None:
            raise ValueError(
                f"date_known is '{self.date_known}' but a 'date' is given; use 'exact' or 'approximate'"
            )
        return self


class PaperMeta(BaseModel):
    """The front matter of ``papers/<bibkey>.md``."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    bibkey: str
    title: str = Field(min_length=3)
    sessions: list[str] = Field(default_factory=list)
    repro: str | None = None
    tags: list[str] = Field(default_factory=list)

    _tags = field_validator("tags")(lambda cls, v: check_tags(v))


@dataclass
class Session:
    folder: str
    path: Path
    meta: SessionMeta
    deck: Path | None
    notes: Path | None

    @property
    def slug(self) -> str:
        m = FOLDER.match(self.folder)
        return m.group("slug") if m else self.folder

    @property
    def slides_url(self) -> str | None:
        s = self.meta.slides
        return s if s and URL.match(s) else None

    @property
    def slides_file(self) -> Path | None:
        s = self.meta.slides
        return self.path / s if s and not URL.match(s) else None

    @property
    def sort_key(self) -> tuple:
        """Newest first: planned, then dated (by date, then number), then undated by number."""
        m = self.meta
        if m.date_known == "planned":
            return (3, "9999", 0)
        if m.date:
            return (2, m.date, m.number or 0)
        return (1, "", m.number or 0)

    def display_date(self) -> str:
        m = self.meta
        if m.date_known == "planned":
            return "planned"
        if not m.date:
            return "date unknown"
        if m.date_known == "approximate":
            return f"about {m.date}"
        return m.date


@dataclass
class Paper:
    key: str
    path: Path
    meta: PaperMeta
    body: str


@dataclass
class Repro:
    name: str
    path: Path
    planned: bool = False
    walkthrough: Path | None = None
    description: str = ""  # for planned repros: what repro/planned.yaml says it will be


@dataclass
class Content:
    root: Path
    sessions: list[Session] = field(default_factory=list)
    papers: dict[str, Paper] = field(default_factory=dict)
    bib: dict[str, BibEntry] = field(default_factory=dict)
    repros: dict[str, Repro] = field(default_factory=dict)
    claims: dict = field(default_factory=dict)
    # what check prints but does not fail on (line links, formulas it could not check)
    warnings: list[Problem] = field(default_factory=list)
    _results: dict = field(default_factory=dict, repr=False)

    def record(self, claim) -> ClaimRecord:
        """Where and how a claim's tests ran: on CPUs (claims.json) and on a GPU (claims-gpu.json).

        Each package's two files are read once; a missing file means its tests did not run there.
        """
        if claim.package not in self._results:
            path = self.repros[claim.package].path
            self._results[claim.package] = (
                load_results(path, RESULTS_NAME),
                load_results(path, GPU_RESULTS_NAME),
            )
        cpu, gpu = self._results[claim.package]
        return claim_record(claim, cpu, gpu)

    def status(self, claim) -> tuple[str, list[dict]]:
        """A claim's overall status (CPU and GPU runs together) and its recorded tests."""
        rec = self.record(claim)
        return rec.status, rec.tests

    def sessions_newest_first(self) -> list[Session]:
        """Planned first, then held sessions newest first. An undated session with a number sits where
        its number puts it among the numbered ones (session 2, date unknown, between sessions 1 and 3)."""
        ordered = sorted(self.sessions, key=lambda s: s.sort_key)  # oldest first
        placed = [s for s in ordered if not (s.meta.number and s.sort_key[0] == 1)]
        for s in [s for s in ordered if s.meta.number and s.sort_key[0] == 1]:
            later = [i for i, t in enumerate(placed) if t.meta.number and t.meta.number > s.meta.number]
            planned = [i for i, t in enumerate(placed) if t.meta.date_known == "planned"]
            placed.insert(later[0] if later else planned[0] if planned else len(placed), s)
        return placed[::-1]

    def sessions_for_paper(self, key: str) -> list[Session]:
        return [s for s in self.sessions_newest_first() if key in s.meta.papers]


def rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _pydantic_problems(exc: ValidationError, file: str, hints: dict[str, str]) -> list[Problem]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required but missing"
        elif err["type"] == "extra_forbidden":
            msg = f"is not a known field; allowed fields: {', '.join(hints['_fields'])}"
        elif err["type"] == "literal_error":
            msg = f"{err['input']!r} is not allowed; {msg.lower()}"
        hint = hints.get(loc.split(".")[0])
        if hint and err["type"] != "extra_forbidden":
            msg = f"{msg} ({hint})"
        out.append(Problem(file, loc, msg))
    return out


SESSION_HINTS = {
    "_fields": list(SessionMeta.model_fields),
    "title": "the session's title in quotes",
    "date_known": "one of exact, approximate, unknown, planned",
    "presenters": "a list of names, e.g. [Ada Lovelace]",
    "papers": "a list of bib keys from bib/*.bib",
    "number": "the group's session number, a whole number",
    "archive_number": "the session's number in the group's public archive, a whole number",
}
PAPER_HINTS = {"_fields": list(PaperMeta.model_fields), "bibkey": "the key of this paper in bib/*.bib"}


class _Loader(UniqueKeyLoader):
    """Safe YAML that refuses a key given twice; dates stay strings: the schema checks them and can
    name the field."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_yaml(path: Path, root: Path) -> tuple[object, list[Problem]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None, [Problem(rel(path, root), "", "is not UTF-8 text; save it as UTF-8")]
    try:
        return yaml.load(text, Loader=_Loader), []
    except yaml.YAMLError as exc:
        line, message = yaml_error(exc)
        return None, [Problem(rel(path, root), "", message, line)]


def load_session(folder: Path, root: Path) -> tuple[Session | None, list[Problem]]:
    path = folder / "session.yaml"
    file = rel(path, root)
    if not path.exists():
        return None, [
            Problem(
                rel(folder, root),
                "",
                "has no session.yaml; every session folder needs one (paperclub new-session makes it)",
            )
        ]
    data, problems = read_yaml(path, root)
    if problems:
        return None, problems
    if not isinstance(data, dict):
        return None, [
            Problem(file, "", "must be a mapping of fields (title: ..., date: ...), not a list or a scalar")
        ]
    try:
        meta = SessionMeta.model_validate(data)
    except ValidationError as exc:
        return None, _pydantic_problems(exc, file, SESSION_HINTS)
    deck = folder / "slides.md"
    notes = folder / "notes.md"
    return Session(
        folder.name, folder, meta, deck if deck.exists() else None, notes if notes.exists() else None
    ), []


def yaml_error(exc: yaml.YAMLError, first_line: int = 1) -> tuple[int | None, str]:
    """(line, one-line message) of a YAML error; ``first_line``: the file line of the text's first line."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + first_line if mark else None
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if isinstance(exc, yaml.constructor.ConstructorError) and "appears twice" in problem:
        return line, problem  # a duplicate key, said plainly (UniqueKeyLoader)
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context and context not in problem else problem
    return line, f"is not valid YAML: {detail}; fix the syntax"


def split_front_matter(text: str) -> tuple[dict | None, str, str | None]:
    m = FRONT_MATTER.match(text)
    if not m:
        return None, text, "has no front matter; start it with a '---' block holding bibkey, title, sessions"
    try:
        meta = yaml.load(m.group(1), Loader=_Loader)
    except yaml.YAMLError as exc:
        line, message = yaml_error(exc, first_line=2)
        return None, text, f"front matter, line {line}: {message}"
    if not isinstance(meta, dict):
        return None, text, "front matter must be a mapping of fields"
    return meta, text[m.end() :], None


def load_paper(path: Path, root: Path) -> tuple[Paper | None, list[Problem]]:
    file = rel(path, root)
    meta, body, err = split_front_matter(path.read_text(encoding="utf-8"))
    if err:
        at = re.match(r"front matter, line (\d+): (.*)", err, re.S)
        if at:  # a YAML error inside the front matter: the file's line
            return None, [Problem(file, "", f"front matter {at.group(2)}", int(at.group(1)))]
        return None, [Problem(file, "", err, 1)]
    try:
        pm = PaperMeta.model_validate(meta)
    except ValidationError as exc:
        return None, _pydantic_problems(exc, file, PAPER_HINTS)
    if pm.bibkey != path.stem:
        return None, [
            Problem(file, "bibkey", f"is '{pm.bibkey}' but the file is named '{path.name}'; they must agree")
        ]
    return Paper(pm.bibkey, path, pm, body), []


def load_repros(root: Path) -> tuple[dict[str, Repro], list[Problem]]:
    repros: dict[str, Repro] = {}
    problems: list[Problem] = []
    for name, d in package_dirs(root):
        nb = d / "walkthrough.ipynb"
        repros[name] = Repro(name, d, walkthrough=nb if nb.exists() else None)
    planned = root / "repro" / "planned.yaml"
    if planned.exists():
        data, probs = read_yaml(planned, root)
        problems += probs
        if isinstance(data, dict):
            for name in data:
                if name in repros:
                    problems.append(
                        Problem(
                            rel(planned, root),
                            name,
                            f"is listed as planned but repro/{name}/ exists; remove it from planned.yaml",
                        )
                    )
                elif not re.fullmatch(SLUG, str(name)):
                    problems.append(
                        Problem(
                            rel(planned, root),
                            str(name),
                            "is not a valid repro name (lowercase, digits, '-')",
                        )
                    )
                else:
                    repros[name] = Repro(
                        name, root / "repro" / name, planned=True, description=str(data[name] or "")
                    )
        elif data is not None:
            problems.append(Problem(rel(planned, root), "", "must map repro names to a short description"))
    return repros, problems


@dataclass
class _Broken:
    """What is there but failed to load. A cross-reference to it is not a second mistake: the first
    message already names what to fix, so checks that follow from it stay quiet (one mistake, one message)."""

    sessions: set[str] = field(default_factory=set)  # session folders whose session.yaml failed
    papers: set[str] = field(default_factory=set)  # papers/<key>.md files that failed to load
    bib_keys: set[str] = field(default_factory=set)  # keys written in bib/*.bib whose entry failed
    bib: bool = False  # bib/ itself is missing
    planned: bool = False  # repro/planned.yaml could not be read

    def bib_key(self, key: str) -> bool:
        return self.bib or key in self.bib_keys


BIB_KEY_WRITTEN = re.compile(r"@\s*(\w+)\s*[{(]\s*([^,\s{}()]+)\s*,")


def _keys_written(bib_dir: Path) -> set[str]:
    """Every entry key the .bib files spell out, parsed or not (to tell a broken entry from a missing one)."""
    keys: set[str] = set()
    for path in sorted(bib_dir.glob("*.bib")) if bib_dir.is_dir() else []:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for m in BIB_KEY_WRITTEN.finditer(text):
            if m.group(1).lower() not in ("comment", "string", "preamble"):
                keys.add(m.group(2))
    return keys


def load(root: Path = ROOT) -> tuple[Content, list[Problem]]:
    """Read all content under ``root`` and cross-check it; never raises on bad content.

    Each mistake is reported once: a cross-reference to something that exists but failed to load
    (a session whose session.yaml is invalid, a paper page without front matter, a bib entry that
    does not parse, an unreadable planned.yaml) is not reported again as a dangling reference.
    """
    content = Content(root=root)
    problems: list[Problem] = []
    broken = _Broken()

    content.bib, bib_problems = load_bibliography(root / "bib", root)
    problems += [Problem(*p) for p in bib_problems]
    broken.bib = not (root / "bib").is_dir()
    broken.bib_keys = _keys_written(root / "bib") - set(content.bib)
    content.repros, rp = load_repros(root)
    problems += rp
    broken.planned = any(not p.field for p in rp)  # the file itself, not one of its names

    sessions_dir = root / "sessions"
    slugs: dict[str, str] = {}
    for folder in sorted(p for p in sessions_dir.iterdir() if p.is_dir()) if sessions_dir.is_dir() else []:
        if folder.name.startswith((".", "_")):
            continue
        session, probs = load_session(folder, root)
        problems += probs
        m = FOLDER.match(folder.name)
        if not m:
            problems.append(
                Problem(
                    rel(folder, root),
                    "",
                    "folder name must be '<YYYY-MM-DD>-<slug>', '<YYYY-MM>-<slug>', 'undated-<slug>' or 'planned-<slug>' (slug: lowercase words joined by '-')",
                )
            )
        elif m.group("slug") in slugs:
            problems.append(
                Problem(
                    rel(folder, root),
                    "",
                    f"slug '{m.group('slug')}' is already used by sessions/{slugs[m.group('slug')]}; choose another",
                )
            )
        else:
            slugs[m.group("slug")] = folder.name
        if session is None:
            broken.sessions.add(folder.name)
            continue
        content.sessions.append(session)
        problems += _check_session(session, m, content, root, broken)

    problems += _check_numbers(content.sessions, root)

    papers_dir = root / "papers"
    for path in sorted(papers_dir.glob("*.md")) if papers_dir.is_dir() else []:
        paper, probs = load_paper(path, root)
        problems += probs
        if paper is None:
            broken.papers.add(path.stem)
            continue
        content.papers[paper.key] = paper
        file = rel(path, root)
        if paper.key not in content.bib and not broken.bib_key(paper.key):
            problems.append(
                Problem(
                    file,
                    "bibkey",
                    f"'{paper.key}' has no entry in bib/*.bib; add one (title, author, year, url, eprint)",
                )
            )
        folders = {s.folder for s in content.sessions}
        for s in paper.meta.sessions:
            if s not in folders and s not in broken.sessions:
                problems.append(
                    Problem(
                        file,
                        "sessions",
                        f"'{s}' is not a folder in sessions/; use the folder name of the session",
                    )
                )
        if paper.meta.repro and paper.meta.repro not in content.repros and not broken.planned:
            problems.append(
                Problem(
                    file,
                    "repro",
                    f"'{paper.meta.repro}' is neither a folder in repro/ nor listed in repro/planned.yaml",
                )
            )

    for s in content.sessions:
        for key in s.meta.papers:
            if key in content.bib and key not in content.papers and key not in broken.papers:
                problems.append(
                    Problem(
                        f"papers/{key}.md",
                        "",
                        f"is missing; sessions/{s.folder} cites '{key}', and every cited paper needs a summary page",
                    )
                )

    try:
        content.claims = load_registry(root)
    except ClaimsError as exc:
        problems.append(Problem(exc.file, exc.field, exc.message, exc.line))
    problems += _check_claims(content, root, broken)
    problems += _check_results(content, root)
    problems += _check_pages(content, root)
    problems += _check_lab(content, root)
    problems += [
        Problem(key_file, f"@article{{{key}}}", "the key is a placeholder (made from a TODO author); name it "
                "<firstauthorlastname><year><firstword>, e.g. dao2022flashattention, and rename the paper page")
        for key, key_file in ((k, e.file) for k, e in content.bib.items())
        if key.startswith("todo")
    ]  # fmt: skip
    return content, [_locate(p, root) for p in problems]


def _markdown_sources(content: Content, root: Path) -> list:
    """Every markdown file the site renders from the repository: paper pages (their body), session
    notes and decks, and the hand-written pages of site/pages."""
    from paperclub.lint import Doc

    docs = []
    for paper in content.papers.values():
        text = paper.path.read_text(encoding="utf-8")
        offset = text[: len(text) - len(paper.body)].count("\n")
        docs.append(Doc(rel(paper.path, root), paper.body, first_line=offset + 1))
    for s in content.sessions:
        if s.notes is not None:
            docs.append(Doc(rel(s.notes, root), s.notes.read_text(encoding="utf-8")))
        if s.deck is not None:
            docs.append(Doc(rel(s.deck, root), s.deck.read_text(encoding="utf-8"), deck=True))
    pages = root / "site" / "pages"
    for path in sorted(pages.rglob("*.md")) if pages.is_dir() else []:
        docs.append(Doc(rel(path, root), path.read_text(encoding="utf-8")))
    return docs


def _check_pages(content: Content, root: Path) -> list[Problem]:
    """What the site renders: formulas, diagrams, raw '$$', empty sections of paper pages, links to
    code (a missing file or symbol is an error, a line link a warning in ``content.warnings``)."""
    from paperclub.codelinks import check_links
    from paperclub.lint import check_paper_sections, check_rendering

    docs = _markdown_sources(content, root)
    out: list[Problem] = []
    findings, note = check_rendering(docs, root)
    out += [Problem(f.file, "", f.message, f.line) for f in findings]
    if note:
        content.warnings.append(Problem("site", "", note))
    for paper in content.papers.values():
        doc = next(d for d in docs if d.file == rel(paper.path, root))
        out += [
            Problem(f.file, "", f.message, f.line)
            for f in check_paper_sections(doc.file, doc.text, doc.first_line)
        ]
    for doc in docs:
        for issue in check_links(doc.text, doc.file, root, doc.first_line):
            problem = Problem(doc.file, "", issue.message, issue.line)
            (out if issue.error else content.warnings).append(problem)
    return out


def _check_lab(content: Content, root: Path) -> list[Problem]:
    """The lab tools (``repro/<name>/lab/``, ``nanoparallel/cuda/lab/``): each module needs a docstring and
    each shell script a leading comment, which the site's Lab tools page shows (``paperclub.lab_page``)."""
    from paperclub.lab_page import lab_problems

    packages = [(name, r.path) for name, r in content.repros.items() if not r.planned]
    return [Problem(file, "", message, line) for file, line, message in lab_problems(packages, root)]


def _locate(p: Problem, root: Path) -> Problem:
    """``p`` with the line of what it names (a YAML field, a bib entry, a claim), when it has none."""
    if p.line is not None:
        return p
    path = root / p.file
    if not path.is_file():
        return p
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return p
    field_, message = p.field, p.message

    def first(pattern: str, within: range | None = None) -> int | None:
        rx = re.compile(pattern)
        for i in within or range(len(lines)):
            if rx.search(lines[i]):
                return i + 1
        return None

    line = None
    m = re.fullmatch(r"line (\d+)", field_)
    entry = re.fullmatch(r"@(\w+)\{(.+?)\}(?:\.(\w+))?", field_)
    if m:
        line, field_ = int(m.group(1)), ""
    elif entry:
        key, sub = entry.group(2), entry.group(3)
        line = first(rf"@\s*\w+\s*[{{(]\s*{re.escape(key)}\s*,")
        if line and sub:
            end = next((i for i in range(line, len(lines)) if lines[i].lstrip().startswith("@")), len(lines))
            line = first(rf"(?i)^\s*{re.escape(sub)}\s*=", range(line, end)) or line
        field_, message = "", f"entry '{key}'" + (f", field '{sub}'" if sub else "") + f": {message}"
    elif p.file.endswith("claims.yaml") and re.fullmatch(r"claims\[(\d+)\]", field_):
        line = _claim_item_line(path, int(re.fullmatch(r"claims\[(\d+)\]", field_).group(1)))
        field_ = ""
    elif p.file.endswith("claims.yaml") and "/" in field_:
        line = first(rf"^\s*-?\s*id:\s*['\"]?{re.escape(field_)}['\"]?\s*$")
        field_, message = "", f"claim '{field_}' {message}"
    else:
        region = range(len(lines))
        if p.file.endswith(".md") and lines and lines[0].strip() == "---":
            end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), len(lines))
            region = range(1, end)
        name = field_.split(".")[0] or (re.match(r"(\w+) is ", message) or [None, ""])[1]
        if name:
            line = first(rf"^{re.escape(name)}\s*:", region)
    return Problem(p.file, field_, message, line or 1)


def _claim_item_line(path: Path, index: int) -> int | None:
    try:
        doc = yaml.compose(path.read_text(encoding="utf-8"))
        claims = next(v for k, v in doc.value if k.value == "claims")
        return claims.value[index].start_mark.line + 1
    except Exception:  # a file that does not compose was reported with its own line
        return None


def _check_session(
    session: Session, m: re.Match | None, content: Content, root: Path, broken: _Broken | None = None
) -> list[Problem]:
    broken = broken or _Broken()
    meta = session.meta
    file = rel(session.path / "session.yaml", root)
    out: list[Problem] = []
    if m:
        prefix = m.group("prefix")
        expected = meta.date if meta.date else ("planned" if meta.date_known == "planned" else "undated")
        if prefix != expected:
            out.append(
                Problem(
                    file,
                    "date",
                    f"folder starts with '{prefix}' but the date says '{expected}'; rename the folder to '{expected}-{m.group('slug')}' or fix the date",
                )
            )
    for key in meta.papers:
        if key not in content.bib and not broken.bib_key(key):
            out.append(
                Problem(
                    file, "papers", f"'{key}' is not a key in bib/*.bib; add the BibTeX entry or fix the key"
                )
            )
    if meta.slides and not URL.match(meta.slides):
        target = session.path / meta.slides
        if ".." in Path(meta.slides).parts or not target.is_file():
            out.append(
                Problem(
                    file,
                    "slides",
                    f"'{meta.slides}' is neither an https:// URL nor a file in {rel(session.path, root)}/",
                )
            )
    if meta.repro and meta.repro not in content.repros and not broken.planned:
        out.append(
            Problem(
                file,
                "repro",
                f"'{meta.repro}' is neither a folder in repro/ nor listed in repro/planned.yaml",
            )
        )
    if session.deck is not None:
        from paperclub.lint import check_deck

        text = session.deck.read_text(encoding="utf-8")
        deck = rel(session.deck, root)
        if not text.strip():
            out.append(Problem(deck, "", "is empty; write the slides or delete the file", 1))
        else:
            out += [Problem(f.file, "", f.message, f.line) for f in check_deck(deck, text)]
    return out


def slide_spans(text: str) -> list[tuple[int, str]]:
    """A deck's slides with the file line each starts on: slides are separated by a line holding only
    '---' outside fenced code (a '---' inside a code block belongs to the code)."""
    spans: list[tuple[int, str]] = []
    current: list[str] = []
    start = 1
    fence: str | None = None
    for i, line in enumerate(text.splitlines(), start=1):
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence) :].strip():
            fence = None
        if fence is None and re.fullmatch(r"---\s*", line):
            spans.append((start, current))
            current, start = [], i + 1
            continue
        current.append(line)
    spans.append((start, current))
    out = []
    for first, lines in spans:
        while lines and not lines[0].strip():  # the slide starts at its first written line
            lines, first = lines[1:], first + 1
        body = "\n".join(lines).strip("\n")
        if body.strip():
            out.append((first, body))
    return out


def _check_numbers(sessions: list[Session], root: Path) -> list[Problem]:
    """A session number (ours, or the archive's) names one session."""
    out: list[Problem] = []
    for name in ("number", "archive_number"):
        first: dict[int, str] = {}
        for s in sorted(sessions, key=lambda s: s.folder):
            value = getattr(s.meta, name)
            if value is None:
                continue
            if value in first:
                out.append(
                    Problem(
                        rel(s.path / "session.yaml", root),
                        name,
                        f"{value} is already the {name} of sessions/{first[value]}; each session has its own",
                    )
                )
            else:
                first[value] = s.folder
    return out


def split_slides(text: str) -> list[str]:
    """A deck's slides (see :func:`slide_spans`)."""
    return [body for _, body in slide_spans(text)]


def front_matter_end(text: str) -> int | None:
    """The line of the closing '---' when ``text`` starts with a YAML front matter block, else None."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for i, line in enumerate(lines[1:], start=2):
        if line.strip() == "---":
            inner = [ln for ln in lines[1 : i - 1] if ln.strip()]
            if inner and all(
                re.match(r"^[A-Za-z_][\w-]*\s*:", ln) or ln.startswith((" ", "-")) for ln in inner
            ):
                return i
            return None
    return None


def _check_claims(content: Content, root: Path, broken: _Broken | None = None) -> list[Problem]:
    broken = broken or _Broken()
    out: list[Problem] = []
    markers = claim_markers(root)
    marked = {m.claim for m in markers}
    by_pkg: dict[str, list] = {}
    for claim in content.claims.values():
        by_pkg.setdefault(claim.package, []).append(claim)
    for pkg, claims in by_pkg.items():
        repro = content.repros.get(pkg)
        if repro is None:
            continue
        sources = "\n".join(p.read_text(encoding="utf-8") for p in _test_files(pkg, repro.path, root))
        file = rel(repro.path / "claims.yaml", root)
        for claim in claims:
            if claim.paper not in content.bib and not broken.bib_key(claim.paper):
                out.append(Problem(file, claim.id, f"paper '{claim.paper}' is not a key in bib/*.bib"))
            written = f'"{claim.id}"' in sources or f"'{claim.id}'" in sources
            if claim.reproducible and claim.id not in marked and not written:
                out.append(
                    Problem(
                        file,
                        claim.id,
                        "has no test: mark a property test with @pytest.mark.claim('"
                        f"{claim.id}', section=...) or register it as reproducible: false with a reason",
                    )
                )
    if content.claims or not any(p.exists() for _, d in package_dirs(root) for p in [d / "claims.yaml"]):
        # a marker naming no registered claim (a typo), or the wrong section: found here, with its line,
        # rather than by pytest at collection (unless the registry itself failed to load)
        for m in markers:
            claim = content.claims.get(m.claim)
            if claim is None:
                near = difflib.get_close_matches(m.claim, list(content.claims), n=1, cutoff=0.6)
                hint = f"; did you mean '{near[0]}'?" if near else ""
                pkg = m.claim.split("/")[0]
                out.append(
                    Problem(
                        m.file,
                        "",
                        f"@pytest.mark.claim('{m.claim}') names no registered claim{hint} "
                        f"(register it in {pkg}/claims.yaml or fix the id)",
                        m.line,
                    )
                )
            elif m.section is not None and m.section.strip() != claim.section:
                out.append(
                    Problem(
                        m.file,
                        "",
                        f"claim '{m.claim}' says section {m.section!r} but claims.yaml registers {claim.section!r}",
                        m.line,
                    )
                )
    return out


@dataclass(frozen=True)
class ClaimMarker:
    file: str
    line: int
    claim: str
    section: str | None


def claim_markers(root: Path) -> list[ClaimMarker]:
    """Every ``@pytest.mark.claim("<id>", section=...)`` with a literal id in the test files of the
    reproductions and nanoparallel, with its line."""
    import ast

    out = []
    files = sorted({p for name, d in package_dirs(root) for p in _test_files(name, d, root)})
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            func = node.func
            if func.attr != "claim" or not (
                isinstance(func.value, ast.Attribute) and func.value.attr == "mark"
            ):
                continue
            if (
                not node.args
                or not isinstance(node.args[0], ast.Constant)
                or not isinstance(node.args[0].value, str)
            ):
                continue
            section = next(
                (
                    k.value.value
                    for k in node.keywords
                    if k.arg == "section" and isinstance(k.value, ast.Constant)
                ),
                None,
            )
            out.append(ClaimMarker(rel(path, root), node.lineno, node.args[0].value, section))
    return out


def _test_files(pkg: str, path: Path, root: Path) -> list[Path]:
    files = [p for p in path.rglob("test_*.py")]
    if pkg == "nanoparallel":
        files += list((root / "tests" / "nanoparallel").rglob("test_*.py"))
    return files


RESULT_KEYS = ("package", "title", "date", "device", "environment", "columns", "rows")


def _check_results(content: Content, root: Path) -> list[Problem]:
    out = []
    for repro in content.repros.values():
        d = repro.path / "results"
        for f in sorted(d.glob("*.json")) if d.is_dir() else []:
            file = rel(f, root)
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                out.append(Problem(file, "", f"is not valid JSON ({exc.msg} at line {exc.lineno})"))
                continue
            if f.name in (RESULTS_NAME, GPU_RESULTS_NAME, GPU_CHECKS_NAME):
                continue
            missing = [k for k in RESULT_KEYS if k not in doc]
            if missing:
                out.append(
                    Problem(
                        file, ", ".join(missing), "missing; write result files with paperclub.bench.Report"
                    )
                )
            content.warnings += _empty_plots(file, doc)
    return out


def _empty_plots(file: str, doc: dict) -> list[Problem]:
    """Plots of a result that select no row with numbers to draw (the site leaves them out)."""
    out = []
    rows = doc.get("rows") if isinstance(doc.get("rows"), list) else []
    for plot in doc.get("plots") or []:
        if not isinstance(plot, dict) or not all(isinstance(plot.get(k), str) for k in ("x", "y")):
            continue
        where = plot.get("where") or {}
        chosen = [r for r in rows if isinstance(r, dict) and all(r.get(k) == v for k, v in where.items())]
        if drawn_rows(plot, rows):
            continue
        held = {k: sorted({str(r.get(k)) for r in rows if isinstance(r, dict)}) for k in where}
        why = (
            "no row has "
            + ", ".join(f"{k}={v!r}" for k, v in where.items())
            + " (the file holds "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in held.items())
            + ")"
            if not chosen
            else f"no selected row has numbers in '{plot['x']}' and '{plot['y']}'"
        )
        out.append(
            Problem(file, "plots", f"plot '{plot.get('title', '')}' draws nothing: {why}; the site leaves it out "
                    "(declare plots only for what the run measured)")
        )  # fmt: skip
    return out
