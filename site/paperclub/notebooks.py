"""Execute a repro's walkthrough notebook on the CPU and convert it to a markdown page (nbconvert).

Results are cached under ``build/nbcache`` keyed by the notebook and the repro's sources, so
``mkdocs serve`` does not re-run an unchanged notebook on every rebuild.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from paperclub import ROOT

CACHE = ROOT / "build" / "nbcache"


def _key(nb_path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(nb_path.parent.rglob("*.py")) + [nb_path]:
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
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(nb_path, as_version=4)
    env_backup = dict(os.environ)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:  # run from the root: inside nanoparallel/, its cuda/ package would shadow the `cuda` module
        ExecutePreprocessor(
            timeout=timeout_s, kernel_name="python3", extra_arguments=["--IPKernelApp.log_level=ERROR"]
        ).preprocess(nb, {"metadata": {"path": str(ROOT)}})
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    exporter = MarkdownExporter()
    stem = "walkthrough_files"
    body, resources = exporter.from_notebook_node(
        nb, resources={"output_files_dir": stem, "unique_key": "walkthrough"}
    )
    files = {name: data for name, data in resources.get("outputs", {}).items()}
    rel = nb_path.relative_to(ROOT).as_posix()
    header = f'!!! info "Executed at build time"\n    This page is `{rel}`, run on the CPU by nbconvert when the site was built.\n\n'
    markdown = header + body
    cached.write_text(
        json.dumps(
            {"markdown": markdown, "files": {k: base64.b64encode(v).decode() for k, v in files.items()}}
        )
    )
    return markdown, files
