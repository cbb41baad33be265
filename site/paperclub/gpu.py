"""The GPU job, one for every reproduction: peers, GPU tests, the same under compute-sanitizer, benchmark.

On the GPU machine, from the repository root::

    python -m paperclub.gpu repro/kda repro/nsa --budget-s 560 --out "$OUT"
    python -m paperclub.gpu repro/fa4 --bench-args "fa4=--only bwd --rounds 9" --skip-sanitizer
    python -m paperclub.gpu repro/fa4 --select "fa4=peer_matrix and bfloat16" --skip-bench

For each package, in order, each step under a timeout cut from what is left of the budget:

1. **peers**: the wheels named in ``<package>/peers.txt`` (one ``name==version`` a line, ``#``
   comments) are installed from ``.whl/`` (carried with the call: the machine has no network) into a
   folder of their own that goes on ``PYTHONPATH`` for the steps after; then ``<package>/peers_setup.sh``,
   if there is one (a peer built from an sdist), runs with ``PEERS_DIR`` and ``WHEELS`` set.
2. **tests**: ``pytest -m gpu <package>``; the claims plugin records each claim test's outcome, with
   the device, in ``<package>/results/claims-gpu.json``.
3. **sanitizer**: the same tests once more under ``compute-sanitizer --tool memcheck``; any error it
   reports fails the step (and the job). ``PAPERCLUB_SANITIZER=1`` is set there
   (``paperclub.testing.sanitizing()``): a test may skip its slow reference in that pass, whose point
   is the kernels' memory accesses, not their values (checked in step 2).
4. **bench**: ``python -m repro.<name>.bench --out <results> --budget-s <left>`` (plus ``--bench-args``).

Everything the job wrote (result JSON, the GPU claims record, a log per step, ``gpu-job.json`` with
each step's exit status and time) is packed into ``$OUT/paperclub-gpu.tar.gz`` (the device tool
returns at most 8 files) and summarised on stdout. Back on the development machine
``python -m paperclub.gpu --collect <that file>`` puts the results into the tree (only files under a
package's ``results/``; logs go to ``build/gpu-logs/``), ready to commit.

``python -m paperclub.gpu --download repro/kda ...`` fetches the wheels of each ``peers.txt`` into
``.whl/`` for the GPU machine's Python (3.12, x86-64 manylinux).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paperclub import ROOT
from paperclub.claims import GPU_CHECKS_NAME

# the GPU machine's Python and platforms, as the device README gives them
DOWNLOAD_FLAGS = [
    "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
]  # fmt: skip
BUNDLE = "paperclub-gpu.tar.gz"


class GpuJobError(ValueError):
    """A package or manifest the job cannot use; the message names the file and the fix."""


@dataclass
class Step:
    package: str
    name: str
    status: str = "not run"  # ok | failed | timeout | skipped | not run
    exit_code: int | None = None
    seconds: float = 0.0
    detail: str = ""
    log: str = ""
    #: the ``-k`` expression the tests and sanitizer steps ran under (``--select``); "" for all of them
    selection: str = ""


@dataclass
class Job:
    packages: list[str]
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    steps: list[Step] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


def package_path(root: Path, spec: str) -> Path:
    """``repro/kda``, ``kda`` or ``nanoparallel`` -> the package folder (checked)."""
    name = spec.strip("/").removeprefix("repro/")
    path = root / "nanoparallel" if name == "nanoparallel" else root / "repro" / name
    if not path.is_dir():
        raise GpuJobError(f"package '{spec}': no folder {path.relative_to(root)}/ in {root}")
    return path


def read_peers(pkg: Path) -> list[tuple[str, str]]:
    """``(name, version)`` pairs of ``peers.txt``; each line must pin one exact version."""
    f = pkg / "peers.txt"
    if not f.exists():
        return []
    out = []
    for i, raw in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise GpuJobError(f"{f}:{i}: '{raw.strip()}' is not 'name==version' (one exact version a line)")
        out.append((m.group(1), m.group(2)))
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(wheels: Path, name: str, version: str) -> Path | None:
    for w in sorted(wheels.glob("*.whl")):
        parts = w.name.split("-")
        if len(parts) >= 2 and _norm(parts[0]) == _norm(name) and parts[1] == version:
            return w
    return None


#: Seconds a step gets, after SIGINT at its deadline, to finish on its own (pytest then writes its
#: summary, its slowest tests and the claims record of what ran) before the whole group is killed.
INTERRUPT_GRACE_S = 20.0


def _run(
    cmd: list[str] | str, *, timeout: float, log: Path, env: dict, cwd: Path
) -> tuple[str, int | None, float]:
    """Run ``cmd`` into ``log`` for at most ``timeout`` seconds. At the deadline the process group
    gets SIGINT and up to INTERRUPT_GRACE_S (a tenth of the timeout at most, inside it) to wrap up,
    then SIGKILL: a test step cut short still records the outcomes of the tests that ran."""
    t0 = time.monotonic()
    grace = min(INTERRUPT_GRACE_S, 0.1 * max(timeout, 1))
    with log.open("w", encoding="utf-8") as f:
        f.write(f"$ {cmd if isinstance(cmd, str) else shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, shell=isinstance(cmd, str),
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=max(timeout - grace, 1))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            f.flush()
            f.write(
                f"\n[paperclub.gpu] timed out after {timeout:.0f} s (interrupted at {timeout - grace:.0f} s)\n"
            )
            return "timeout", None, time.monotonic() - t0
    return ("ok" if rc == 0 else "failed"), rc, time.monotonic() - t0


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(log: Path, n: int = 3) -> str:
    lines = [
        ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()
    ]
    return " | ".join(lines[-n:])[-400:]


#: a verbose pytest line's outcome word (``path::test PASSED``, xdist's ``[gw0] ... PASSED path::test``)
_OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _partial_summary(text: str) -> str:
    """For a pytest run cut off before its closing line: the outcomes its verbose lines reported so
    far (``path::test PASSED`` or xdist's ``[gw0] ... PASSED path::test``), or '' if none."""
    counts: dict[str, int] = {}
    for ln in text.splitlines():
        if "::" not in ln:
            continue
        m = _OUTCOME.search(ln)
        if m:
            counts[m.group(1).lower()] = counts.get(m.group(1).lower(), 0) + 1
    if not counts:
        return ""
    return "cut off before pytest's summary; reported so far: " + ", ".join(
        f"{v} {k}" for k, v in counts.items()
    )


def _unfinished(text: str) -> list[str]:
    """The tests a verbose pytest log names (``path::test[id]``, as started or as scheduled by xdist)
    without ever giving their outcome: those a timeout cut, by their ids (the part after ``::``)."""
    named, done = [], set()
    for ln in text.splitlines():
        m = re.search(r"(\S+::\S+)", ln)
        if not m or ln.lstrip().startswith(("FAILED ", "ERROR ")) and " - " in ln:
            continue
        test = m.group(1)
        if _OUTCOME.search(ln):
            done.add(test)
        elif test not in named:
            named.append(test)
    return [t.split("::", 1)[1] for t in named if t not in done]


def sanitizer_errors(text: str) -> int | None:
    """The error count of compute-sanitizer's ``ERROR SUMMARY: N errors`` lines (summed), or None."""
    found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    return sum(int(n) for n in found) if found else None


# CUDA API errors that a library raises on purpose and handles itself, at start-up, as a probe: memcheck
# reports every failing API call ("Program hit ..."), these included. Each is named by the function of
# the first host frame of its backtrace, with why it is not our error. Nothing else is excused: a kernel's
# memory error is never a "Program hit" report, and an API error anywhere else still fails the step.
SANITIZER_PROBES = {
    # NCCL asks cudaFuncGetAttributes of each of its kernels at communicator creation; the kernels it
    # does not ship for this architecture answer "no kernel image", and NCCL leaves them unused
    "ncclInitKernelsForDevice": "NCCL's kernel probe at communicator creation",
    # PyTorch tries to allocate a fabric-handle block once to learn whether multi-node NVLink exists;
    # a single host answers "not permitted", and PyTorch uses POSIX handles
    "isFabricSupported": "PyTorch's NVLink-fabric probe",
}


def sanitizer_probes(text: str) -> dict[str, int]:
    """The ``Program hit`` reports in a compute-sanitizer log whose first host frame is one of
    :data:`SANITIZER_PROBES`, counted per probe."""
    counts: dict[str, int] = {}
    in_report = False
    for line in text.splitlines():
        if "========= Program hit " in line:
            in_report = True
            continue
        if in_report and "Host Frame:" in line:
            in_report = False  # only the first frame says who made the call
            for fn in SANITIZER_PROBES:
                if re.search(rf"\b{fn}\(", line):
                    counts[fn] = counts.get(fn, 0) + 1
    return counts


def run_job(
    root: Path, specs: list[str], budget_s: float, out: Path, *, bench_args: dict[str, str],
    skip: set[str], python: str = sys.executable, shares: dict[str, float] | None = None,
    select: dict[str, str] | None = None,
) -> Job:  # fmt: skip
    packages = [package_path(root, s) for s in specs]
    for p in packages:
        read_peers(p)  # a bad manifest stops the job before any time is spent
    job = Job([p.name for p in packages], budget_s)
    stage = out / "bundle"
    logs = stage / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # TRITON_CACHE_AUTOTUNING: a peer's autotuning (fla's takes minutes on a fresh machine) is cached on
    # disk by the tests step and reused by the benchmark's process instead of being redone
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_AUTOTUNING="1")
    base_env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "site"), str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    for i, pkg in enumerate(packages):
        name = pkg.name
        env = dict(base_env)
        share = package_share(job.left(), [p.name for p in packages[i:]], shares or {})
        deadline = time.monotonic() + share

        def left(reserve: float = 0.0, _deadline=deadline) -> float:
            return min(_deadline - time.monotonic(), job.left()) - reserve

        # 1. peers
        step = Step(name, "peers")
        peers = read_peers(pkg)
        site_dir = Path(f"/tmp/paperclub-peers/{name}")
        shutil.rmtree(site_dir, ignore_errors=True)
        site_dir.mkdir(parents=True)
        wheels = root / ".whl"
        missing = [f"{n}=={v}" for n, v in peers if find_wheel(wheels, n, v) is None]
        found = [str(find_wheel(wheels, n, v)) for n, v in peers if find_wheel(wheels, n, v) is not None]
        log = logs / f"{name}-peers.log"
        if "peers" in skip or (not peers and not (pkg / "peers_setup.sh").exists()):
            step.status = "skipped" if "peers" in skip else "ok"
            step.detail = "no peers.txt" if not peers else "skipped"
            log.write_text(step.detail + "\n")
        else:
            status, rc, secs = "ok", 0, 0.0
            if found:
                cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--target", str(site_dir), *found]  # fmt: skip
                status, rc, secs = _run(cmd, timeout=min(120, left(60)), log=log, env=env, cwd=root)
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(site_dir)])
            if (pkg / "peers_setup.sh").exists() and status == "ok":
                setup_env = dict(env, PEERS_DIR=str(site_dir), WHEELS=str(wheels))
                status, rc, s2 = _run(
                    ["bash", str(pkg / "peers_setup.sh")], timeout=min(300, left(60)),
                    log=logs / f"{name}-peers-setup.log", env=setup_env, cwd=root,
                )  # fmt: skip
                secs += s2
            step.status, step.exit_code, step.seconds = status, rc, secs
            step.detail = (f"missing wheels: {', '.join(missing)}; " if missing else "") + (
                f"installed {len(found)} wheel(s)" if found else "no wheels installed"
            )
        step.log = str(log.relative_to(stage))
        job.steps.append(step)
        _say(step)

        # 2. GPU tests (claims recorded into results/claims-gpu.json by the plugin)
        test_cmd = [python, "-m", "pytest", "-m", "gpu", str(pkg.relative_to(root)), "-v", "--tb=short",
                    "-p", "no:cacheprovider", "--durations=15"]  # fmt: skip
        selection = (select or {}).get(name, "")
        if selection:  # a part of the package's GPU tests (a job too long for one call, run in parts)
            test_cmd += ["-k", selection]
        measures = str(logs / f"{name}-measures.jsonl")
        for step_name, cmd, extra_env in (
            ("tests", [*test_cmd, *_xdist_args()], {"PAPERCLUB_TEST_LOG": measures}),
            # one process: under memcheck every worker would load CUDA's libraries instrumented
            ("sanitizer", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "86", *test_cmd, "-x"],
             {"PAPERCLUB_RECORD_CLAIMS": "0", "PAPERCLUB_SANITIZER": "1"}),
        ):  # fmt: skip
            step = Step(name, step_name, selection=selection)
            log = logs / f"{name}-{step_name}.log"
            # the benchmark keeps about half of the share, unless it is skipped
            bench_reserve = 0.0 if "bench" in skip else 0.45 * max(left(), 0)
            if step_name == "tests" and "sanitizer" not in skip:
                bench_reserve += 0.25 * max(
                    left() - bench_reserve, 0
                )  # and the sanitizer a quarter of the rest
            if step_name in skip or left(bench_reserve) < 20:
                step.status = "skipped"
                step.detail = "skipped" if step_name in skip else "no time left in the budget"
                log.write_text(step.detail + "\n")
            elif step_name == "sanitizer" and shutil.which("compute-sanitizer") is None:
                step.status, step.detail = "failed", "compute-sanitizer is not on PATH"
                log.write_text(step.detail + "\n")
            else:
                step.status, step.exit_code, step.seconds = _run(
                    cmd, timeout=left(bench_reserve), log=log, env=dict(env, **extra_env), cwd=root
                )
                text = log.read_text(encoding="utf-8", errors="replace")
                if step_name == "sanitizer":
                    errs = sanitizer_errors(text)
                    probes = sanitizer_probes(text)
                    ours = None if errs is None else errs - sum(probes.values())
                    if ours:
                        step.status = "failed"
                    elif probes and step.exit_code == 86 and (summary := _pytest_summary(text)):
                        # 86: the sanitizer's exit code for any report, here only the probes'; pytest's own
                        # outcome (which 86 hides) is read from its summary line
                        if not re.search(r"\d+ (failed|errors?)\b", summary):
                            step.status = "ok"
                    step.detail = f"compute-sanitizer errors: {ours if ours is not None else 'no summary'}; "
                    if probes:
                        step.detail += (
                            "not counted, libraries' own start-up probes: "
                            + ", ".join(f"{n} from {SANITIZER_PROBES[fn]}" for fn, n in probes.items())
                            + "; "
                        )
                    if step.exit_code == 5:  # pytest: nothing collected (no gpu tests)
                        step.status = "ok"
                step.detail += _pytest_summary(text) or _partial_summary(text) or _tail(log)
                if step.status == "timeout" and (cut := _unfinished(text)):
                    step.detail += f"; cut by the step's timeout while running: {', '.join(cut[:8])}"
                    step.detail += f" (+{len(cut) - 8} more)" if len(cut) > 8 else ""
                if selection:
                    step.detail = f"-k '{selection}' only: {step.detail}"
                if step_name == "tests" and step.exit_code == 5:
                    step.status, step.detail = "ok", "no gpu-marked tests"
            step.log = str(log.relative_to(stage))
            job.steps.append(step)
            _say(step)
        claims_gpu = pkg / "results" / "claims-gpu.json"
        tests_ran = any(s.package == name and s.name == "tests" and s.status not in ("skipped", "not run")
                        for s in job.steps)  # fmt: skip
        # only a run of the tests has a record to bring back (else it is the tree's own copy, which
        # would overwrite what a later collect of an earlier run put there)
        if claims_gpu.exists() and tests_ran:
            dest = stage / claims_gpu.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(claims_gpu, dest)

        # 4. benchmark
        step = Step(name, "bench")
        log = logs / f"{name}-bench.log"
        results = stage / pkg.relative_to(root) / "results"
        results.mkdir(parents=True, exist_ok=True)
        budget = int(left(15))
        module = "nanoparallel.bench" if name == "nanoparallel" else f"repro.{name}.bench"
        if "bench" in skip or budget < 30:
            step.status = "skipped"
            step.detail = "skipped" if "bench" in skip else f"no time left in the budget ({budget} s)"
            log.write_text(step.detail + "\n")
        else:
            cmd = [python, "-m", module, "--out", str(results), "--budget-s", str(budget - 20),
                   *shlex.split(bench_args.get(name, ""))]  # fmt: skip
            step.status, step.exit_code, step.seconds = _run(cmd, timeout=budget, log=log, env=env, cwd=root)
            step.detail = _tail(log)
        step.log = str(log.relative_to(stage))
        job.steps.append(step)
        _say(step)
    return job


def package_share(left: float, names: list[str], shares: dict[str, float]) -> float:
    """Seconds for ``names[0]`` out of ``left``: its ``--share`` if it has one, else an equal part of
    what the later packages' own shares leave (so that each later package still gets its share)."""
    first, later = names[0], names[1:]
    if first in shares:
        return min(shares[first], left)
    kept = sum(shares.get(n, 0.0) for n in later)
    unshared = 1 + sum(1 for n in later if n not in shares)
    return max(left - kept, 0.0) / unshared


def _xdist_args() -> list[str]:
    """Spread the GPU tests over worker processes when pytest-xdist is there: most of a kernel test's
    time on a fresh machine is Triton compiling (CPU work), which then runs side by side."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return []
    # 4: at 8 workers the fp64 references of the KDA matrix ran the H100 (80 GB) out of memory;
    # PAPERCLUB_GPU_WORKERS overrides it for a package whose tests need less memory or more compiling
    wanted = os.environ.get("PAPERCLUB_GPU_WORKERS", "")
    if wanted:
        if not wanted.isdigit() or int(wanted) < 1:
            raise SystemExit(f"PAPERCLUB_GPU_WORKERS={wanted!r}: expected a positive integer")
        return ["-n", wanted]
    # under 8 CPUs one worker: in this process, not one xdist worker beside an idle controller
    n = max(1, min(4, (os.cpu_count() or 2) // 4))
    return ["-n", str(n)] if n > 1 else []


def _pytest_summary(text: str) -> str:
    lines = [
        ln.strip("= ")
        for ln in text.splitlines()
        # pytest's closing line ("1 failed, 51 passed, ... in 28.53s"), not compute-sanitizer's "0 errors"
        if re.search(r"\d+ (passed|failed|errors?|skipped|xfailed|deselected)\b.* in [\d.]+s", ln)
    ]
    return lines[-1] if lines else ""


def _say(step: Step) -> None:
    print(
        f"[paperclub.gpu] {step.package:12s} {step.name:9s} {step.status:8s} {step.seconds:6.0f} s  {step.detail}",
        flush=True,
    )


def pack(job: Job, out: Path) -> Path:
    stage = out / "bundle"
    meta = {
        "packages": job.packages,
        "budget_s": job.budget_s,
        "seconds": round(time.monotonic() - job.started, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": [asdict(s) for s in job.steps],
        "environment": _environment(),
    }
    (stage / "gpu-job.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    target = out / BUNDLE
    with tarfile.open(target, "w:gz") as tar:
        for f in sorted(stage.rglob("*")):
            if f.is_file():
                tar.add(f, arcname=str(f.relative_to(stage)))
    shutil.copy(stage / "gpu-job.json", out / "gpu-job.json")
    shutil.rmtree(stage)  # the device tool returns few files: the bundle holds them all
    return target


def _environment() -> dict:
    try:
        from paperclub.bench import environment

        return environment()
    except Exception as exc:  # the job's record must not fail on this
        return {"error": str(exc)}


def collect(bundle: Path, root: Path) -> list[Path]:
    """Put a job's results into the tree: files under a package's ``results/`` (JSON, CSV), and the
    logs and gpu-job.json into ``build/gpu-logs/``. Returns the files written."""
    if not bundle.exists():
        raise GpuJobError(f"--collect: no file {bundle}")
    written = []
    pattern = re.compile(r"^(repro/[a-z0-9_]+|nanoparallel)/results/[A-Za-z0-9._-]+\.(json|csv)$")
    with tarfile.open(bundle, "r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            if pattern.match(m.name):
                dest = root / m.name
            elif m.name.startswith("logs/") or m.name == "gpu-job.json":
                dest = root / "build" / "gpu-logs" / m.name
            else:
                print(f"[paperclub.gpu] --collect: left out {m.name} (not a results or log file)")
                continue
            if ".." in Path(m.name).parts:
                raise GpuJobError(f"--collect: unsafe path {m.name} in {bundle}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(m).read())
            written.append(dest)
        manifest = next((m for m in tar.getmembers() if m.name == "gpu-job.json"), None)
        if manifest is not None:
            written += record_checks(json.loads(tar.extractfile(manifest).read()), root)
    return written


def record_checks(job: dict, root: Path) -> list[Path]:
    """Keep, per package, the latest outcome of each GPU check that ran (the GPU tests and their
    compute-sanitizer pass) in ``results/gpu-checks.json``: step, status, detail, date and device.
    A skipped step leaves the earlier record of that step as it was."""
    written = []
    env = job.get("environment", {})
    for name in job.get("packages", []):
        pkg = root / ("nanoparallel" if name == "nanoparallel" else f"repro/{name}")
        if not pkg.is_dir():
            continue
        steps = [
            s
            for s in job.get("steps", [])
            if s.get("package") == name and s.get("name") in ("tests", "sanitizer")
        ]
        ran = [s for s in steps if s.get("status") not in ("skipped", "not run")]
        if not ran:
            continue
        path = pkg / "results" / GPU_CHECKS_NAME
        doc = json.loads(path.read_text()) if path.exists() else {"checks": {}}
        for s in ran:
            # a selected part is kept beside the whole package's record, never in its place
            key = s["name"] + (f" -k {s['selection']}" if s.get("selection") else "")
            doc["checks"][key] = {
                "status": s["status"],
                "detail": s.get("detail", ""),
                "date": job.get("date"),
                "device": env.get("device"),
                "versions": {k: env.get(k) for k in ("torch", "triton", "cuda")},
            }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def download(root: Path, specs: list[str], python: str = sys.executable) -> int:
    wheels = root / ".whl"
    wheels.mkdir(exist_ok=True)
    rc = 0
    for spec in specs:
        pkg = package_path(root, spec)
        for name, version in read_peers(pkg):
            if find_wheel(wheels, name, version):
                print(f"{pkg.name}: {name}=={version} already in .whl/")
                continue
            cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *DOWNLOAD_FLAGS,
                   "-d", str(wheels), f"{name}=={version}"]  # fmt: skip
            r = subprocess.run(cmd)
            print(f"{pkg.name}: {name}=={version}: {'ok' if r.returncode == 0 else 'FAILED'}")
            rc |= r.returncode
    return rc


def _per_package(items: list[str], flag: str, expected: str, convert) -> dict:
    """``NAME=VALUE`` options as ``{package name: convert(VALUE)}``; a malformed one is a GpuJobError."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.removeprefix("repro/")] = convert(value)
        except ValueError:
            sep = ""
        if not sep:
            raise GpuJobError(f"{flag} '{item}': expected {expected}")
    return out


def _nonempty(value: str) -> str:
    if not value.strip():
        raise ValueError("empty")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m paperclub.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("packages", nargs="*", help="repro/<name> (or nanoparallel), in the order to run")
    ap.add_argument("--budget-s", type=float, default=540, help="the whole job's time (default 540)")
    ap.add_argument(
        "--out", default=os.environ.get("OUT", "/tmp/paperclub-gpu"), help="where the bundle goes ($OUT)"
    )
    ap.add_argument("--bench-args", action="append", default=[], metavar="NAME=ARGS",
                    help="extra arguments for one package's bench, e.g. 'kda=--quick'")  # fmt: skip
    ap.add_argument("--select", action="append", default=[], metavar="NAME=EXPR",
                    help="run only the tests of one package that pytest's -k EXPR selects (tests and "
                    "sanitizer steps), e.g. 'fa4=peer_matrix and bfloat16'; recorded apart in gpu-checks.json")  # fmt: skip
    ap.add_argument("--share", action="append", default=[], metavar="NAME=SECONDS",
                    help="one package's part of the budget (the others split the rest), e.g. kda=300")  # fmt: skip
    for s in ("peers", "tests", "sanitizer", "bench"):
        ap.add_argument(f"--skip-{s}", action="store_true", help=f"leave out the {s} step")
    ap.add_argument(
        "--collect", metavar="BUNDLE", help=f"put the results of a returned {BUNDLE} into the tree"
    )
    ap.add_argument("--download", action="store_true", help="fetch the packages' peer wheels into .whl/")
    ap.add_argument("--root", default=None, help="repository root (default: the one this package is in)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve() if args.root else ROOT
    try:
        if args.collect:
            for f in collect(Path(args.collect), root):
                print(f"wrote {f.relative_to(root)}")
            return 0
        if not args.packages:
            ap.error("name at least one package, e.g. repro/kda")
        if args.download:
            return download(root, args.packages)
        bench_args = _per_package(args.bench_args, "--bench-args", "NAME=ARGS, e.g. kda=--quick", str)
        shares = _per_package(args.share, "--share", "NAME=SECONDS, e.g. kda=300", float)
        select = _per_package(args.select, "--select", "NAME=EXPR, e.g. 'fa4=peer_matrix'", _nonempty)
        skip = {s for s in ("peers", "tests", "sanitizer", "bench") if getattr(args, f"skip_{s}")}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        job = run_job(
            root,
            args.packages,
            args.budget_s,
            out,
            bench_args=bench_args,
            skip=skip,
            shares=shares,
            select=select,
        )
    except GpuJobError as exc:
        print(f"paperclub.gpu: {exc}", file=sys.stderr)
        return 2
    target = pack(job, out)
    print(
        f"\n[paperclub.gpu] {len(job.steps)} steps in {time.monotonic() - job.started:.0f} s; wrote {target}"
    )
    buf = io.StringIO()
    for s in job.steps:
        buf.write(f"{s.package:12s} {s.name:9s} {s.status:8s} {s.seconds:6.0f} s  {s.detail}\n")
    print(buf.getvalue())
    failed = [s for s in job.steps if s.status in ("failed", "timeout")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
