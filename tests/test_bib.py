"""The bibliography: every entry parses with bibtexparser 2, has its fields, and survives a round trip."""

from __future__ import annotations

import bibtexparser
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclub import ROOT
from paperclub.bibliography import format_entry, load_bibliography, parse_text
from tests.conftest import repository_content


def test_every_bib_file_parses_without_failed_blocks():
    for path in sorted((ROOT / "bib").glob("*.bib")):
        lib = parse_text(path.read_text(encoding="utf-8"))
        assert not lib.failed_blocks, (
            f"{path.name}: {[(b.start_line, type(b).__name__) for b in lib.failed_blocks]}"
        )
        assert lib.entries, f"{path.name} holds no entry"


def test_every_cited_paper_has_an_entry_with_the_required_fields():
    content, _ = repository_content()
    cited = {k for s in content.sessions for k in s.meta.papers}
    assert cited, "sessions cite no paper"
    for key in sorted(cited):
        e = content.bib[key]
        assert e.title and e.authors and e.year and e.url, key
        if e.eprint:
            assert e.url.endswith(e.eprint), f"{key}: url {e.url} does not point at arXiv {e.eprint}"


def test_round_trip_through_bibtexparser_keeps_every_field():
    entries, problems = load_bibliography(ROOT / "bib", ROOT)
    assert not problems, problems
    for path in sorted((ROOT / "bib").glob("*.bib")):
        lib = parse_text(path.read_text(encoding="utf-8"))
        again = parse_text(bibtexparser.write_string(lib))
        assert [e.key for e in again.entries] == [e.key for e in lib.entries]
        for a, b in zip(lib.entries, again.entries, strict=True):
            assert {k: f.value for k, f in a.fields_dict.items()} == {
                k: f.value for k, f in b.fields_dict.items()
            }, a.key


names = st.from_regex(r"[A-Z][a-z]{1,10}", fullmatch=True)


@settings(max_examples=50, deadline=None)
@given(
    title=st.from_regex(r"[A-Z][A-Za-z0-9 :\-]{3,60}", fullmatch=True),
    authors=st.lists(st.tuples(names, names), min_size=1, max_size=5),
    year=st.integers(1990, 2030),
    # an identifier of the five-digit scheme (from 1501): a real month, as check requires
    arxiv=st.builds(
        lambda yy, mm, n: f"{yy:02d}{mm:02d}.{n:05d}",
        st.integers(15, 29),
        st.integers(1, 12),
        st.integers(0, 99999),
    ),
)
def test_entries_written_by_new_session_parse_back_identically(tmp_path_factory, title, authors, year, arxiv):
    text = format_entry(
        "doe2026x",
        title=title,
        authors=[f"{last}, {first}" for first, last in authors],
        year=year,
        arxiv=arxiv,
    )
    d = tmp_path_factory.mktemp("bib")
    (d / "bib").mkdir()
    (d / "bib" / "a.bib").write_text(text)
    entries, problems = load_bibliography(d / "bib", d)
    assert not problems, problems
    e = entries["doe2026x"]
    assert e.title == title.strip() or e.title == " ".join(title.split())
    assert e.authors == [f"{first} {last}" for first, last in authors]
    assert e.year == str(year) and e.eprint == arxiv and e.url == f"https://arxiv.org/abs/{arxiv}"
