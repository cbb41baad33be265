"""A real browser (Debian's Chromium through Playwright) on the built site, served statically.

It searches for "Ulysses" and lands on the USP session, steps through a slide deck with the
keyboard, checks that math and diagrams render, that the palette toggles, and that no page
asks the internet for anything.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import threading
from urllib.parse import urlparse

import pytest

from paperclub import ROOT
from paperclub.content import load, split_slides

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (bash .ci/setup --browser)"
)
USP = "2025-08-unified-sequence-parallelism"


@pytest.fixture(scope="module")
def server(built_site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest's output readable
            pass

    handler = functools.partial(Quiet, directory=str(built_site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    pg.outside_requests = []

    def watch(route):
        host = urlparse(route.request.url).hostname
        if host not in ("127.0.0.1", "localhost", None):
            pg.outside_requests.append(route.request.url)
            return route.abort()
        return route.continue_()

    pg.route("**/*", watch)
    errors = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.js_errors = errors
    yield pg
    assert not pg.outside_requests, f"the site asked the internet for: {pg.outside_requests}"
    context.close()


def test_search_for_ulysses_lands_on_the_usp_session(page, server):
    page.goto(server + "/")
    page.click("input.md-search__input")
    page.keyboard.type("Ulysses")
    page.wait_for_selector(".md-search-result__item a")
    links = page.eval_on_selector_all(".md-search-result__item > a", "els => els.map(e => e.href)")
    session_links = [h for h in links if "/sessions/" in h]
    assert session_links and USP in session_links[0], f"first session result is not the USP session: {links}"
    page.click(f".md-search-result__item > a[href*='{USP}']")
    page.wait_for_url(re.compile(USP))
    assert "Unified Sequence Parallelism" in page.inner_text("h1")
    assert not page.js_errors, page.js_errors


def test_slide_deck_steps_with_the_keyboard(page, server):
    content, _ = load(ROOT)
    session = next(s for s in content.sessions if s.folder == USP)
    slides = split_slides(session.deck.read_text())
    page.goto(f"{server}/slides/{USP}/index.html")
    page.wait_for_function("window.Reveal && Reveal.isReady()")
    assert page.evaluate("Reveal.getTotalSlides()") == len(slides)
    for expected in range(1, 4):
        page.keyboard.press("ArrowRight")
        page.wait_for_function(f"Reveal.getIndices().h === {expected}")
        heading = page.evaluate("Reveal.getCurrentSlide().querySelector('h1, h2, h3').textContent")
        source_heading = re.search(r"^#{1,3} (.+)$", slides[expected], re.M).group(1)
        assert (
            heading.strip() == re.sub(r"[*_`$]", "", source_heading).strip()
            or heading.strip()[:10] in source_heading
        )
    page.keyboard.press("ArrowLeft")
    page.wait_for_function("Reveal.getIndices().h === 2")
    assert not page.js_errors, page.js_errors


def test_math_and_diagrams_render_offline(page, server):
    content, _ = load(ROOT)
    math_paper = next(k for k, p in content.papers.items() if "$$" in p.body)
    page.goto(f"{server}/papers/{math_paper}/")
    page.wait_for_selector(".arithmatex .katex")
    diagram = next((k for k, p in content.papers.items() if "```mermaid" in p.body), None)
    if diagram is None:
        pytest.skip("no paper page has a mermaid diagram")
    page.goto(f"{server}/papers/{diagram}/")
    # Material swaps each <pre class="mermaid"> for a <div class="mermaid"> holding the SVG in a closed shadow root
    page.wait_for_function(
        "Array.from(document.querySelectorAll('div.mermaid')).some(e => e.getBoundingClientRect().height > 20)"
    )
    assert not page.js_errors, page.js_errors


def test_palette_toggles_between_light_and_dark(page, server):
    page.goto(server + "/")
    before = page.get_attribute("body", "data-md-color-scheme")
    page.click("form[data-md-component='palette'] label:visible")
    page.wait_for_function(f"document.body.getAttribute('data-md-color-scheme') !== '{before}'")


def test_claims_dashboard_fits_a_1400_pixel_window(page, server, tmp_path):
    """The claims tables stay inside the page at 1400 px, the statement keeps a readable column, and
    parametrised cases fold under their test function. A screenshot is left in the test's tmp dir."""
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(server + "/claims/")
    page.wait_for_selector(".claims-table .md-typeset__scrollwrap table")  # Material's wrapper is in place
    first = page.locator("details.claim-test").first
    first.locator("summary").click()  # one group open: its cases must fit too
    page.wait_for_function("document.querySelector('details.claim-test').open")
    measure = """() => ({
      page: document.documentElement.scrollWidth,
      content: document.querySelector('.md-content').getBoundingClientRect().right,
      tables: Array.from(document.querySelectorAll('.md-content table')).map(t => {
        const wrap = t.closest('.md-typeset__scrollwrap') || t.parentElement;
        const statement = t.querySelector('tbody td');
        return {scroll: t.scrollWidth, client: t.clientWidth, wrapScroll: wrap.scrollWidth,
                wrapClient: wrap.clientWidth, right: t.getBoundingClientRect().right,
                claims: t.closest('.claims-table') !== null,
                statement: statement ? statement.getBoundingClientRect().width : 0};
      })})"""
    m = page.evaluate(measure)
    shot = tmp_path / "claims-1400.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert m["page"] <= 1400, f"the page scrolls sideways: {m['page']} px wide"
    claims_tables = [t for t in m["tables"] if t["claims"]]
    assert claims_tables, "no claims table on the dashboard"
    for t in m["tables"]:
        assert t["scroll"] <= t["client"] + 1 and t["wrapScroll"] <= t["wrapClient"] + 1, t
        assert t["right"] <= m["content"] + 1, t
    for t in claims_tables:
        assert t["statement"] >= 0.3 * t["client"] and t["statement"] >= 280, f"statement squeezed: {t}"
    # each test function is one entry; its parametrised cases are listed only inside its <details>
    cases = page.locator("details.claim-test[open] .claim-cases code").count()
    assert cases >= 2
    content, _ = load(ROOT)
    recorded = sum(len(content.record(c).tests) for c in content.claims.values())
    groups = page.locator(".claims-table .claim-test").count()
    assert groups == sum(len(content.record(c).groups) for c in content.claims.values())
    assert groups < recorded, "parametrised cases should be grouped under their test function"
    assert not page.js_errors, page.js_errors
