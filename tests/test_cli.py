"""The `paperclub` command: it works on the checkout you stand in (found upward, as git does; `--root`
overrides), and `new-session` scaffolds a session that passes `check` and appears in the built site."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paperclub import ROOT, cli
from tests.conftest import NEW, make_repo, paperclub


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


@pytest.mark.slow
def test_scaffolded_session_appears_in_the_built_site(built_site):
    """built_site (conftest) is a copy of this repository in which `paperclub new-session` (NEW) made
    this session, built strictly: one build shared with the site and browser tests."""
    out = built_site
    page = out / "sessions" / "2026-12-06-demystifying-collectives" / "index.html"
    assert page.exists()
    html = page.read_text()
    assert "Demystifying collectives" in html and "Ada Lovelace" in html
    index = (out / "sessions" / "index.html").read_text()
    assert "2026-12-06-demystifying-collectives" in index
    assert (out / "slides" / "2026-12-06-demystifying-collectives" / "index.html").exists()
    assert os.path.exists(out / "papers" / "hopper2026study" / "index.html")


# ---------------------------------------------------------------- the checkout you stand in

MEGABLOCKS = "sessions/2025-10-19-megablocks/session.yaml"


def _installed(*args: str, cwd) -> subprocess.CompletedProcess:
    """The console script that `pip install -e .` put beside this Python, run as a new user would."""
    script = Path(sys.executable).with_name("paperclub")
    assert script.exists(), f"{script} is missing: install the project (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _errors(result: subprocess.CompletedProcess) -> set[str]:
    return {line for line in result.stderr.splitlines() if line.startswith("error: ")}


@pytest.fixture(scope="module")
def second_clone(tmp_path_factory) -> Path:
    """A second clone of this repository (its committed state), as a contributor would have."""
    dest = tmp_path_factory.mktemp("clone") / "reading-group"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, timeout=120)
    assert (dest / MEGABLOCKS).exists()
    return dest


def test_check_validates_the_clone_you_stand_in(second_clone, tmp_path):
    """The issue's case: the command installed from one clone, run inside a second clone whose megablocks
    session has `date: 2026-13-45`, reports that date (and only that) and fails, from any folder of it."""
    pristine = _installed("check", cwd=second_clone)
    assert "Traceback" not in pristine.stderr
    broken = tmp_path / "broken"
    shutil.copytree(second_clone, broken, ignore=shutil.ignore_patterns(".git"))
    yaml_path = broken / MEGABLOCKS
    text = yaml_path.read_text()
    assert re.search(r"^date: 2025-10-19$", text, re.M)
    yaml_path.write_text(re.sub(r"^date: .*$", "date: 2026-13-45", text, flags=re.M))
    for cwd in (broken, broken / "sessions" / "2025-10-19-megablocks", broken / "papers"):
        result = _installed("check", cwd=cwd)
        assert result.returncode == 1, f"from {cwd}:\n{result.stdout}{result.stderr}"
        new = _errors(result) - _errors(pristine)
        assert new == {
            f"error: {MEGABLOCKS}:2: field 'date': '2026-13-45' is not a real date; "
            "write YYYY-MM-DD, or YYYY-MM when only the month is known"
        }, result.stderr
        # one mistake, one message: the paper page listing the session is not told the folder is missing
        assert "is not a folder in sessions/" not in result.stderr
        assert str(broken) in result.stderr  # says which checkout it validated
    # --root still names the repository, wherever one stands
    by_root = _installed("--root", str(broken), "check", cwd=second_clone)
    assert by_root.returncode == 1 and _errors(by_root) == _errors(_installed("check", cwd=broken))
    fixture = make_repo(tmp_path / "fixture")
    assert _installed("--root", str(fixture), "check", cwd=broken).stdout.startswith("ok: 1 sessions")


def test_claims_lists_the_clone_you_stand_in(second_clone, tmp_path):
    """`paperclub claims` reads the claims of the checkout it runs in (a claim only the clone registers shows)."""
    clone = tmp_path / "claims-clone"
    shutil.copytree(second_clone, clone, ignore=shutil.ignore_patterns(".git"))
    toy = clone / "repro" / "toyclone"
    (toy / "tests").mkdir(parents=True)
    (toy / "claims.yaml").write_text(
        "paper: doe2026example\nclaims:\n  - id: toyclone/only-here\n    section: '§1'\n"
        "    statement: Only the second clone registers this.\n"
    )
    result = _installed("claims", "--brief", cwd=clone / "repro")
    assert result.returncode == 0, result.stderr
    assert "toyclone/only-here" in result.stdout
    assert "toyclone/only-here" not in _installed("claims", "--brief", cwd=ROOT).stdout


@pytest.mark.parametrize("command", [["check"], ["claims"], ["new-session", "--title", "Nowhere"]])
def test_outside_any_checkout_says_so(tmp_path, command):
    nowhere = tmp_path / "not-a-checkout"
    nowhere.mkdir()
    result = _installed(*command, cwd=nowhere)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not inside a checkout" in result.stderr and "--root" in result.stderr
    assert "Traceback" not in result.stderr and not result.stdout
    assert not list(nowhere.iterdir()), "nothing is written outside a checkout"


def test_root_that_is_not_a_folder_is_a_clear_error(tmp_path):
    result = _installed("--root", str(tmp_path / "missing"), "check", cwd=tmp_path)
    assert result.returncode == 2 and "is not a folder" in result.stderr and "Traceback" not in result.stderr


def test_find_root_walks_upward(tmp_path):
    root = tmp_path / "repo"
    (root / "sessions" / "2026-01-04-x").mkdir(parents=True)
    (root / "mkdocs.yml").write_text("site_name: x\n")
    assert cli.find_root(root / "sessions" / "2026-01-04-x") == root
    assert cli.find_root(root) == root
    (tmp_path / "lonely").mkdir()
    with pytest.raises(cli.NotACheckout):
        cli.find_root(tmp_path / "lonely")
