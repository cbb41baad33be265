"""The content model: sessions, paper pages, bibliography and reproductions, loaded and checked.

``load(root)`` reads everything and returns a :class:`Content` plus the list of
:class:`Problem` found; each problem names the file, the field and what to do. ``paperclub check``
prints them; the site build refuses to run while there are any.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from paperclub import ROOT
from paperclub.bibliography import BibEntry, load_bibliography
from paperclub.claims import (
    GPU_CHECKS_NAME,
    GPU_RESULTS_NAME,
    RESULTS_NAME,
    ClaimRecord,
    ClaimsError,
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
    """One mistake in the content: where it is, which field, what is wrong, what to do."""

    file: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: field '{self.field}'" if self.field else self.file
        return f"{where}: {self.message}"


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


class _Loader(yaml.SafeLoader):
    """Safe YAML, but dates stay strings: the schema checks them and can name the field."""


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
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return None, [Problem(rel(path, root), "", f"is not valid YAML{where}: {problem}; fix the syntax")]


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


def split_front_matter(text: str) -> tuple[dict | None, str, str | None]:
    m = FRONT_MATTER.match(text)
    if not m:
        return None, text, "has no front matter; start it with a '---' block holding bibkey, title, sessions"
    try:
        meta = yaml.load(m.group(1), Loader=_Loader)
    except yaml.YAMLError as exc:
        return None, text, f"front matter is not valid YAML: {str(exc).splitlines()[0]}"
    if not isinstance(meta, dict):
        return None, text, "front matter must be a mapping of fields"
    return meta, text[m.end() :], None


def load_paper(path: Path, root: Path) -> tuple[Paper | None, list[Problem]]:
    file = rel(path, root)
    meta, body, err = split_front_matter(path.read_text(encoding="utf-8"))
    if err:
        return None, [Problem(file, "", err)]
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
        problems.append(Problem(exc.file, exc.field, exc.message))
    problems += _check_claims(content, root, broken)
    problems += _check_results(content, root)
    return content, problems


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
        text = session.deck.read_text(encoding="utf-8")
        if not text.strip():
            out.append(Problem(rel(session.deck, root), "", "is empty; write the slides or delete the file"))
        else:
            for i, slide in enumerate(split_slides(text), start=1):
                if not re.search(r"^#{1,3} \S", slide, re.M):
                    out.append(
                        Problem(
                            rel(session.deck, root),
                            f"slide {i}",
                            "has no heading; start every slide with '# ' or '## '",
                        )
                    )
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
    """A deck's slides: separated by a line holding only '---' (front matter is not allowed)."""
    parts = re.split(r"^---\s*$", text, flags=re.M)
    return [p.strip("\n") for p in parts if p.strip()]


def _check_claims(content: Content, root: Path, broken: _Broken | None = None) -> list[Problem]:
    broken = broken or _Broken()
    out: list[Problem] = []
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
            if claim.reproducible and f'"{claim.id}"' not in sources and f"'{claim.id}'" not in sources:
                out.append(
                    Problem(
                        file,
                        claim.id,
                        "has no test: mark a property test with @pytest.mark.claim('"
                        f"{claim.id}', section=...) or register it as reproducible: false with a reason",
                    )
                )
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
    return out
