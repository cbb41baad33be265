"""paperclub: the reading group's knowledge-base tooling.

It validates the content (sessions, papers, bibliography, claims), scaffolds new sessions,
ties property tests to paper claims (a pytest plugin), times benchmarks into result files,
and generates the website from all of it (mkdocs hooks in ``site/hooks.py``).

The package lives in ``site/paperclub`` because ``site/`` holds everything that turns content
into the website; ``site/`` itself is deliberately not a package (it would shadow Python's
own ``site`` module).
"""

import os
from pathlib import Path

__all__ = ["ROOT", "usable_cpus"]


def _find_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "mkdocs.yml").exists() and (parent / "sessions").is_dir():
            return parent
    return here.parents[2]


ROOT: Path = _find_root()
"""The repository root (the folder holding mkdocs.yml)."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else the machine's count).

    Kept here, in the package's light root, so that the repository's conftest.py can size its test
    workers' thread pools without importing torch or triton."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
