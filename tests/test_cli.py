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
import yaml

from paperclub import ROOT, cli
from tests.conftest import NEW, make_repo, paperclub, write_paper_sections


def test_scaffolded_session_passes_check_once_written(tmp_path):
    root = make_repo(tmp_path)
    made = paperclub("--root", str(root), *NEW)
    assert made.returncode == 0, made.stderr
    folder = root / "sessions" / "2026-12-06-demystifying-collectives"
    assert (folder / "session.yaml").exists() and (folder / "slides.md").exists()
    page = root / "papers" / "hopper2026study.md"
    assert page.exists()
    # the paper page's sections are empty: check says which, with their lines, before anything is built
    unwritten = paperclub("--root", str(root), "check")
    assert unwritten.returncode == 1
    empty = [ln for ln in unwritten.stderr.splitlines() if ln.startswith("error: ")]
    assert empty and all(re.match(r"error: papers/hopper2026study.md:\d+: section '", ln) for ln in empty), (
        empty
    )
    write_paper_sections(page)
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
    assert not list((root / "sessions").glob("2026-12-06-*"))


def test_a_new_paper_needs_its_title_and_author(tmp_path):
    """No TODO stub (which made a todo2026... key): without the paper's title and first author,
    new-session says what it needs and writes nothing."""
    root = make_repo(tmp_path)
    bib_before = (root / "bib" / "papers.bib").read_text()
    result = paperclub(
        "--root", str(root), "new-session", "--title", "Stub", "--date", "2026-12-13", "--arxiv", "2612.04321"
    )
    assert result.returncode == 1, result.stdout
    assert "title of arXiv:2612.04321 is required" in result.stderr and "--paper-title" in result.stderr
    assert not list((root / "sessions").glob("2026-12-13-*"))
    assert not (root / "bib" / "sessions.bib").exists()
    assert (root / "bib" / "papers.bib").read_text() == bib_before


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--date", "2026-W49-7", "'2026-W49-7' is not a date"),
        ("--date", "2026-02-30", "'2026-02-30' is not a real date"),
        ("--arxiv", "2313.01889", "'2313.01889' is not an arXiv id"),
        ("--tag", "Linear Attention", "tag 'Linear Attention' must be lowercase"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, option, value, message):
    root = make_repo(tmp_path)
    result = paperclub("--root", str(root), "new-session", "--title", "Bad", option, value)
    assert result.returncode == 1, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(list((root / "sessions").iterdir())) == 1


def test_piped_answers_scaffold_a_whole_session(tmp_path):
    """One answer a line on standard input: title, date, presenters, arXiv ids, tags, summary, then
    the new paper's title and first author."""
    root = make_repo(tmp_path)
    answers = "\n".join(
        [
            "Piped session",
            "2026-12-20",
            "Ada Lovelace, Grace Hopper",
            "2612.01234",
            "collectives, nccl",
            "We read about rings.",
            "A Study of Collective Algorithms",
            "Hopper, Grace",
        ]
    )
    result = paperclub("--root", str(root), "new-session", input=answers + "\n")
    assert result.returncode == 0, result.stderr
    meta = yaml.safe_load((root / "sessions" / "2026-12-20-piped-session" / "session.yaml").read_text())
    assert meta["presenters"] == ["Ada Lovelace", "Grace Hopper"]
    assert meta["papers"] == ["hopper2026study"] and meta["tags"] == ["collectives", "nccl"]
    assert meta["summary"] == "We read about rings." and meta["date_known"] == "exact"
    assert "@article{hopper2026study," in (root / "bib" / "sessions.bib").read_text()


def test_an_empty_date_is_not_taken_for_planned(tmp_path):
    root = make_repo(tmp_path)
    result = paperclub("--root", str(root), "new-session", input="Undecided\n\n")
    assert result.returncode == 1
    assert "give a date" in result.stderr
    assert not (root / "sessions" / "planned-undecided").exists()
    planned = paperclub("--root", str(root), "new-session", input="Undecided\nplanned\n\n\n\n\n")
    assert planned.returncode == 0, planned.stderr
    assert (root / "sessions" / "planned-undecided" / "session.yaml").exists()


def test_prompts_ask_again_after_a_bad_answer(tmp_path, monkeypatch, capsys):
    root = make_repo(tmp_path)
    answers = iter(["Prompted session", "2026-W49-7", "", "2026-12-20", "2313.01889", "", "Bad Tag", "", ""])
    monkeypatch.setattr("sys.stdin", io.StringIO())
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert cli.main(["--root", str(root), "new-session", "--presenter", "Ada"]) == 0
    assert (root / "sessions" / "2026-12-20-prompted-session" / "session.yaml").exists()
    err = capsys.readouterr().err
    assert "'2026-W49-7' is not a date" in err and "give a date" in err
    assert "'2313.01889' is not an arXiv id" in err and "tag 'Bad Tag' must be lowercase" in err
    assert next(answers, None) is None, "every answer was used"


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
    date_line = text.splitlines().index("date: 2025-10-19") + 1
    standing_in: dict[Path, subprocess.CompletedProcess] = {}
    for cwd in (broken, broken / "sessions" / "2025-10-19-megablocks", broken / "papers"):
        result = standing_in[cwd] = _installed("check", cwd=cwd)
        assert result.returncode == 1, f"from {cwd}:\n{result.stdout}{result.stderr}"
        new = _errors(result) - _errors(pristine)
        assert new == {
            f"error: {MEGABLOCKS}:{date_line}: field 'date': '2026-13-45' is not a real date; "
            "write YYYY-MM-DD, or YYYY-MM when only the month is known"
        }, result.stderr
        # one mistake, one message: the paper page listing the session is not told the folder is missing
        assert "is not a folder in sessions/" not in result.stderr
        assert str(broken) in result.stderr  # says which checkout it validated
    # --root still names the repository, wherever one stands (the same errors as the check run standing
    # in it, above: each check of a whole clone takes seconds)
    by_root = _installed("--root", str(broken), "check", cwd=second_clone)
    assert by_root.returncode == 1 and _errors(by_root) == _errors(standing_in[broken])
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
