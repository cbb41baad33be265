"""Shared fixtures for the repository-wide tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paperclub import ROOT

FIXTURES = Path(__file__).parent / "fixtures"


def make_repo(tmp_path: Path, broken: str | None = None) -> Path:
    """A copy of the valid fixture repository, with one broken case laid over it."""
    root = tmp_path / "repo"
    shutil.copytree(FIXTURES / "valid", root)
    if broken:
        case = FIXTURES / "broken" / broken
        for src in case.rglob("*"):
            if src.is_file() and src.name not in ("expect.txt", "remove.txt"):
                dest = root / src.relative_to(case)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest)
        remove = case / "remove.txt"
        if remove.exists():
            for line in remove.read_text().split():
                (root / line).unlink()
    return root


def paperclub(*args: str, cwd: Path | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a person would (a separate process), capturing its output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "site"))
    return subprocess.run(
        [sys.executable, "-m", "paperclub", *args],
        cwd=cwd or ROOT,
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=120,
    )


def build_site(root: Path, out: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the repository at ``root`` into ``out``."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(root / "site"))
    env.pop("PAPERCLUB_DRAFT", None)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The real repository's site, built once per test session (strict)."""
    out = tmp_path_factory.mktemp("site")
    result = build_site(ROOT, out)
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}")
    out.joinpath(".build-log").write_text(result.stdout + result.stderr)
    return out
