"""The shared GPU job (paperclub.gpu) run end to end on a toy repository, with a stand-in
compute-sanitizer: steps in order, budget, bundle, collect; and its manifest errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from paperclub import ROOT
from paperclub.gpu import GpuJobError, package_share, read_peers, sanitizer_errors, sanitizer_probes

# the tests that run a job, on one xdist worker: every job installs its peers into the same folder
# (/tmp/paperclub-peers/toy, emptied and made again), so two jobs at once would race on it
ONE_JOB_AT_A_TIME = pytest.mark.xdist_group("paperclub-gpu-job")

BENCH = """
import argparse, json, pathlib
ap = argparse.ArgumentParser()
ap.add_argument("--out"); ap.add_argument("--budget-s", type=float); ap.add_argument("--quick", action="store_true")
a = ap.parse_args()
pathlib.Path(a.out, "cpu-test.json").write_text(json.dumps({"schema": 1, "budget": a.budget_s, "quick": a.quick}))
print("bench wrote", a.out)
"""

TESTS = """
import pytest

@pytest.mark.gpu
def test_on_gpu():
    assert 1 + 1 == 2

@pytest.mark.gpu
def test_other_on_gpu():
    assert 2 + 2 == 4
"""


def toy_repo(tmp_path: Path, sanitizer_errors_reported: int, probes: int = 0) -> tuple[Path, dict]:
    root = tmp_path / "repo"
    pkg = root / "repro" / "toy"
    (pkg / "tests").mkdir(parents=True)
    (root / "repro" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tests" / "__init__.py").write_text("")
    (pkg / "tests" / "test_toy.py").write_text(TESTS)
    (pkg / "bench.py").write_text(BENCH)
    (pkg / "peers.txt").write_text("# the peer\ntoypeer==1.0\n")
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "-p paperclub.pytest_claims"\n'
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "compute-sanitizer"
    # a stand-in: runs the command after the sanitizer's own options, then prints the summary line
    # (``probes``: that many reports of NCCL's start-up probe among the errors; any error exits 86, as
    # --error-exitcode 86 does)
    probe = "========= Program hit x on CUDA API call to y.\n=========         Host Frame: ncclInitKernelsForDevice(int) in z\n"
    fake.write_text(
        '#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift 2; done\n"$@"\nrc=$?\n'
        + "".join(f"printf '%s' '{probe}'\n" for _ in range(probes))
        + f"echo '========= ERROR SUMMARY: {sanitizer_errors_reported} errors'\n"
        + ("exit 86\n" if sanitizer_errors_reported else "exit $rc\n")
    )
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT / "site"))
    # the toy's pytest runs (tests, sanitizer) without hypothesis's plugin, which imports all of
    # hypothesis at every run's end (a second or more of each run here; the toy has no hypothesis test)
    env["PYTEST_ADDOPTS"] = " ".join(filter(None, [env.get("PYTEST_ADDOPTS"), "-p no:hypothesispytest"]))
    return root, env


def run_gpu_job(root: Path, env: dict, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paperclub.gpu", "repro/toy", "--root", str(root), "--out", str(out), *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@ONE_JOB_AT_A_TIME
def test_job_runs_every_step_and_collects(tmp_path):
    root, env = toy_repo(tmp_path, 0)
    out = tmp_path / "out"
    r = run_gpu_job(root, env, out, "--budget-s", "200", "--bench-args", "toy=--quick")
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((out / "gpu-job.json").read_text())
    steps = [(s["name"], s["status"]) for s in meta["steps"]]
    assert steps == [("peers", "ok"), ("tests", "ok"), ("sanitizer", "ok"), ("bench", "ok")], meta["steps"]
    assert "missing wheels: toypeer==1.0" in meta["steps"][0]["detail"]
    assert "compute-sanitizer errors: 0" in meta["steps"][2]["detail"]
    with tarfile.open(out / "paperclub-gpu.tar.gz") as tar:
        names = tar.getnames()
    assert "repro/toy/results/cpu-test.json" in names and "logs/toy-bench.log" in names
    # back on the development machine: results into the tree, logs into build/
    clone = tmp_path / "clone"
    (clone / "repro" / "toy").mkdir(parents=True)
    r = subprocess.run(
        [sys.executable, "-m", "paperclub.gpu", "--root", str(clone), "--collect", str(out / "paperclub-gpu.tar.gz")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads((clone / "repro/toy/results/cpu-test.json").read_text())
    assert doc["quick"] is True and 0 < doc["budget"] < 200
    assert (clone / "build/gpu-logs/gpu-job.json").exists()
    # the outcome of the GPU checks that ran is kept beside the results, with date and device
    checks = json.loads((clone / "repro/toy/results/gpu-checks.json").read_text())["checks"]
    assert checks["tests"]["status"] == "ok" and checks["tests"]["detail"] == meta["steps"][1]["detail"]
    assert (
        checks["sanitizer"]["status"] == "ok"
        and "compute-sanitizer errors: 0" in checks["sanitizer"]["detail"]
    )
    assert checks["sanitizer"]["date"] == meta["date"]


def test_skipped_checks_keep_the_earlier_record(tmp_path):
    from paperclub.gpu import record_checks

    (tmp_path / "repro" / "toy" / "results").mkdir(parents=True)
    env = {"device": "GPU X", "torch": "2.11"}
    first = {
        "packages": ["toy"],
        "date": "d1",
        "environment": env,
        "steps": [
            {"package": "toy", "name": "tests", "status": "ok", "detail": "3 passed"},
            {"package": "toy", "name": "sanitizer", "status": "ok", "detail": "compute-sanitizer errors: 0"},
        ],
    }
    second = {"packages": ["toy"], "date": "d2", "environment": env, "steps": [
        {"package": "toy", "name": "tests", "status": "failed", "detail": "1 failed, 2 passed"},
        {"package": "toy", "name": "sanitizer", "status": "skipped", "detail": "skipped"}]}  # fmt: skip
    record_checks(first, tmp_path)
    record_checks(second, tmp_path)
    checks = json.loads((tmp_path / "repro/toy/results/gpu-checks.json").read_text())["checks"]
    assert (checks["tests"]["status"], checks["tests"]["date"]) == ("failed", "d2")
    assert (checks["sanitizer"]["status"], checks["sanitizer"]["date"]) == ("ok", "d1")


@ONE_JOB_AT_A_TIME
def test_selected_part_runs_alone_and_is_recorded_apart(tmp_path):
    """--select runs the -k part of a package's GPU tests in the tests and sanitizer steps, says so in
    the details, and keeps its record beside the whole package's, never in its place."""
    from paperclub.gpu import record_checks

    root, env = toy_repo(tmp_path, 0)
    out = tmp_path / "out"
    r = run_gpu_job(root, env, out, "--budget-s", "200", "--skip-bench", "--select", "toy=other")
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((out / "gpu-job.json").read_text())
    tests, sanitizer = meta["steps"][1], meta["steps"][2]
    assert tests["detail"].startswith("-k 'other' only: ") and "1 deselected" in tests["detail"]
    assert sanitizer["status"] == "ok" and sanitizer["selection"] == "other"
    whole = {"status": "ok", "detail": "2 passed", "date": "d0"}
    results = root / "repro/toy/results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "gpu-checks.json").write_text(json.dumps({"checks": {"tests": whole}}))
    record_checks(meta, root)
    checks = json.loads((results / "gpu-checks.json").read_text())["checks"]
    assert checks["tests"] == whole
    assert checks["tests -k other"]["detail"] == tests["detail"]
    assert checks["sanitizer -k other"]["status"] == "ok"
    # a malformed selection stops the job before anything runs
    r = run_gpu_job(root, env, tmp_path / "out2", "--select", "toy=")
    assert r.returncode == 2 and "--select 'toy='" in r.stderr


@ONE_JOB_AT_A_TIME
def test_sanitizer_errors_fail_the_job(tmp_path):
    root, env = toy_repo(tmp_path, 3)
    out = tmp_path / "out"
    r = run_gpu_job(root, env, out, "--budget-s", "200", "--skip-bench")
    assert r.returncode == 1, r.stdout + r.stderr
    meta = json.loads((out / "gpu-job.json").read_text())
    san = next(s for s in meta["steps"] if s["name"] == "sanitizer")
    assert san["status"] == "failed" and "compute-sanitizer errors: 3" in san["detail"]


@ONE_JOB_AT_A_TIME
def test_probe_reports_alone_leave_the_sanitizer_step_ok(tmp_path):
    for probes, reported, want in ((2, 2, "ok"), (2, 3, "failed")):
        root, env = toy_repo(tmp_path / f"{probes}-{reported}", reported, probes=probes)
        out = tmp_path / f"out-{reported}"
        run_gpu_job(root, env, out, "--budget-s", "200", "--skip-bench")
        meta = json.loads((out / "gpu-job.json").read_text())
        san = next(s for s in meta["steps"] if s["name"] == "sanitizer")
        assert san["status"] == want, san["detail"]
        assert f"compute-sanitizer errors: {reported - probes}; not counted" in san["detail"]


def test_manifest_and_package_errors(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "peers.txt").write_text("fla-core>=0.6\n")
    with pytest.raises(GpuJobError, match=r"peers.txt:1: 'fla-core>=0.6' is not 'name==version'"):
        read_peers(pkg)
    root, env = toy_repo(tmp_path, 0)
    r = subprocess.run(
        [sys.executable, "-m", "paperclub.gpu", "repro/nothere", "--root", str(root), "--out", str(tmp_path / "o")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "no folder repro/nothere/" in r.stderr


def test_sanitizer_summary_parsing():
    assert sanitizer_errors("========= ERROR SUMMARY: 0 errors\n") == 0
    assert sanitizer_errors("x\n========= ERROR SUMMARY: 17 errors\n========= ERROR SUMMARY: 1 error\n") == 18
    assert sanitizer_errors("no summary here") is None


def _api_report(call: str, first_frame: str) -> str:
    return (
        f'========= Program hit someError (error 1) due to "x" on CUDA API call to {call}.\n'
        "=========     Saved host backtrace up to driver entry point at error\n"
        f"=========         Host Frame: {first_frame} [0x1] in libsomething.so\n"
        "=========         Host Frame: caller_of_it() in init.cc:1 [0x2] in libsomething.so\n"
        "========= \n"
    )


def test_sanitizer_probes_are_named_by_their_first_frame_only():
    """A 2-GPU NCCL test under memcheck (H200 x2, 2026-11-28) reported 18 API errors, all from NCCL's
    kernel probe and PyTorch's fabric probe at start-up: those are counted apart; an API error whose
    first frame is ours, or which only passes through a probe further down, is not."""
    log = (
        _api_report(
            "cudaFuncGetAttributes", "ncclInitKernelsForDevice(int, int, unsigned long*) in enqueue.cc:52"
        )
        + _api_report(
            "cudaGetLastError", "ncclInitKernelsForDevice(int, int, unsigned long*) in enqueue.cc:54"
        )
        + _api_report("cuMemCreate", "c10::cuda::(anonymous namespace)::isFabricSupported()")
        + _api_report("cudaMemcpy", "our_launcher(float*) in ours.cc:3")
        + "=========         Host Frame: ncclInitKernelsForDevice(int) in a later frame\n"
        + "========= ERROR SUMMARY: 4 errors\n"
    )
    assert sanitizer_probes(log) == {"ncclInitKernelsForDevice": 2, "isFabricSupported": 1}
    assert sanitizer_errors(log) - sum(sanitizer_probes(log).values()) == 1
    assert sanitizer_probes("========= ERROR SUMMARY: 0 errors\n") == {}


def test_partial_summary_of_a_run_cut_before_its_summary():
    """A pytest run stopped after its tests but before its closing line (an xdist teardown past the
    budget, 2026-11-25): the detail counts the outcomes its verbose lines reported, both layouts."""
    from paperclub.gpu import _partial_summary

    text = (
        "[gw0] [ 50%] PASSED repro/x/tests/test_gpu.py::test_a\n"
        "repro/x/tests/test_gpu.py::test_b \n"
        "repro/x/tests/test_gpu.py::test_b FAILED [100%]\n"
        "repro/x/tests/test_gpu.py::test_c PASSED\n"
        "    waiter.acquire()\nKeyboardInterrupt\n"
    )
    assert _partial_summary(text) == "cut off before pytest's summary; reported so far: 2 passed, 1 failed"
    assert _partial_summary("    waiter.acquire()\nKeyboardInterrupt\n") == ""


def test_unfinished_tests_of_a_cut_run_are_named():
    from paperclub.gpu import _unfinished

    log = (
        "a.py::test_x[1] \na.py::test_x[2] \n[gw0] [ 50%] PASSED a.py::test_x[1] \n"
        "b.py::test_y PASSED\nb.py::test_z \n12.0s call     a.py::test_x[1]\n"
    )
    assert _unfinished(log) == ["test_x[2]", "test_z"]
    assert _unfinished("b.py::test_y PASSED\n") == []


def test_budget_shares():
    # equal parts without shares
    assert package_share(600, ["a", "b", "c"], {}) == 200
    # a package's own share; the others split what the later shares leave
    assert package_share(600, ["kda", "b", "c"], {"kda": 300}) == 300
    assert package_share(600, ["b", "kda", "c"], {"kda": 300}) == 150
    assert package_share(100, ["kda"], {"kda": 300}) == 100  # never more than is left
    assert package_share(100, ["b", "kda"], {"kda": 300}) == 0


def test_step_cut_at_its_deadline_is_interrupted_first(tmp_path):
    """A step past its deadline gets SIGINT before SIGKILL: pytest then still writes its summary and
    the claims record of the tests that ran (a killed KDA matrix run once lost both). The deadline is
    long enough (15 s, SIGINT at 13.5 s) that a loaded machine has started the child by then: with 5 s
    a busy CI runner sent SIGINT before the child reached its try block. (30 s waited out twice that
    on every run: the child is a bare Python importing pathlib and time, 0.05-0.15 s to its try block
    on a 2-core machine at load 7.)"""
    from paperclub.gpu import _run

    script = tmp_path / "slow.py"
    marker = tmp_path / "wrapped-up"
    script.write_text(
        "import pathlib, time\n"
        "try:\n"
        "    time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        f"    pathlib.Path({str(marker)!r}).write_text('interrupted')\n"
        "    raise\n"
    )
    log = tmp_path / "step.log"
    status, rc, secs = _run(
        [sys.executable, str(script)], timeout=15, log=log, env=dict(os.environ), cwd=tmp_path
    )
    assert status == "timeout" and rc is None
    assert marker.read_text() == "interrupted"
    assert secs < 60
    assert "timed out after 15 s" in log.read_text()
