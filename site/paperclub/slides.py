"""Turn a session's ``slides.md`` into a self-contained reveal.js deck (offline assets).

Slides are separated by a line holding only ``---``; speaker notes follow a line ``Note:``.
Markdown is rendered here, at build time, so the browser needs no markdown parser; math is
rendered by the bundled KaTeX and ```mermaid fences by the bundled mermaid.
"""

from __future__ import annotations

import html
import re

import markdown

from paperclub.content import split_slides

EXTENSIONS = ["tables", "fenced_code", "attr_list", "md_in_html", "pymdownx.arithmatex", "sane_lists"]
EXTENSION_CONFIGS = {"pymdownx.arithmatex": {"generic": True}}
MERMAID_FENCE = re.compile(r"^```mermaid\s*\n(.*?)^```\s*$", re.S | re.M)


def render_slide(text: str) -> tuple[str, str]:
    """One slide's (body html, notes html)."""
    parts = re.split(r"^(?:Note|Notes):\s*$", text, maxsplit=1, flags=re.M)
    body = parts[0]
    notes = parts[1] if len(parts) > 1 else ""
    diagrams: list[str] = []

    def stash(m: re.Match) -> str:
        diagrams.append(m.group(1))
        return f"\n\nMERMAIDDIAGRAM{len(diagrams) - 1}\n\n"

    body = MERMAID_FENCE.sub(stash, body)
    md = markdown.Markdown(extensions=EXTENSIONS, extension_configs=EXTENSION_CONFIGS)
    out = md.convert(body)
    for i, d in enumerate(diagrams):
        out = out.replace(f"<p>MERMAIDDIAGRAM{i}</p>", f'<pre class="mermaid">{html.escape(d)}</pre>')
    notes_html = (
        markdown.markdown(notes, extensions=EXTENSIONS, extension_configs=EXTENSION_CONFIGS)
        if notes.strip()
        else ""
    )
    return out, notes_html


def render_deck(title: str, text: str, assets: str, back_link: str) -> str:
    """A whole deck as an HTML page; ``assets`` is the relative URL of the vendored assets folder."""
    sections = []
    for slide in split_slides(text):
        body, notes = render_slide(slide)
        aside = f'<aside class="notes">{notes}</aside>' if notes else ""
        sections.append(f"<section>{body}{aside}</section>")
    return DECK_TEMPLATE.format(
        title=html.escape(title),
        assets=assets,
        back=html.escape(back_link),
        slides="\n".join(sections),
    )


DECK_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} - slides</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{assets}/reveal/reset.css">
<link rel="stylesheet" href="{assets}/reveal/reveal.css">
<link rel="stylesheet" href="{assets}/reveal/theme/white.css">
<link rel="stylesheet" href="{assets}/katex/katex.min.css">
<style>
  .reveal {{ font-size: 30px; }}
  .reveal h1 {{ font-size: 1.6em; }} .reveal h2 {{ font-size: 1.25em; }}
  .reveal ul, .reveal ol {{ display: block; }}
  .reveal table {{ font-size: .7em; }}
  .reveal pre.mermaid {{ box-shadow: none; background: none; font-size: .6em; }}
  .back {{ position: fixed; top: .5em; left: .8em; z-index: 30; font: 14px sans-serif; }}
</style>
</head>
<body>
<a class="back" href="{back}">&larr; session page</a>
<div class="reveal"><div class="slides">
{slides}
</div></div>
<script src="{assets}/reveal/reveal.js"></script>
<script src="{assets}/reveal/notes.js"></script>
<script src="{assets}/katex/katex.min.js"></script>
<script src="{assets}/mermaid/mermaid.min.js"></script>
<script>
  document.querySelectorAll(".arithmatex").forEach(function (el) {{
    var tex = el.textContent.trim().replace(/^\\\\\\(|\\\\\\)$/g, "").replace(/^\\\\\\[|\\\\\\]$/g, "");
    try {{ katex.render(tex, el, {{displayMode: el.tagName === "DIV", throwOnError: false}}); }} catch (e) {{}}
  }});
  mermaid.initialize({{ startOnLoad: false }});
  Reveal.initialize({{ hash: true, slideNumber: "c/t", plugins: [RevealNotes] }}).then(function () {{
    mermaid.run({{ querySelector: ".reveal pre.mermaid" }});
  }});
</script>
</body>
</html>
"""
