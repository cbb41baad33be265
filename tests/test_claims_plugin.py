"""The claims plugin: markers must match the registry, and outcomes are recorded for the site."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

CLAIMS = """paper: doe2026example
claims:
  - id: toy/exact
    section: "§2, Eq. 3"
    statement: The toy is exact.
  - id: toy/fast
    section: "§5"
    statement: The toy is fast on hardware we lack.
    reproducible: false
    reason: Needs a machine we do not have.
"""


@pytest.fixture
def toy(pytester):
    pytester.makefile(
        ".toml", pyproject="[tool.pytest.ini_options]\naddopts = '-p paperclub.pytest_claims'\n"
    )
    pkg = pytester.mkdir("repro").joinpath("toy")
    pkg.mkdir()
    pkg.joinpath("__init__.py").write_text("")
    pkg.joinpath("claims.yaml").write_text(CLAIMS)
    return pkg


def write_test(toy, body: str):
    toy.joinpath("test_toy.py").write_text("import pytest\n\n" + body)


def test_outcomes_are_recorded_per_test_and_claim(pytester, toy):
    write_test(
        toy,
        '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_ok():\n    assert 1 + 1 == 2\n\n'
        '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_bad():\n    assert 1 + 1 == 3\n',
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1)
    record = json.loads(toy.joinpath("results", "claims.json").read_text())["tests"]
    assert record["repro/toy/test_toy.py::test_ok"]["outcome"] == "passed"
    assert record["repro/toy/test_toy.py::test_bad"]["outcome"] == "failed"
    assert all(t["claim"] == "toy/exact" for t in record.values())


def test_unchanged_outcomes_leave_the_record_untouched(pytester, toy):
    write_test(toy, '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_ok():\n    assert True\n')
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    path = toy.joinpath("results", "claims.json")
    first = path.read_text()
    path.touch()
    mtime = path.stat().st_mtime_ns
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    assert path.read_text() == first and path.stat().st_mtime_ns == mtime


def test_record_of_a_removed_test_goes(pytester, toy):
    """A test renamed or removed from its file leaves no stale outcome behind (a failure recorded for a
    test that no longer exists would show on the site as a failed claim)."""
    write_test(
        toy,
        '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_old():\n    assert False\n\n'
        '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_kept():\n    assert True\n',
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1, failed=1)
    write_test(toy, '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_new():\n    assert True\n')
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    record = json.loads(toy.joinpath("results", "claims.json").read_text())["tests"]
    assert set(record) == {"repro/toy/test_toy.py::test_new"}


def test_unknown_claim_id_stops_collection_with_a_message(pytester, toy):
    write_test(toy, '@pytest.mark.claim("toy/typo", section="§2")\ndef test_x():\n    assert True\n')
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    result.stderr.fnmatch_lines(
        ["*claim 'toy/typo' is not registered; add it to toy/claims.yaml or fix the id*"]
    )


def test_section_must_match_the_registry(pytester, toy):
    write_test(toy, '@pytest.mark.claim("toy/exact", section="§9")\ndef test_x():\n    assert True\n')
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*says section '§9' but claims.yaml registers '§2, Eq. 3'*"])


def test_missing_section_is_an_error(pytester, toy):
    write_test(toy, '@pytest.mark.claim("toy/exact")\ndef test_x():\n    assert True\n')
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*needs section=...*"])


def test_a_skip_does_not_erase_a_recorded_outcome(pytester, toy):
    body = '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_gpu():\n    {}\n'
    write_test(toy, body.format("assert True"))
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    write_test(toy, body.format('pytest.skip("no GPU here")'))
    pytester.runpytest_subprocess().assert_outcomes(skipped=1)
    record = json.loads(toy.joinpath("results", "claims.json").read_text())["tests"]
    assert record["repro/toy/test_toy.py::test_gpu"]["outcome"] == "passed"
