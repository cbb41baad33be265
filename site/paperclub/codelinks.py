"""Links from pages to code by symbol: ``[the UT transform](../repro/kda/chunk.py#chunk_kda)``.

A page links to a source file relative to its own place in the repository, as the link works when
browsing the repository; the fragment names a function, a class, ``Class.method`` or a module-level
name. The site build turns the link into the file's source page at the line of that definition
(:func:`symbol_line`), so the link follows the code as it moves; ``paperclub check`` fails on a
file or a symbol that no longer exists. Line links (``#L123``) still resolve, but rot as code moves:
check warns about each one and names the definition that holds the line (:func:`enclosing_symbol`).
"""

from __future__ import annotations

import ast
import difflib
import posixpath
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SYMBOL = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
LINE = re.compile(r"^L(\d+)(?:-L?(\d+))?$")
# a markdown link that is not an image: [text](target) or [text](target "title")
LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_ROOTS = ("repro", "nanoparallel")  # folders whose files have source pages on the site
# the kinds of file the site gives a source page (the language its code block is highlighted as)
SOURCE_LANGUAGES = {".py": "python", ".yaml": "yaml", ".md": "markdown", ".sh": "bash", ".txt": "text"}


@dataclass(frozen=True)
class Definition:
    line: int  # of the ``def`` / ``class`` line (or the assignment)
    end: int


@lru_cache(maxsize=256)
def _definitions(path: str, mtime_ns: int) -> dict[str, Definition]:
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return {}
    out: dict[str, Definition] = {}

    def walk(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                out.setdefault(name, Definition(node.lineno, node.end_lineno or node.lineno))
                if isinstance(node, ast.ClassDef):
                    walk(node.body, name + ".", True)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t) if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(n, ast.Name):
                            out.setdefault(
                                prefix + n.id, Definition(node.lineno, node.end_lineno or node.lineno)
                            )
            elif isinstance(node, (ast.If, ast.Try)) and not in_class:
                # definitions under `if TYPE_CHECKING:` or `try: ... except ImportError:`
                for part in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    walk(part, prefix, in_class)
                for handler in getattr(node, "handlers", []):
                    walk(handler.body, prefix, in_class)

    walk(tree.body, "", False)
    return out


def definitions(path: Path) -> dict[str, Definition]:
    """Every function, class, method (``Class.method``) and module- or class-level name of a Python
    file, with its line; {} for a file that does not parse."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {}
    return _definitions(str(path), mtime)


def symbol_line(path: Path, symbol: str) -> int | None:
    d = definitions(path).get(symbol)
    return d.line if d else None


def enclosing_symbol(path: Path, line: int) -> str | None:
    """The innermost function or class of ``path`` whose lines hold ``line`` (None outside any)."""
    best = None
    for name, d in definitions(path).items():
        if d.line <= line <= d.end:
            if best is None or (d.end - d.line) < (best[1].end - best[1].line):
                best = (name, d)
    return best[0] if best else None


def close_symbols(path: Path, symbol: str) -> list[str]:
    return difflib.get_close_matches(symbol, list(definitions(path)), n=3, cutoff=0.6)


def repo_target(origin: str, target: str) -> tuple[str, str] | None:
    """(repository path, fragment) of a relative link written in the repository file ``origin``;
    None for an absolute URL, a mail link or an anchor on the same page."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path, _, fragment = target.partition("#")
    if not path:
        return None
    return posixpath.normpath(posixpath.join(posixpath.dirname(origin), path)), fragment


def line_for_fragment(root: Path, repo_path: str, fragment: str) -> int | None:
    """The line a fragment of a link into ``repo_path`` points at: ``L12`` / ``L12-L20`` (the first
    line) or a symbol of a Python file; None when it names nothing there."""
    m = LINE.match(fragment)
    if m:
        return int(m.group(1))
    if repo_path.endswith(".py") and SYMBOL.match(fragment):
        return symbol_line(root / repo_path, fragment)
    return None


@dataclass(frozen=True)
class LinkIssue:
    line: int  # in the page
    message: str
    error: bool  # False: a warning (a line link)


def check_links(text: str, origin: str, root: Path, first_line: int = 1) -> list[LinkIssue]:
    """The code links of the markdown ``text`` (the repository file ``origin``, its line ``first_line``
    on): a target outside the repository, a file under repro/ or nanoparallel/ that does not exist or
    a symbol it does not define is an error; a line link is a warning naming the symbol to use."""
    out: list[LinkIssue] = []
    for lineno, line in _prose_lines(text, first_line):
        for m in LINK.finditer(line):
            resolved = repo_target(origin, m.group(2))
            if resolved is None:
                continue
            repo_path, fragment = resolved
            top = repo_path.split("/")[0]
            if repo_path == ".." or repo_path.startswith("../"):
                out.append(
                    LinkIssue(lineno, f"links to '{m.group(2)}', which is outside the repository", True)
                )
                continue
            if top not in CODE_ROOTS:
                continue
            path = root / repo_path
            if not path.exists():
                out.append(
                    LinkIssue(lineno, f"links to '{repo_path}', which does not exist; fix the path", True)
                )
                continue
            if path.is_file() and not _has_site_page(repo_path, path):
                out.append(
                    LinkIssue(
                        lineno,
                        f"links to '{repo_path}', but the site has no page for a '{path.suffix}' file (it "
                        f"shows {', '.join(sorted(SOURCE_LANGUAGES))} files, walkthroughs and results/); "
                        "name the file in code instead of linking it",
                        True,
                    )
                )
                continue
            if not fragment or not path.is_file():
                continue
            line_link = LINE.match(fragment)
            if line_link:
                name = enclosing_symbol(path, int(line_link.group(1))) if path.suffix == ".py" else None
                hint = f": '{repo_path.rsplit('/', 1)[-1]}#{name}' holds that line today" if name else ""
                out.append(
                    LinkIssue(
                        lineno,
                        f"links to '{repo_path}#{fragment}' by line number, which goes stale as the code "
                        f"moves; link to the function or class by name{hint}",
                        False,
                    )
                )
            elif path.suffix == ".py":
                if not SYMBOL.match(fragment) or symbol_line(path, fragment) is None:
                    near = close_symbols(path, fragment)
                    hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
                    out.append(
                        LinkIssue(
                            lineno,
                            f"links to '{repo_path}#{fragment}', but {repo_path} defines no '{fragment}' "
                            f"(a function, class, Class.method or module-level name){hint}",
                            True,
                        )
                    )
    return out


def _has_site_page(repo_path: str, path: Path) -> bool:
    """Whether the site build turns a link to this file into one of its pages (a source page, the
    walkthrough, or the results log for anything under results/)."""
    return (
        path.suffix in SOURCE_LANGUAGES or path.suffix == ".ipynb" or "results" in repo_path.split("/")
    )


def _prose_lines(text: str, first_line: int):
    """(line number, line) of the markdown outside fenced code, inline code spans blanked out."""
    fence: str | None = None
    for i, line in enumerate(text.splitlines(), start=first_line):
        stripped = line.lstrip()
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if stripped.startswith(fence) and not stripped[len(fence) :].strip():
                fence = None
            continue
        yield i, re.sub(r"`+[^`]*`+", lambda c: " " * len(c.group(0)), line)
