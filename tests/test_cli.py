"""`paperclub new-session`: scaffolds a session that passes `check` and appears in the built site."""

from __future__ import annotations

import io
import os
import shutil
import subprocess

import pytest

from paperclub import ROOT, cli
from tests.conftest import build_site, make_repo, paperclub

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


def test_scaffolded_session_passes_check(tmp_path):
    root = make_repo(tmp_path)
    made = paperclub("--root", str(root), *NEW)
    assert made.returncode == 0, made.stderr
    folder = root / "sessions" / "2026-12-06-demystifying-collectives"
    assert (folder / "session.yaml").exists() and (folder / "slides.md").exists()
    assert (root / "papers" / "hopper2026study.md").exists()
    checked = paperclub("--root", str(root), "check")
    assert checked.returncode == 0, checked.stderr
    assert "2 sessions" in checked.stdout


def test_new_session_refuses_to_overwrite(tmp_path):
    root = make_repo(tmp_path)
    assert paperclub("--root", str(root), *NEW).returncode == 0
    again = paperclub("--root", str(root), *NEW)
    assert again.returncode == 1
    assert "already exists; refusing to overwrite" in again.stderr
    assert "Traceback" not in again.stderr


def test_missing_title_without_a_terminal_is_a_clear_error(tmp_path):
    root = make_repo(tmp_path)
    result = paperclub("--root", str(root), "new-session", "--date", "2026-12-06")
    assert result.returncode == 1
    assert "title is required" in result.stderr and "Traceback" not in result.stderr


def test_bib_stub_without_metadata_is_flagged_by_check(tmp_path):
    root = make_repo(tmp_path)
    assert (
        paperclub(
            "--root",
            str(root),
            "new-session",
            "--title",
            "Stub",
            "--date",
            "2026-12-13",
            "--arxiv",
            "2612.04321",
        ).returncode
        == 0
    )
    checked = paperclub("--root", str(root), "check")
    assert checked.returncode == 1
    assert "still says TODO; fill in the real value" in checked.stderr


def test_prompts_ask_for_what_is_missing(tmp_path, monkeypatch, capsys):
    root = make_repo(tmp_path)
    answers = iter(["Prompted session", "2026-12-20"])
    monkeypatch.setattr("sys.stdin", io.StringIO())
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert cli.main(["--root", str(root), "new-session", "--presenter", "Ada"]) == 0
    assert (root / "sessions" / "2026-12-20-prompted-session" / "session.yaml").exists()


def _copy_repository(dest):
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for rel in files.stdout.splitlines():
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / "site" / "vendor" / "node_modules").symlink_to(ROOT / "site" / "vendor" / "node_modules")
    if (ROOT / "build" / "nbcache").is_dir():  # notebooks already executed for this content
        shutil.copytree(ROOT / "build" / "nbcache", dest / "build" / "nbcache")


@pytest.mark.slow
def test_scaffolded_session_appears_in_the_built_site(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _copy_repository(repo)
    made = paperclub("--root", str(repo), *NEW)
    assert made.returncode == 0, made.stderr
    # the scaffold's placeholder paper page gets a summary, as its presenter would write
    out = tmp_path / "out"
    result = build_site(repo, out)
    assert result.returncode == 0, result.stdout + result.stderr
    page = out / "sessions" / "2026-12-06-demystifying-collectives" / "index.html"
    assert page.exists()
    html = page.read_text()
    assert "Demystifying collectives" in html and "Ada Lovelace" in html
    index = (out / "sessions" / "index.html").read_text()
    assert "2026-12-06-demystifying-collectives" in index
    assert (out / "slides" / "2026-12-06-demystifying-collectives" / "index.html").exists()
    assert os.path.exists(out / "papers" / "hopper2026study" / "index.html")
