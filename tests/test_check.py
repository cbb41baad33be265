"""`paperclub check`: passes on the repository's content, fails clearly on every kind of mistake."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paperclub import cli
from paperclub.content import load
from tests.conftest import FIXTURES, make_repo, paperclub

BROKEN = sorted(p.name for p in (FIXTURES / "broken").iterdir() if p.is_dir())


def test_repository_content_passes_check():
    result = paperclub("check")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: 26 sessions"), result.stdout


def test_valid_fixture_passes(tmp_path):
    root = make_repo(tmp_path)
    result = paperclub("--root", str(root), "check")
    assert result.returncode == 0, result.stderr


def check_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``paperclub ARGS`` through the command's own entry point (``cli.main``: its arguments, exit
    status, standard output and error), in this process. The two tests above run the command as a
    separate process, as a person would; the broken fixtures, one command each, run here: forty
    processes of 1.5 s each, most of it starting Python and importing the checker, for checks of a few
    hundredths of a second."""
    capsys.readouterr()
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["paperclub", *args], rc, out, err)


@pytest.mark.parametrize("case", BROKEN)
def test_broken_fixture_is_rejected_with_a_clear_message(tmp_path, capsys, case):
    root = make_repo(tmp_path, case)
    result = check_here(capsys, "--root", str(root), "check")
    assert result.returncode == 1, f"{case}: check should fail\n{result.stdout}{result.stderr}"
    assert "Traceback" not in result.stderr
    # expect.txt: fragments the messages must hold; a line starting with '!' must NOT appear (a mistake
    # that only follows from the first one, e.g. a paper listing a session whose session.yaml failed)
    for fragment in (FIXTURES / "broken" / case / "expect.txt").read_text().splitlines():
        if fragment.startswith("!"):
            assert fragment[1:] not in result.stderr, (
                f"{case}: {fragment[1:]!r} follows from another error:\n{result.stderr}"
            )
        else:
            assert fragment in result.stderr, f"{case}: expected {fragment!r} in:\n{result.stderr}"
    # every line names a file of the repository and, where the mistake is inside a file, its line
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors, result.stderr
    for line in errors:
        where = line[7:].split(": ")[0]
        assert where.split("/")[0] in {"sessions", "papers", "bib", "repro", "nanoparallel"}, line
        path = where.split(":")[0]
        if (root / path).is_file():
            assert re.fullmatch(r"[^:]+:\d+", where), f"{case}: no line number: {line}"
    # one mistake, one message
    assert len(errors) == len(set(errors)), f"{case}: a message repeats:\n{result.stderr}"
    assert len(errors) == 1, f"{case}: expected one message:\n{result.stderr}"


def test_every_kind_of_mistake_has_a_fixture():
    """The broken fixtures cover schema, dates, cross references, bib, papers, decks and claims."""
    kinds = {"yaml", "title", "date", "bib", "paper", "slug", "slides", "repro", "claim", "tag", "url", "math",
             "mermaid", "code-link", "duplicate-key", "placeholder", "note", "front-matter", "empty-section", "lab"}  # fmt: skip
    covered = {k for k in kinds if any(k in case for case in BROKEN)}
    assert covered == kinds, f"no broken fixture for: {kinds - covered}"


VALID = yaml.safe_load((FIXTURES / "valid/sessions/2026-01-04-example-session/session.yaml").read_text())
junk = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=30),
    st.lists(st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@st.composite
def mutated_session(draw):
    data = dict(VALID)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["drop", "retype", "add"]))
        if action == "drop" and data:
            data.pop(draw(st.sampled_from(sorted(data))))
        elif action == "retype" and data:
            data[draw(st.sampled_from(sorted(data)))] = draw(junk)
        else:
            data[draw(st.text(min_size=1, max_size=10))] = draw(junk)
    return data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated_session())
def test_generated_bad_sessions_never_crash_and_are_named(tmp_path_factory, data):
    root = make_repo(tmp_path_factory.mktemp("gen"))
    path = root / "sessions/2026-01-04-example-session/session.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    content, problems = load(root)
    for p in problems:
        assert p.file.startswith(("sessions/", "papers/")), str(p)
    if not problems:
        assert content.sessions[0].meta.title == data["title"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_arbitrary_text_as_session_yaml_never_crashes(tmp_path_factory, text):
    root = make_repo(tmp_path_factory.mktemp("txt"))
    (root / "sessions/2026-01-04-example-session/session.yaml").write_text(text)
    _, problems = load(root)
    assert problems, "arbitrary text cannot be a valid session"
    assert all(p.file.startswith(("sessions/", "papers/")) for p in problems)


def test_problem_messages_say_what_to_do(tmp_path):
    root = make_repo(tmp_path, "unknown-bib-key")
    _, problems = load(Path(root))
    [p] = [p for p in problems if p.field == "papers"]
    assert "add the BibTeX entry or fix the key" in p.message


def test_one_mistake_one_message(tmp_path):
    """The issue's case: a session.yaml with an impossible date is one mistake, reported once; the paper
    page that lists the session is not also told that the folder is missing (it is there)."""
    root = make_repo(tmp_path)
    path = root / "sessions/2026-01-04-example-session/session.yaml"
    path.write_text(path.read_text().replace("date: 2026-01-04", "date: 2026-13-45"))
    _, problems = load(root)
    assert [str(p) for p in problems] == [
        "sessions/2026-01-04-example-session/session.yaml:3: field 'date': '2026-13-45' is not a real date; "
        "write YYYY-MM-DD, or YYYY-MM when only the month is known"
    ]


def test_a_dangling_reference_is_still_reported(tmp_path):
    """Suppression is only for what exists and failed: a paper listing a folder that is not there is a mistake."""
    root = make_repo(tmp_path)
    path = root / "sessions/2026-01-04-example-session/session.yaml"
    path.write_text(path.read_text().replace("date: 2026-01-04", "date: 2026-13-45"))
    paper = root / "papers/doe2026example.md"
    paper.write_text(
        paper.read_text().replace("sessions: [2026-01-04-example-session]", "sessions: [2026-01-05-gone]")
    )
    _, problems = load(root)
    assert {p.field for p in problems} == {"date", "sessions"}
    assert any("'2026-01-05-gone' is not a folder in sessions/" in str(p) for p in problems)
