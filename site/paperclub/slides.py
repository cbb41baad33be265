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
  /* a diagram fits its slide: never taller than about two thirds of it */
  .reveal pre.mermaid svg {{ max-height: 470px; max-width: 100%; height: auto; }}
  .back {{ position: fixed; top: .5em; left: .8em; z-index: 30; font: 14px sans-serif; }}
  /* a phone: the slides as one readable page (a 960-pixel stage scaled to 390 is unreadable) */
  .deck-reading {{ font: 17px/1.5 system-ui, sans-serif; color: #222; padding: 2.6em 1em 2em; }}
  .deck-reading section {{ border-bottom: 1px solid #ddd; padding: .4em 0 1.2em; }}
  .deck-reading h1, .deck-reading h2 {{ font-weight: 600; }}
  .deck-reading h1 {{ font-size: 1.45em; margin: .6em 0 .4em; }}
  .deck-reading h2 {{ font-size: 1.2em; margin: .6em 0 .4em; }}
  .deck-reading p {{ margin: .5em 0; }}
  .deck-reading ul, .deck-reading ol {{ padding-left: 1.3em; margin: .5em 0; }}
  .deck-reading ul {{ list-style: disc; }} .deck-reading ol {{ list-style: decimal; }}
  .deck-reading table {{ display: block; overflow-x: auto; border-collapse: collapse; font-size: .85em; }}
  .deck-reading th, .deck-reading td {{ border: 1px solid #ccc; padding: .2em .4em; }}
  .deck-reading pre {{ overflow-x: auto; font-size: .8em; background: #f6f6f6; padding: .5em; }}
  .deck-reading pre.mermaid {{ background: none; }}
  .deck-reading .katex-display {{ overflow-x: auto; overflow-y: hidden; padding: .2em 0; }}
  .deck-reading svg, .deck-reading img {{ max-width: 100%; height: auto; }}
  .deck-reading aside.notes {{ display: none; }}
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
  // SVG text labels: HTML labels are measured through reveal's scaling and come out clipped
  mermaid.initialize({{ startOnLoad: false, htmlLabels: false, flowchart: {{ htmlLabels: false }} }});
  var wrapper = document.querySelector(".reveal");
  if (window.matchMedia("(max-width: 600px)").matches) {{
    // a phone: no stage, every slide one after another (reveal's styles all hang off .reveal)
    wrapper.className = "deck-reading";
    mermaid.run({{ querySelector: ".deck-reading pre.mermaid" }});
  }} else {{
    // A diagram drawn while its slide is hidden has no size (mermaid measures an empty box), so a
    // slide's diagrams are drawn when it is shown: on load (whichever slide the URL opens) and on
    // every slide change; Reveal re-measures the slide afterwards.
    var drawDiagrams = function (slide) {{
      var pending = Array.prototype.filter.call(
        (slide || document).querySelectorAll("pre.mermaid"), function (el) {{ return !el.dataset.processed; }});
      if (!pending.length) return Promise.resolve();
      return mermaid.run({{ nodes: pending }}).then(function () {{ Reveal.layout(); }});
    }};
    Reveal.initialize({{ hash: true, slideNumber: "c/t", plugins: [RevealNotes] }}).then(function () {{
      drawDiagrams(Reveal.getCurrentSlide());
      Reveal.on("slidechanged", function (event) {{ drawDiagrams(event.currentSlide); }});
    }});
  }}
</script>
</body>
</html>
"""
