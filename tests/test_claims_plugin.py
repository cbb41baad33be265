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
def toy(pytester, monkeypatch):
    # the inner runs load the claims plugin (addopts) and no installed plugin, none of which plays a
    # part here: hypothesis's alone imports all of hypothesis at each run's end (with xdist's and the
    # others, three quarters of the CPU time of an inner run, several of which each test makes)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
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
    write_test(
        toy, '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\ndef test_new():\n    assert True\n'
    )
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


def test_a_typo_in_a_parametrised_test_is_reported_once(pytester, toy):
    """Six cases of one test function carry one marker: one message naming the file and line."""
    write_test(
        toy,
        '@pytest.mark.parametrize("n", range(6))\n@pytest.mark.claim("toy/exsct", section="§2")\n'
        "def test_x(n):\n    assert True\n",
    )
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    lines = [ln for ln in result.stderr.lines if "toy/exsct" in ln]
    assert len(lines) == 1, result.stderr.str()
    assert "repro/toy/test_toy.py:3 (test_x): claim 'toy/exsct' is not registered" in lines[0]


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


def test_leak_report_names_large_tensors_and_their_holders(monkeypatch):
    """The GPU-test teardown's report (run only with a CUDA GPU) lists the large live tensors, largest
    first, with what holds them and not its own bookkeeping; small ones are left out. On a CPU the
    tensors are made to look like CUDA ones."""
    import torch

    from paperclub.pytest_claims import _large_cuda_tensors

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    held = {"big": torch.zeros(3 << 20), "bigger": torch.zeros(5 << 20), "small": torch.zeros(10)}
    lines = [ln for ln in _large_cuda_tensors(torch, min_bytes=12 << 20) if "MiB" in ln]
    mine = [ln for ln in lines if "(3145728,)" in ln or "(5242880,)" in ln]
    assert [ln.split()[0] for ln in mine] == ["(5242880,)", "(3145728,)"], lines
    assert all(ln.endswith("held by dict") for ln in mine), mine
    assert not any("(10,)" in ln for ln in lines)
    assert held  # kept alive until here


def test_rel_error_in_chunks_equals_the_whole_norm(monkeypatch):
    """rel_error sums in float64 chunks (memory): the same value as the whole-tensor norms, for sizes
    on and off the chunk, non-contiguous inputs, and inf for a non-finite output in any chunk."""
    import torch

    from paperclub import testing

    monkeypatch.setattr(testing, "_CHUNK", 1000)
    gen = torch.Generator().manual_seed(0)
    for shape in [(7,), (1000,), (33, 101), (64, 50)]:
        ref = torch.randn(*shape, generator=gen)
        out = ref + 1e-3 * torch.randn(*shape, generator=gen)
        whole = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert abs(testing.rel_error(out, ref) - whole) <= 1e-12 * whole, shape
    a = torch.randn(50, 64, generator=gen)
    assert abs(testing.rel_error(a.t(), a.t().contiguous() * 1.5) - 1 / 3) < 1e-6  # fp32 products
    bad = torch.randn(3000, generator=gen)
    bad[2500] = float("nan")
    assert testing.rel_error(bad, torch.ones(3000)) == float("inf")


def test_a_function_recorded_in_its_other_form_drops_its_old_ids(pytester, toy):
    """A test that gains parameters leaves no record under its plain id, and one that loses them none
    under its parametrised ids: the function still exists, so only this rule removes them (a plain id
    beside parametrised ones once broke the claims page's markup)."""
    claim = '@pytest.mark.claim("toy/exact", section="§2, Eq. 3")\n'
    write_test(toy, claim + "def test_x():\n    assert True\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    path = toy.joinpath("results", "claims.json")
    write_test(toy, claim + '@pytest.mark.parametrize("n", [1, 2])\ndef test_x(n):\n    assert n\n')
    pytester.runpytest_subprocess().assert_outcomes(passed=2)
    assert set(json.loads(path.read_text())["tests"]) == {
        "repro/toy/test_toy.py::test_x[1]",
        "repro/toy/test_toy.py::test_x[2]",
    }
    write_test(toy, claim + "def test_x():\n    assert True\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    assert set(json.loads(path.read_text())["tests"]) == {"repro/toy/test_toy.py::test_x"}
