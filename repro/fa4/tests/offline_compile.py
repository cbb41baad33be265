"""Offline sm_90a compiles of the Gluon kernels for the CPU tests: one subprocess per module runs the
module's compile driver (``python -m <module> '<cases as JSON>'``, which prints its rows as JSON on
its last line) without TRITON_INTERPRET, which the pytest plugin sets and under which Gluon cannot
compile, into a fresh cache directory so that ptxas really runs rather than a cache hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def compile_offline(module: str, cases: list, cache_dir: Path) -> list[dict]:
    """The rows ``module``'s offline compile driver reports for ``cases``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    r = subprocess.run(
        [sys.executable, "-m", module, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert r.returncode == 0, f"offline compile driver {module} failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])
