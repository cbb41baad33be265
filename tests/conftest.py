"""Shared fixtures for the repository-wide tests."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paperclub import ROOT

FIXTURES = Path(__file__).parent / "fixtures"


@functools.cache
def repository_content():
    """``paperclub.content.load(ROOT)`` of the repository itself, loaded once per test process and
    shared by the tests that only read it: each load runs the whole content check (every page rendered,
    formulas and diagrams through node), seconds of CPU each time. (content, problems)."""
    from paperclub.content import load

    return load(ROOT)


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


def paperclub(*args: str, cwd: Path | None = None, input: str = "") -> subprocess.CompletedProcess:
    """Run the CLI as a person would (a separate process), capturing its output; ``input`` is piped to
    it (empty by default, so that a prompt never waits on the terminal pytest runs in)."""
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


def write_paper_sections(page: Path) -> None:
    """Fill the empty sections of a paper page that `paperclub new-session` scaffolded (check fails on
    an empty section, so a scaffold is not published unwritten)."""
    text = re.sub(
        r"^(## [^\n]+)\n\n(?=## |\Z)",
        lambda m: f"{m.group(1)}\n\nOur summary of this part of the paper.\n\n",
        page.read_text(),
        flags=re.M,
    )
    page.write_text(text)


# the session that test_cli scaffolds with `paperclub new-session`, and into the site that built_site builds
NEW = [
    "new-session",
    "--title",
    "Demystifying collectives",
    "--date",
    "2026-12-06",
    "--presenter",
    "Ada Lovelace",
    "--arxiv",
    "2612.01234",
    "--paper-title",
    "A Study of Collective Algorithms",
    "--paper-author",
    "Hopper, Grace",
    "--paper-year",
    "2026",
    "--tag",
    "collectives",
    "--summary",
    "We read about ring and tree all-reduce.",
]


def copy_repository(dest: Path) -> None:
    """The working tree's files (tracked and untracked, not ignored) into ``dest``, with the vendored
    node_modules linked and the executed-notebook cache copied (notebooks already run for this content)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for rel in files.stdout.splitlines():
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / "site" / "vendor" / "node_modules").symlink_to(ROOT / "site" / "vendor" / "node_modules")
    if (ROOT / "build" / "nbcache").is_dir():
        shutil.copytree(ROOT / "build" / "nbcache", dest / "build" / "nbcache")


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The real repository's site, built once per test session (strict), from a copy of the working tree
    in which `paperclub new-session` (NEW) scaffolded one more session.

    One build serves both the site and browser tests, which look only at the real content (the extra
    session and paper page add to the site and take nothing away), and test_cli's check that the
    scaffolded session appears in the built site: the build is the slowest step of the suite.
    PAPERCLUB_BUILT_SITE=DIR looks at a site built before instead (its .build-log beside it)."""
    if os.environ.get("PAPERCLUB_BUILT_SITE"):  # a site built before (with NEW scaffolded): look at it again
        return Path(os.environ["PAPERCLUB_BUILT_SITE"])
    repo = tmp_path_factory.mktemp("checkout") / "repo"
    repo.mkdir()
    copy_repository(repo)
    made = paperclub("--root", str(repo), *NEW)
    if made.returncode != 0:
        pytest.fail(
            f"paperclub new-session failed in the copy of the repository:\n{made.stdout}\n{made.stderr}"
        )
    write_paper_sections(repo / "papers" / "hopper2026study.md")
    out = tmp_path_factory.mktemp("site")
    result = build_site(repo, out)
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}")
    out.joinpath(".build-log").write_text(result.stdout + result.stderr)
    # keep the notebooks this build executed for the next run, as a build in the checkout itself would
    cache = ROOT / "build" / "nbcache"
    cache.mkdir(parents=True, exist_ok=True)
    for f in (repo / "build" / "nbcache").glob("*.json"):
        if not (cache / f.name).exists():
            shutil.copy2(f, cache / f.name)
    return out


def pytest_collection_modifyitems(items):
    """Whichever test first asks for the built site pays for the build (notebooks executed, about three
    minutes on two cores, once slower than the suite's 600 s per-test limit on a loaded machine): the
    tests that use it get twice that limit, as the build's own subprocess timeout (900 s) allows."""
    for item in items:
        if "built_site" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(1200))
