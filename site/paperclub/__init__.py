"""paperclub: the reading group's knowledge-base tooling.

It validates the content (sessions, papers, bibliography, claims), scaffolds new sessions,
ties property tests to paper claims (a pytest plugin), times benchmarks into result files,
and generates the website from all of it (mkdocs hooks in ``site/hooks.py``).

The package lives in ``site/paperclub`` because ``site/`` holds everything that turns content
into the website; ``site/`` itself is deliberately not a package (it would shadow Python's
own ``site`` module).
"""

from pathlib import Path

__all__ = ["ROOT"]


def _find_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "mkdocs.yml").exists() and (parent / "sessions").is_dir():
            return parent
    return here.parents[2]


ROOT: Path = _find_root()
"""The repository root (the folder holding mkdocs.yml)."""
