"""Checks of the markdown the site renders, run by ``paperclub check`` (and so before every build).

The strict build passes pages whose math or diagrams the browser then fails to draw; these checks
find those mistakes where they are written, with the file and line:

* :func:`check_rendering`: every page, note and deck is rendered to HTML as the site renders it
  (mkdocs.yml's markdown extensions; the deck renderer for slides), then every formula is parsed by
  the site's KaTeX and every diagram by its mermaid (``node render_check.mjs``), and any ``$$`` left
  as text (display math that did not become a formula, e.g. inside a list item) is reported.
* :func:`check_deck`: a deck's own rules (front matter, slide headings, ``Note:`` on its own line,
  ``$$`` left open).
* :func:`check_paper_sections`: a paper page's headings that have nothing under them.

Math and diagrams need node and the vendored front-end packages (``bash .ci/setup``); without them
:func:`check_rendering` checks only for raw ``$$`` and says what it skipped.
"""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import markdown
import yaml

from paperclub import ROOT

NODE_SCRIPT = Path(__file__).with_name("render_check.mjs")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Doc:
    """One markdown source: its repository path, its text, and the file line its first line is on."""

    file: str
    text: str
    first_line: int = 1
    deck: bool = False


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    message: str


# ---------------------------------------------------------------- rendering


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (``!!python/name:``); resolve them as mkdocs does."""


def _python_name(loader, suffix, node):
    module, _, name = suffix.rpartition(".")
    obj = __import__(module, fromlist=[name])
    return getattr(obj, name)


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/name:", _python_name)


@lru_cache(maxsize=4)
def _site_markdown(config_path: str, mtime_ns: int) -> tuple[list, dict]:
    config = yaml.load(Path(config_path).read_text(encoding="utf-8"), Loader=_MkdocsLoader) or {}
    extensions, configs = [], {}
    for ext in config.get("markdown_extensions") or []:
        if isinstance(ext, dict):
            (name, cfg), *_ = ext.items()
            extensions.append(name)
            configs[name] = cfg or {}
        else:
            extensions.append(ext)
    return extensions, configs


def render_page(text: str, root: Path) -> str:
    """A page's markdown as the site renders it (mkdocs.yml's extensions)."""
    cfg = root / "mkdocs.yml"
    if not cfg.exists():
        cfg = ROOT / "mkdocs.yml"
    return _render(text, str(cfg), cfg.stat().st_mtime_ns)


@lru_cache(maxsize=512)
def _render(text: str, config_path: str, mtime_ns: int) -> str:
    extensions, configs = _site_markdown(config_path, mtime_ns)
    return markdown.Markdown(extensions=extensions, extension_configs=configs).convert(text)


class _Scan(html.parser.HTMLParser):
    """Math, diagrams and raw ``$$`` of rendered HTML, in document order."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str]] = []  # (tag, role: math-inline/math-block/mermaid/code/"")
        self.items: list[tuple[str, str]] = []  # (kind, text): kind math-inline, math-block, mermaid, raw
        self.buf: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            return
        classes = (dict(attrs).get("class") or "").split()
        role = ""
        if "arithmatex" in classes:
            role = "math-block" if tag == "div" else "math-inline"
        elif "mermaid" in classes:
            role = "mermaid"
        elif tag in ("code", "pre", "script", "style"):
            role = "code"
        if role in ("math-inline", "math-block", "mermaid") and self.buf is None:
            self.buf = []
            self.stack.append((tag, role))
        else:
            self.stack.append((tag, role if self.buf is None else ""))

    def handle_endtag(self, tag):
        while self.stack:
            t, role = self.stack.pop()
            if role in ("math-inline", "math-block", "mermaid") and self.buf is not None:
                self.items.append((role, "".join(self.buf)))
                self.buf = None
            if t == tag:
                break

    def handle_data(self, data):
        if self.buf is not None:
            self.buf.append(data)
        elif "$$" in data and not any(role == "code" for _, role in self.stack):
            self.items.append(("raw", data))


def _strip_delimiters(tex: str) -> str:
    tex = tex.strip()
    for a, b in (("\\(", "\\)"), ("\\[", "\\]"), ("$$", "$$")):
        if tex.startswith(a) and tex.endswith(b) and len(tex) >= len(a) + len(b):
            return tex[len(a) : len(tex) - len(b)].strip()
    return tex


def node_modules(root: Path) -> Path | None:
    for base in (root, ROOT):
        d = base / "site" / "vendor" / "node_modules"
        if (d / "katex").is_dir() and (d / "mermaid").is_dir():
            return d
    return None


_CHECKED: dict[tuple, str | None] = {}  # (kind, text, display) -> error: a formula is parsed once per process


def _node_check(items: list[dict], modules: Path) -> list[str | None]:
    keys = [(i["kind"], i["text"], bool(i.get("display"))) for i in items]
    todo = [i for i, k in zip(items, keys, strict=True) if k not in _CHECKED]
    if todo:
        for item, error in zip(todo, _run_node(todo, modules), strict=True):
            _CHECKED[(item["kind"], item["text"], bool(item.get("display")))] = error
    return [_CHECKED[k] for k in keys]


def _run_node(items: list[dict], modules: Path) -> list[str | None]:
    node = shutil.which("node")
    proc = subprocess.run(
        [node, str(NODE_SCRIPT), str(modules)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["node failed"])[-1])
    return json.loads(proc.stdout)


def _one_line(message: str, limit: int = 240) -> str:
    text = " ".join(part.strip() for part in message.splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class _Located:
    doc: Doc
    lines: list[str] = field(default_factory=list)
    cursor: int = 0

    def find(self, needle: str) -> int:
        """The file line of the first source line from the cursor on that holds ``needle``."""
        needle = needle.strip()
        if needle:
            for start in (self.cursor, 0):
                for i in range(start, len(self.lines)):
                    if needle in self.lines[i]:
                        self.cursor = i
                        return self.doc.first_line + i
        return self.doc.first_line + self.cursor


def _mermaid_fences(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if re.match(r"^\s*(`{3,}|~{3,})\s*mermaid\b", line)]


def check_rendering(docs: list[Doc], root: Path) -> tuple[list[Finding], str | None]:
    """Findings for formulas KaTeX refuses, diagrams mermaid refuses and ``$$`` shown as text; and a
    note when node or the vendored packages are missing (then only raw ``$$`` is checked)."""
    from paperclub.slides import render_slide

    findings: list[Finding] = []
    pending: list[tuple[dict, Doc, int, str]] = []  # (item for node, doc, line, what)
    for doc in docs:
        loc = _Located(doc, doc.text.splitlines())
        if doc.deck:
            from paperclub.content import slide_spans

            rendered = []
            for start, slide in slide_spans(doc.text):
                if _unclosed_display_math(slide) is not None:
                    continue  # check_deck reports the '$$' left open; its raw text follows from it
                body, notes = render_slide(slide)
                rendered.append((start, body + notes))
        else:
            rendered = [(1, render_page(doc.text, root))]
        fences = _mermaid_fences(loc.lines)
        n_mermaid = 0
        last_raw: int | None = None
        for start, page_html in rendered:
            loc.cursor = start - 1
            scan = _Scan()
            scan.feed(page_html)
            scan.close()
            for kind, text in scan.items:
                if kind == "raw":
                    before = [ln for ln in text.split("$$", 1)[0].splitlines() if ln.strip()]
                    if before:
                        loc.find(before[-1].strip()[-30:])
                    line = loc.find("$$")
                    loc.cursor = line - doc.first_line + 1
                    if last_raw is not None and line - last_raw <= 6:
                        continue  # the same paragraph or list item, already reported
                    last_raw = line
                    findings.append(
                        Finding(
                            doc.file,
                            line,
                            "display math shows as raw '$$' text: a '$$' block must be a paragraph of its "
                            "own, with a blank line before and after it (inside a list item, indented by four "
                            "spaces), and must be closed",
                        )
                    )
                elif kind == "mermaid":
                    fence = fences[n_mermaid] if n_mermaid < len(fences) else loc.cursor
                    n_mermaid += 1
                    line = doc.first_line + fence
                    pending.append(({"kind": "mermaid", "text": text}, doc, line, "diagram"))
                else:
                    tex = _strip_delimiters(text)
                    first = next((ln for ln in tex.splitlines() if ln.strip()), tex)
                    line = loc.find(first[:40])
                    item = {"kind": "math", "text": tex, "display": kind == "math-block"}
                    pending.append((item, doc, line, "math"))
    modules = node_modules(root)
    if not pending:
        return findings, None
    if modules is None or shutil.which("node") is None:
        return findings, (
            f"{len(pending)} formulas and diagrams not checked: node or the site's front-end packages are "
            "missing (bash .ci/setup installs them)"
        )
    try:
        errors = _node_check([p[0] for p in pending], modules)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        return findings, f"formulas and diagrams not checked: node failed ({exc})"
    for (item, doc, line, what), error in zip(pending, errors, strict=True):
        if error is None:
            continue
        if what == "diagram":
            m = re.search(r"Parse error on line (\d+)", error)
            at = line + int(m.group(1)) if m else line
            findings.append(Finding(doc.file, at, _diagram_message(error, item["text"], m)))
        else:
            hint = ""
            if "$$" in item["text"] or "$" in item["text"]:
                hint = (
                    " (two '$$' blocks with no blank line between them read as one formula holding '$$'; "
                    "separate them by a blank line)"
                )
            findings.append(
                Finding(doc.file, line, f"KaTeX cannot render this formula: {_one_line(error)}{hint}")
            )
    return findings, None


def _diagram_message(error: str, text: str, parse_line: re.Match | None) -> str:
    """mermaid's error as one line: the offending line of the diagram, what was expected, and a hint
    for the usual slip (a ';' in a sequence diagram's message ends the statement)."""
    if parse_line is None:
        return f"mermaid cannot draw this diagram: {_one_line(error)}"
    lines = text.splitlines()
    n = int(parse_line.group(1))
    source = lines[n - 1].strip() if 0 < n <= len(lines) else ""
    expecting = re.search(r"Expecting (.*?), got ('[^']*')", error.replace("\n", " "))
    detail = ""
    if expecting:
        tokens = [t.strip() for t in expecting.group(1).split(",")]
        detail = (
            f": expected {', '.join(tokens[:3])}{' ...' if len(tokens) > 3 else ''}, got {expecting.group(2)}"
        )
    hint = ""
    if ";" in source and lines and lines[0].strip().startswith("sequenceDiagram"):
        hint = " (in a sequence diagram ';' ends a statement: write ',' or '#59;' instead)"
    return f"mermaid cannot parse '{source[:80]}'{detail}{hint}"


# ---------------------------------------------------------------- decks


NOTE_INLINE = re.compile(r"^\s*notes?:\s*\S", re.I)
NOTE_LINE = re.compile(r"^(?:Note|Notes):\s*$")


def check_deck(file: str, text: str) -> list[Finding]:
    """A deck's own rules, each mistake with its line."""
    from paperclub.content import front_matter_end, slide_spans

    out: list[Finding] = []
    lines = text.splitlines()
    end = front_matter_end(text)
    if end:
        out.append(
            Finding(
                file,
                1,
                f"starts with front matter (lines 1-{end}), which a deck does not take: its title is the "
                "session's; delete the block, or start the first slide with a heading instead of '---'",
            )
        )
    fence = None
    for i, line in enumerate(lines, start=1):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip()[len(fence) :].strip():
                fence = None
            continue
        if NOTE_INLINE.match(line) and not NOTE_LINE.match(line.strip()):
            out.append(
                Finding(
                    file,
                    i,
                    f"'{line.strip()[:40]}' puts text on the 'Note:' line, where the audience sees it; write "
                    "'Note:' alone on its line and the speaker notes below it",
                )
            )
    if fence is not None:
        opened = max(i for i, line in enumerate(lines, start=1) if FENCE.match(line))
        out.append(Finding(file, opened, f"the code fence opened here ({fence}) is never closed"))
    for start, slide in slide_spans(text):
        if end and start <= end:
            continue
        if not re.search(r"^#{1,3} \S", slide, re.M):
            out.append(
                Finding(file, start, "this slide has no heading; start every slide with '# ' or '## '")
            )
        opener = _unclosed_display_math(slide)
        if opener is not None:
            out.append(
                Finding(
                    file,
                    start + opener,
                    "'$$' opens display math that the slide never closes; add the closing '$$'",
                )
            )
    return out


def _unclosed_display_math(text: str) -> int | None:
    """The 0-based line of a ``$$`` left open in ``text`` (outside code), or None."""
    open_at = None
    fence = None
    for i, line in enumerate(text.splitlines()):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        prose = re.sub(r"`+[^`]*`+", "", line)
        for _ in re.finditer(r"(?<!\\)\$\$", prose):
            open_at = i if open_at is None else None
    return open_at


# ---------------------------------------------------------------- paper pages


HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def check_paper_sections(file: str, body: str, first_line: int) -> list[Finding]:
    """Headings with nothing under them (a scaffolded page not yet written)."""
    out: list[Finding] = []
    lines = body.splitlines()
    headings: list[tuple[int, int, str]] = []  # (index, level, title)
    fence = None
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        h = HEADING.match(line)
        if h:
            headings.append((i, len(h.group(1)), h.group(2)))
    for k, (i, level, title) in enumerate(headings):
        nxt = next((j for j, lv, _ in headings[k + 1 :] if lv <= level), len(lines))
        if not any(line.strip() for line in lines[i + 1 : nxt]):
            out.append(
                Finding(
                    file,
                    first_line + i,
                    f"section '{title}' is empty; write it (see contributing.md, Papers) or delete the heading",
                )
            )
    return out
