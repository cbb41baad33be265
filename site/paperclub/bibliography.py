"""The bibliography: every ``bib/*.bib`` parsed with bibtexparser 2 into :class:`BibEntry`.

Required fields for every entry: title, author, year, url; arXiv entries (those with an
``eprint``) also need ``archiveprefix = {arXiv}`` and an id of the form ``2507.04786``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import bibtexparser
from bibtexparser import middlewares as mw

REQUIRED = ("title", "author", "year", "url")
# bibtexparser logs each block it cannot parse; load_bibliography reports it once, with its line
logging.getLogger("bibtexparser").setLevel(logging.CRITICAL)
ARXIV_ID = re.compile(r"^(\d{2})(\d{2})\.(\d{4,5})(v\d+)?$")


def valid_arxiv_id(text: str) -> bool:
    """An arXiv identifier of the 2007 scheme: YYMM.NNNN (to 1412) or YYMM.NNNNN (from 1501), an
    optional version; YY from 07 and MM a real month (2313.01889 is not one)."""
    m = ARXIV_ID.match(text)
    if not m:
        return False
    yy, mm, number = int(m.group(1)), int(m.group(2)), m.group(3)
    if not (yy >= 7 and 1 <= mm <= 12) or (yy, mm) < (7, 4):
        return False
    return len(number) == (5 if (yy, mm) >= (15, 1) else 4)


KEY = re.compile(r"^[a-z][a-z0-9]*$")


@dataclass
class BibEntry:
    key: str
    entry_type: str
    title: str
    authors: list[str]
    year: str
    url: str
    eprint: str | None
    fields: dict[str, str]
    raw: str
    file: str

    @property
    def short_authors(self) -> str:
        if not self.authors:
            return ""
        first = self.authors[0]
        return (
            first
            if len(self.authors) == 1
            else (f"{first} and {self.authors[1]}" if len(self.authors) == 2 else f"{first} et al.")
        )

    @property
    def venue(self) -> str:
        for f in ("journal", "booktitle"):
            if self.fields.get(f):
                return self.fields[f]
        return f"arXiv:{self.eprint}" if self.eprint else ""


def clean(text: str) -> str:
    """Drop BibTeX braces and collapse white space, for display."""
    return re.sub(r"\s+", " ", text.replace("{", "").replace("}", "")).strip()


def display_name(name: str) -> str:
    """'Dao, Tri' -> 'Tri Dao'; organisations in braces stay as they are."""
    name = clean(name)
    if "," in name:
        last, _, first = name.partition(",")
        return f"{first.strip()} {last.strip()}".strip()
    return name


def split_authors(value: str) -> list[str]:
    return [display_name(a) for a in re.split(r"\s+and\s+", value.strip()) if a.strip()]


def parse_text(text: str) -> bibtexparser.Library:
    return bibtexparser.parse_string(text, append_middleware=[mw.NormalizeFieldKeys()])


def load_bibliography(bib_dir: Path, root: Path) -> tuple[dict[str, BibEntry], list[tuple[str, str, str]]]:
    """All entries by key, and problems as (file, field, message)."""
    entries: dict[str, BibEntry] = {}
    problems: list[tuple[str, str, str]] = []
    if not bib_dir.is_dir():
        return entries, [("bib/", "", "is missing; create it and add one .bib file per topic")]
    for path in sorted(bib_dir.glob("*.bib")):
        file = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        lib = parse_text(path.read_text(encoding="utf-8"))
        for block in lib.failed_blocks:
            line = (block.start_line or 0) + 1
            kind = type(block).__name__
            if kind == "DuplicateBlockKeyBlock":
                problems.append(
                    (
                        file,
                        f"line {line}",
                        f"entry key '{block.key}' appears twice in this file; remove or rename one",
                    )
                )
            else:
                problems.append(
                    (
                        file,
                        f"line {line}",
                        "an entry could not be parsed (unbalanced braces or a missing comma?); fix its syntax",
                    )
                )
        for e in lib.entries:
            where = f"@{e.entry_type}{{{e.key}}}"
            if not KEY.match(e.key):
                problems.append(
                    (file, where, "key must be lowercase letters and digits, e.g. dao2022flashattention")
                )
            if e.key in entries:
                problems.append(
                    (file, where, f"key is also defined in {entries[e.key].file}; keep one entry per paper")
                )
                continue
            f = {k: v for k, v in e.fields_dict.items()}
            values = {k: fld.value for k, fld in f.items()}
            missing = [k for k in REQUIRED if not str(values.get(k, "")).strip()]
            for k in missing:
                problems.append(
                    (file, f"{where}.{k}", "is required; every entry needs title, author, year and url")
                )
            year = str(values.get("year", "")).strip()
            if year and not re.fullmatch(r"(19|20)\d\d", year):
                problems.append((file, f"{where}.year", f"'{year}' is not a four-digit year"))
            url = str(values.get("url", "")).strip()
            if url and not url.startswith(("https://", "http://")):
                problems.append((file, f"{where}.url", f"'{url}' is not an http(s) URL"))
            eprint = str(values.get("eprint", "")).strip() or None
            if eprint:
                if not valid_arxiv_id(eprint):
                    problems.append(
                        (file, f"{where}.eprint", f"'{eprint}' is not an arXiv id like 2507.04786")
                    )
                if str(values.get("archiveprefix", "")).lower() != "arxiv":
                    problems.append((file, f"{where}.archiveprefix", "must be {arXiv} when eprint is given"))
            for k, v in values.items():
                if "TODO" in str(v):
                    problems.append((file, f"{where}.{k}", "still says TODO; fill in the real value"))
            entries[e.key] = BibEntry(
                key=e.key,
                entry_type=e.entry_type,
                title=clean(str(values.get("title", ""))),
                authors=split_authors(str(values.get("author", ""))),
                year=year,
                url=url,
                eprint=eprint,
                fields={k: clean(str(v)) for k, v in values.items()},
                raw=e.raw.strip() if e.raw else "",
                file=file,
            )
    return entries, problems


def format_entry(
    key: str,
    *,
    title: str,
    authors: list[str],
    year: int | str,
    arxiv: str | None = None,
    url: str | None = None,
    primary_class: str = "cs.LG",
) -> str:
    """A BibTeX entry in the house format (used by ``paperclub new-session``)."""
    url = url or (f"https://arxiv.org/abs/{arxiv}" if arxiv else "")
    lines = [
        f"@article{{{key},",
        f"  title = {{{title}}},",
        f"  author = {{{' and '.join(authors)}}},",
        f"  year = {{{year}}},",
    ]
    if arxiv:
        lines += [
            f"  eprint = {{{arxiv}}},",
            "  archivePrefix = {arXiv},",
            f"  primaryClass = {{{primary_class}}},",
        ]
    lines += [f"  url = {{{url}}},", "}"]
    return "\n".join(lines) + "\n"
