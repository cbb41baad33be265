"""mkdocs hooks: generate the site's pages from the repository's content.

* ``on_config``: load and validate all content (``paperclub.content``); any problem stops the build
  with the same messages ``paperclub check`` prints.
* ``on_files``: add the generated pages (sessions, papers, reproductions, claims, benchmarks,
  lab tools, bibliography, tags, source views, notebooks), slide decks, plots and the vendored front-end assets.
* ``on_page_markdown``: point links that content writes relative to its place in the repository at
  the matching pages of the site (links to code by symbol resolve to the definition's line).
* ``on_page_content``: register the source pages' line anchors, which mkdocs does not see.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "site"))  # paperclub works even when the project is not installed

from paperclub.content import load  # noqa: E402
from paperclub.notebooks import NotebookError, render_notebook  # noqa: E402
from paperclub.sitegen import generate, rewrite_links  # noqa: E402

log = logging.getLogger("mkdocs.hooks.paperclub")
VENDOR = ROOT / "site" / "vendor" / "node_modules"
# (package file, path in the site) for the assets the site and the decks use; nothing is fetched at view time.
VENDOR_FILES = [
    ("katex/dist/katex.min.js", "katex/katex.min.js"),
    ("katex/dist/katex.min.css", "katex/katex.min.css"),
    ("mermaid/dist/mermaid.min.js", "mermaid/mermaid.min.js"),
    ("reveal.js/dist/reveal.js", "reveal/reveal.js"),
    ("reveal.js/dist/reveal.css", "reveal/reveal.css"),
    ("reveal.js/dist/reset.css", "reveal/reset.css"),
    ("reveal.js/dist/theme/white.css", "reveal/theme/white.css"),
    ("reveal.js/plugin/notes/notes.js", "reveal/notes.js"),
]
_state: dict = {}


def on_config(config):
    content, problems = load(ROOT)
    if problems and os.environ.get("PAPERCLUB_DRAFT") == "1":
        for p in problems:  # a draft build shows the site anyway; the warnings still fail --strict
            log.warning(str(p))
    elif problems:
        raise PluginError(
            "the content has problems (run 'paperclub check'):\n  " + "\n  ".join(map(str, problems))
        )
    _state["content"] = content
    return config


def on_files(files: Files, config) -> Files:
    missing = [src for src, _ in VENDOR_FILES if not (VENDOR / src).exists()]
    if missing:
        raise PluginError(
            f"vendored front-end assets are missing ({missing[0]} ...): run 'bash .ci/setup' (npm install in site/vendor)"
        )
    try:
        site = generate(_state["content"], render_notebook=render_notebook)
    except NotebookError as exc:  # one line naming the notebook and the cell, not nbclient's traceback
        raise PluginError(f"walkthrough failed: {exc}") from None
    _state["site"] = site
    for uri, text in site.pages.items():
        if files.get_file_from_path(uri) is not None:
            raise PluginError(f"generated page {uri} collides with a hand-written page in site/pages/{uri}")
        files.append(File.generated(config, uri, content=text))
    for uri, data in site.files.items():
        files.append(File.generated(config, uri, content=data))
    for src, dest in VENDOR_FILES:
        files.append(File.generated(config, f"assets/vendor/{dest}", abs_src_path=str(VENDOR / src)))
    for font in sorted((VENDOR / "katex" / "dist" / "fonts").glob("*.woff2")):
        files.append(File.generated(config, f"assets/vendor/katex/fonts/{font.name}", abs_src_path=str(font)))
    reveal_fonts = VENDOR / "reveal.js" / "dist" / "theme" / "fonts"
    for font in sorted(p for p in reveal_fonts.rglob("*") if p.is_file()):
        rel = font.relative_to(reveal_fonts).as_posix()
        files.append(
            File.generated(config, f"assets/vendor/reveal/theme/fonts/{rel}", abs_src_path=str(font))
        )
    _state["known"] = {f.src_uri for f in files}
    return files


def on_page_content(html: str, page, config, files) -> str:
    """A source page's line anchors come from the highlighter after mkdocs collected the page's anchors:
    register them, so that links to a symbol's line are checked against them and not reported missing.
    Formulas are marked to be left out of the search index; pages with a diagram load mermaid."""
    if page.file.src_uri.startswith("source/") and page.present_anchor_ids is not None:
        page.present_anchor_ids.update(re.findall(r'id="(__codelineno-[\d-]+)"', html))
    # formulas stay out of the search index: its snippets showed their raw LaTeX
    html = html.replace('class="arithmatex">', 'class="arithmatex" data-search-exclude="">')
    if 'class="mermaid"' in html:
        # mermaid only where a diagram is (Material draws them with the global `mermaid`, which this
        # script defines before Material's own script runs); every page paid for parsing it before
        depth = page.url.count("/") if page.url else 0
        html += f'\n<script src="{"../" * depth}assets/vendor/mermaid/mermaid.min.js"></script>\n'
    return html


def on_page_markdown(markdown: str, page, config, files) -> str:
    site = _state.get("site")
    uri = page.file.src_uri
    origin = site.origin.get(uri) if site else None
    if origin is None and not page.file.generated_by:
        origin = f"site/pages/{uri}"
    return rewrite_links(markdown, uri, origin, ROOT, _state.get("known", set()))
