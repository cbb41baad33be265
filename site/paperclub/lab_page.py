"""The lab tools page: every tool in every ``lab/`` folder, what it does and how to run it, from the tools.

Tuning, bisecting, diagnosis and compile reports live in ``repro/<name>/lab/`` (nanoparallel's in
``nanoparallel/cuda/lab/``), away from the fast path. This module lists them on one page, written from
the folders themselves so that it cannot drift from them: :func:`lab_folders` finds each package's
``lab`` folders, :func:`lab_entries` reads one folder into rows (a Python module: the first paragraph
of its docstring and the ``python -m`` commands it shows; a shell script: its leading comment and the
``bash`` command it shows; anything else is data, e.g. a JSON snapshot a tool compares against), and
:func:`lab_page` writes the page, one section per reproduction in the order of ``repro/`` (the site
publishes it as ``lab.md``). :func:`lab_problems` is what ``paperclub check`` reports: a lab module
without a docstring, or a shell script without a leading comment, is an error naming the file, since
the page would have nothing to say about it.
"""

from __future__ import annotations

import ast
import json
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LabEntry", "lab_entries", "lab_folders", "lab_page", "lab_problems", "run_commands"]

#: The folder name that holds a package's lab tools.
LAB = "lab"
#: The page's place in the site.
PAGE_URI = "lab.md"
TOOL_SUFFIXES = (".py", ".sh")


@dataclass
class LabEntry:
    """One file of a lab folder: a tool (``.py``, ``.sh``), its README, or data."""

    path: str  # relative to the repository root, with '/'
    kind: str  # "module", "script", "readme" or "data"
    summary: str = ""  # the first paragraph of the docstring or leading comment ("" when it has none)
    commands: list[str] = field(default_factory=list)  # how to run it, as the docstring or comment says
    has_main: bool = False  # a module with ``if __name__ == "__main__"`` (it has a command line)
    error: str = ""  # why it cannot be read (a module that does not parse)
    detail: str = ""  # for data: its size in entries, the tools that name it


def lab_folders(packages: Iterable[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """(package name, folder) for every ``lab`` folder under each package's folder, in the packages'
    order (``repro/`` sorted, then nanoparallel, as :func:`paperclub.claims.package_dirs` gives them)."""
    out = []
    for name, root in packages:
        if not root.is_dir():
            continue
        found = [p for p in root.rglob(LAB) if p.is_dir() and "__pycache__" not in p.parts]
        out += [(name, p) for p in sorted(found)]
    return out


def _roles(text: str) -> str:
    """reStructuredText read as noise on a page: :func:`f` -> `f`, a doubled backtick -> one, the
    escaped space of ``Config``\\ s -> `Config`s."""
    text = re.sub(r":(?:func|class|meth|mod|attr|data|obj):`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("`\\ ", "`")


#: A paragraph longer than this is cut after its first sentence.
LONG = 320
SENTENCE_END = re.compile(r"(?<=[a-z0-9')\]`])\.\s+(?=[A-Z(`])")


def _first_paragraph(text: str) -> str:
    """The first paragraph of ``text`` as one line (its first sentence when it is long); a paragraph that
    only shows the command (or opens with it, ``python -m ... ARGS``: what it does) is passed over for
    the words after it; a paragraph that introduces a list (ends in ':') ends in '.'."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    for p in paragraphs:
        words = re.sub(r"^`+(?:python -m|bash) [^`]*`+[:.]?\s*", "", p).strip()
        if not words:
            continue
        if words != p:  # it opened with the command: "`python -m x ARGS`: what every ..."
            words = words[0].upper() + words[1:]
        if len(words) > LONG:
            words = SENTENCE_END.split(words, maxsplit=1)[0].rstrip(".") + "."
        return words[:-1] + "." if words.endswith(":") else words
    return ""


def run_commands(text: str, command: str) -> list[str]:
    """The distinct ways ``text`` (a docstring or a script's comment) shows to run ``command`` (``python -m
    pkg.mod`` or ``bash path/to/script.sh``): the rest of its line (a line ending in ``\\`` goes on), or
    of its inline code span, without a trailing comment (``# ...`` or ``(...)`` after two spaces)."""
    lines = text.splitlines()
    head = re.compile(re.escape(command) + r"(?![\w.])")
    out: list[str] = []
    for i, line in enumerate(lines):
        for m in head.finditer(line):
            rest = line[m.start() :]
            j = i
            while rest.rstrip().endswith("\\") and j + 1 < len(lines):
                j += 1
                rest = rest.rstrip()[:-1] + " " + lines[j].strip()
            before = line[: m.start()]
            if before.endswith("`"):  # an inline code span: up to its closing backtick
                rest = rest.split("`", 1)[0]
            elif before.strip():  # named in a sentence: up to the end of its clause
                rest = re.split(r"[,;)]\s|[,;)]$|\.\s|\.$", rest)[0]
            rest = re.split(r"\s{2,}(?:#|\()", rest)[0]
            cmd = " ".join(rest.split()).rstrip(":,;")
            if cmd not in out:
                out.append(cmd)
    return out


def _module_entry(path: Path, rel: str) -> LabEntry:
    entry = LabEntry(rel, "module")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError) as exc:
        entry.error = f"does not parse ({exc.__class__.__name__}: {exc})"
        return entry
    doc = ast.get_docstring(tree) or ""
    entry.summary = _first_paragraph(_roles(doc))
    entry.has_main = any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body
    )
    module = rel[: -len(".py")].replace("/", ".")
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    entry.commands = run_commands(_roles(doc), f"python -m {module}")
    return entry


def _script_comment(text: str) -> str:
    """A shell script's leading comment (after the ``#!`` line), ``#`` marks taken off; an indented
    comment line (an example command) or a bare ``#`` ends a paragraph."""
    out = []
    for n, line in enumerate(text.splitlines()):
        if n == 0 and line.startswith("#!"):
            continue
        if not line.startswith("#"):
            break
        body = line[1:]
        out.append("" if not body.strip() or body.startswith(("   ", "\t")) else body.strip())
        if body.startswith(("   ", "\t")):
            out.append(body.strip())
            out.append("")
    return "\n".join(out)


def _script_entry(path: Path, rel: str) -> LabEntry:
    comment = _script_comment(path.read_text(encoding="utf-8", errors="replace"))
    return LabEntry(rel, "script", _first_paragraph(comment), run_commands(comment, f"bash {rel}"))


def _data_entry(path: Path, rel: str, tools: dict[str, str]) -> LabEntry:
    parts = []
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        rows = doc if isinstance(doc, list) else next(
            (v for v in doc.values() if isinstance(v, list)), None
        ) if isinstance(doc, dict) else None  # fmt: skip
        parts.append("JSON" + (f", {len(rows)} entries" if rows is not None else ""))
    named_in = sorted(name for name, text in tools.items() if path.name in text)
    if named_in:
        parts.append("named in " + ", ".join(f"`{n}`" for n in named_in))
    return LabEntry(rel, "data", detail="; ".join(parts))


def lab_entries(folder: Path, root: Path) -> list[LabEntry]:
    """The files of one lab folder (and of its subfolders), ``__init__.py`` first, then the tools,
    README and data by name."""
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    texts = {}
    for p in files:
        if p.suffix in TOOL_SUFFIXES or p.suffix == ".md":
            texts[p.relative_to(folder).as_posix()] = p.read_text(encoding="utf-8", errors="replace")
    out = []
    for p in files:
        rel = p.relative_to(root).as_posix()
        if p.suffix == ".py":
            out.append(_module_entry(p, rel))
        elif p.suffix == ".sh":
            out.append(_script_entry(p, rel))
        elif p.suffix == ".md":
            out.append(LabEntry(rel, "readme"))
        else:
            out.append(_data_entry(p, rel, {k: v for k, v in texts.items() if k != p.name}))
    return sorted(out, key=lambda e: (not e.path.endswith("/__init__.py"), e.path))


def lab_problems(packages: Iterable[tuple[str, Path]], root: Path) -> list[tuple[str, int, str]]:
    """(file, line, message) for each lab tool the page would have nothing to say about: a module
    without a docstring (``__init__.py`` included: its docstring introduces the folder), a shell script
    without a leading comment, a module that does not parse."""
    out = []
    for _, folder in lab_folders(packages):
        for e in lab_entries(folder, root):
            if e.error:
                out.append((e.path, 1, e.error))
            elif e.kind == "module" and not e.summary:
                out.append((e.path, 1, "a lab module needs a module docstring saying what it does (and how to "
                            "run it, 'python -m ...'): the Lab tools page shows its first paragraph"))  # fmt: skip
            elif e.kind == "script" and not e.summary:
                out.append((e.path, 1, "a lab script needs a leading comment (after '#!') saying what it does "
                            "and how to run it: the Lab tools page shows its first paragraph"))  # fmt: skip
    return out


def lab_page(
    packages: Iterable[tuple[str, Path]], root: Path, repro_pages: set[str] | None = None, uri: str = PAGE_URI
) -> str:
    """The markdown of the lab tools page (see the module docstring). ``repro_pages``: the names whose
    reproduction page exists (``repro/<name>.md``), linked from their heading."""
    # sitegen imports this module to build the site, so its helpers are imported at call time
    from paperclub.sitegen import cell, code_html, rel_link

    def source_link(rel: str, text: str) -> str:  # the site has a source page for every .py, .sh, .md
        return f"[{text}]({rel_link(uri, f'source/{rel}.md')})"

    folders = lab_folders(packages)
    lines = [
        "# Lab tools",
        "",
        "Tuning sweeps, bisecting, diagnosis, profiling and offline compile reports, one folder per "
        "reproduction: `repro/<name>/lab/` (nanoparallel's is `nanoparallel/cuda/lab/`). The fast path "
        "never imports them; they import it, and run from the repository root with `PYTHONPATH=site:.`. "
        "Generated from the folders: what each tool does is the first paragraph of its module docstring "
        "(a script's leading comment), how to run it is what that docstring shows. The benchmarks "
        "themselves are `python -m repro.<name>.bench`; the shared machinery is `paperclub.bench` "
        "(command line, budget, sweeps) and `paperclub.lab` (Nsight Compute, sm_90a compile reports).",
        "",
    ]
    if not folders:
        lines.append("No reproduction has a lab folder yet.")
    for name, folder in folders:
        folder_rel = folder.relative_to(root).as_posix()
        entries = lab_entries(folder, root)
        heading = f"## {name}"
        lines += [heading, ""]
        where = f"`{folder_rel}/`"
        if repro_pages is not None and name in repro_pages:
            where += f" ([the reproduction]({rel_link(uri, f'repro/{name}.md')}))"
        init = next((e for e in entries if e.path.endswith("/__init__.py") and e.kind == "module"), None)
        intro = f"{where}: {init.summary}" if init and init.summary else where
        readmes = [e for e in entries if e.kind == "readme"]
        if readmes:
            links = ", ".join(source_link(e.path, posixpath.basename(e.path)) for e in readmes)
            intro += f" See also its {links}."
        lines += [intro, ""]
        tools = [e for e in entries if e.kind in ("module", "script") and not e.path.endswith("/__init__.py")]
        if tools:
            lines += ["| tool | what it does | how to run it |", "|---|---|---|"]
            for e in tools:
                label = posixpath.relpath(e.path, folder_rel)
                if e.commands:
                    run = "<br>".join(code_html(c) for c in e.commands)
                elif e.kind == "module" and not e.has_main:
                    run = "no command line: the other tools import it"
                else:
                    run = "—"
                what = e.summary or e.error or "(no docstring)"
                lines.append(f"| {source_link(e.path, f'`{label}`')} | {cell(what)} | {run} |")
            lines.append("")
        data = [e for e in entries if e.kind == "data"]
        if data:
            lines += ["Data:", ""]
            lines += [
                f"- `{posixpath.relpath(e.path, folder_rel)}`" + (f": {e.detail}" if e.detail else "")
                for e in data
            ]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"
