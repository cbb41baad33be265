"""The website: a strict offline build with every session, paper, deck, claim and benchmark page."""

from __future__ import annotations

import json
import re

from paperclub import ROOT
from paperclub.content import load, split_slides

CONTENT, _ = load(ROOT)


def test_strict_build_has_no_warnings(built_site):
    log = (built_site / ".build-log").read_text()
    assert not re.search(r"^WARNING\b", log, re.M), log


def test_every_session_has_a_page_and_appears_in_the_index(built_site):
    index = (built_site / "sessions" / "index.html").read_text()
    assert len(CONTENT.sessions) == 17
    for s in CONTENT.sessions:
        assert (built_site / "sessions" / s.folder / "index.html").exists(), s.folder
        assert f'href="{s.folder}/"' in index, f"{s.folder} missing from the sessions index"


def test_sessions_index_is_newest_first(built_site):
    index = (built_site / "sessions" / "index.html").read_text()
    order = [s.folder for s in CONTENT.sessions_newest_first()]
    positions = [index.index(f'href="{f}/"') for f in order]
    assert positions == sorted(positions)


def test_paired_sessions_have_a_deck_of_ten_to_twenty_slides(built_site):
    paired = [s for s in CONTENT.sessions if s.meta.repro]
    assert len(paired) == 8
    for s in paired:
        assert s.deck is not None, f"{s.folder} pairs with a repro but has no slides.md"
        n = len(split_slides(s.deck.read_text()))
        assert 10 <= n <= 20, f"{s.folder}: {n} slides"
        html = (built_site / "slides" / s.folder / "index.html").read_text()
        assert html.count("<section>") == n
        session_page = (built_site / "sessions" / s.folder / "index.html").read_text()
        assert f"slides/{s.folder}/" in session_page, "the session page links its deck"


def test_every_paper_page_bibliography_entry_and_tag(built_site):
    bib = (built_site / "bibliography" / "index.html").read_text()
    tags = (built_site / "tags" / "index.html").read_text()
    for key, paper in CONTENT.papers.items():
        page = (built_site / "papers" / key / "index.html").read_text()
        assert CONTENT.bib[key].title.split(":")[0][:20] in page
        assert f'id="{key}"' in bib
        for t in paper.meta.tags:
            assert f'id="{t}"' in tags


def test_claims_and_benchmarks_pages_list_every_claim_and_result(built_site):
    claims_html = (built_site / "claims" / "index.html").read_text()
    for cid, claim in CONTENT.claims.items():
        assert cid in claims_html
        if not claim.reproducible:
            assert "not reproducible here" in claims_html
    bench_html = (built_site / "benchmarks" / "index.html").read_text()
    for name, repro in CONTENT.repros.items():
        if repro.planned:
            continue
        assert f'id="{name}"' in bench_html
        for f in (repro.path / "results").glob("*.json"):
            if f.name != "claims.json":
                doc = json.loads(f.read_text())
                assert doc["device"] in bench_html


def test_walkthrough_notebooks_are_executed_into_pages(built_site):
    for name, repro in CONTENT.repros.items():
        if repro.walkthrough is None:
            continue
        page = built_site / "repro" / name / "walkthrough" / "index.html"
        assert page.exists(), name
        html = page.read_text()
        assert "Executed at build time" in html
        assert "<img" in html, f"{name}: the walkthrough should show at least one picture"


def test_search_index_holds_every_papers_key_terms(built_site):
    index = json.loads((built_site / "search" / "search_index.json").read_text())
    by_location: dict[str, str] = {}
    for doc in index["docs"]:
        page = doc["location"].split("#")[0]
        by_location[page] = by_location.get(page, "") + " " + doc["title"] + " " + doc["text"]
    for key in CONTENT.papers:
        text = by_location.get(f"papers/{key}/", "").lower()
        entry = CONTENT.bib[key]
        terms = [w for w in re.findall(r"[a-z][a-z0-9-]{4,}", entry.title.lower())][:4]
        if entry.eprint:
            terms.append(entry.eprint)
        missing = [t for t in terms if t not in text]
        assert not missing, f"search index lacks {missing} for papers/{key}"
    usp = by_location.get("sessions/2025-08-unified-sequence-parallelism/", "")
    assert "Ulysses" in usp


EXTERNAL = re.compile(r"""<(?:script|link|img|iframe)[^>]+(?:src|href)=["'](?:https?:)?//""", re.I)


def test_no_page_loads_anything_from_the_internet(built_site):
    offenders = []
    for page in built_site.rglob("*.html"):
        for m in EXTERNAL.finditer(page.read_text(errors="replace")):
            tag = m.group(0)
            if "<link" in tag.lower() and re.search(r'rel=["\'](?:canonical|alternate)', tag):
                continue
            offenders.append(f"{page.relative_to(built_site)}: {tag}")
    for css in built_site.rglob("*.css"):
        if re.search(r"@import\s+url\(['\"]?https?:", css.read_text(errors="replace")):
            offenders.append(str(css.relative_to(built_site)))
    assert not offenders, offenders[:10]
