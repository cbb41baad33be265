"""Execute a repro's walkthrough notebook on the CPU and convert it to a markdown page (nbconvert).

Results are cached under ``build/nbcache`` keyed by the notebook and the repro's sources (and any
committed weights), so ``mkdocs serve`` does not re-run an unchanged notebook on every rebuild.

A walkthrough must run in seconds on a CPU (contributing.md). One that fails raises
:class:`NotebookError`, whose message is one line naming the notebook, the cell and the error.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

from paperclub import ROOT

CACHE = ROOT / "build" / "nbcache"
KEY_SUFFIXES = (".py", ".pt")  # what a walkthrough may import or load from its reproduction


class NotebookError(Exception):
    """A walkthrough that did not run; the message is one line: notebook, cell, what happened."""


def _key(nb_path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in nb_path.parent.rglob("*") if p.suffix in KEY_SUFFIXES)
    for p in files + [nb_path]:
        if "__pycache__" not in p.parts:
            h.update(p.read_bytes())
    return h.hexdigest()[:20]


def render_notebook(nb_path: Path, timeout_s: int = 300) -> tuple[str, dict[str, bytes]]:
    """(markdown, {relative file name: bytes}) of the executed notebook."""
    CACHE.mkdir(parents=True, exist_ok=True)
    cached = CACHE / f"{nb_path.parent.name}-{_key(nb_path)}.json"
    if cached.exists():
        doc = json.loads(cached.read_text())
        return doc["markdown"], {k: base64.b64decode(v) for k, v in doc["files"].items()}

    import nbformat
    from nbconvert import MarkdownExporter

    nb = nbformat.read(nb_path, as_version=4)
    rel = nb_path.relative_to(ROOT).as_posix()
    env_backup = dict(os.environ)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # one thread: a walkthrough's tensors are tiny, and on a busy machine two OpenMP threads waiting on
    # each other made one notebook 9x slower (dflash: 97 s against 11 s at a load of 12 on 2 cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    try:  # run from the root: inside nanoparallel/, its cuda/ package would shadow the `cuda` module
        _execute(nb, rel, timeout_s)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    seconds = time.perf_counter() - started
    exporter = MarkdownExporter()
    stem = "walkthrough_files"
    body, resources = exporter.from_notebook_node(
        nb, resources={"output_files_dir": stem, "unique_key": "walkthrough"}
    )
    files = {name: data for name, data in resources.get("outputs", {}).items()}
    header = (
        f'!!! info "Executed at build time"\n    This page is `{rel}`, run on the CPU by nbconvert when the '
        f"site was built (in {seconds:.0f} s).\n\n"
    )
    markdown = header + body
    cached.write_text(
        json.dumps(
            {"markdown": markdown, "files": {k: base64.b64encode(v).decode() for k, v in files.items()}}
        )
    )
    return markdown, files


def _execute(nb, rel: str, timeout_s: int) -> None:
    """Run every cell of ``nb`` in place; any failure becomes a one-line :class:`NotebookError`."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbconvert.preprocessors import ExecutePreprocessor

    class Tracking(ExecutePreprocessor):
        index = -1

        def preprocess_cell(self, cell, resources, index):
            self.index = index
            return super().preprocess_cell(cell, resources, index)

    runner = Tracking(
        timeout=timeout_s, kernel_name="python3", extra_arguments=["--IPKernelApp.log_level=ERROR"]
    )

    def where() -> str:
        if runner.index < 0:
            return rel
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        number = code.index(runner.index) + 1 if runner.index in code else runner.index + 1
        first = next((ln.strip() for ln in nb.cells[runner.index].source.splitlines() if ln.strip()), "")
        return f"{rel}: code cell {number} of {len(code)} ('{first[:60]}')"

    try:
        runner.preprocess(nb, {"metadata": {"path": str(ROOT)}})
    except CellTimeoutError:
        raise NotebookError(
            f"{where()} ran past the {timeout_s} s cell limit; a walkthrough must run in seconds on a CPU "
            "(tiny models, few steps, or weights made by a committed script: see contributing.md)"
        ) from None
    except CellExecutionError as exc:
        detail = (str(exc.evalue).strip().splitlines() or [""])[0][:300]
        raise NotebookError(f"{where()} raised {exc.ename}: {detail}") from None
    except DeadKernelError as exc:
        raise NotebookError(f"{where()}: the kernel died ({str(exc).strip()[:200]})") from None
    except Exception as exc:  # the kernel would not start, a cell's output would not serialise, ...
        raise NotebookError(f"{where()}: {type(exc).__name__}: {str(exc).strip()[:300]}") from None
