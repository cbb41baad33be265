"""pytest plugin: ``@pytest.mark.claim(id, section=...)`` ties a property test to a paper claim.

Loaded for every run through ``addopts = -p paperclub.pytest_claims`` in pyproject.toml.

* Collection fails with a clear message when a test names a claim that ``claims.yaml`` does not
  register, or a section that differs from the registered one.
* After the run, each package's ``results/claims.json`` records every claim test's outcome
  (passed / failed / skipped) and the date that outcome was first seen; a file is rewritten only
  when an outcome changes, so re-running green tests leaves the tree clean. A skip does not
  replace a pass or failure recorded on a machine that could run the test (a GPU test on a CPU). Set
  ``PAPERCLUB_RECORD_CLAIMS=0`` to record nothing.
* Where a test ran is part of its outcome: a run on a machine with a CUDA GPU records into
  ``results/claims-gpu.json`` (same format, the GPU named in ``platform``), a run without one into
  ``results/claims.json``; the site shows both. The GPU job (``paperclub.gpu``) brings the GPU record back.
* Triton kernels run under its CPU interpreter when no NVIDIA GPU is present
  (``TRITON_INTERPRET=1`` is set before anything imports triton).
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import functools
import gc
import importlib.metadata
import json
import os
import platform
import sys
import warnings
from pathlib import Path

import pytest

if not (os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paperclub import ROOT  # noqa: E402
from paperclub.claims import ClaimsError, load_registry, package_dirs, results_path  # noqa: E402

_REGISTRY_KEY = pytest.StashKey[dict]()
_ROOT_KEY = pytest.StashKey[Path]()
_OUTCOMES_KEY = pytest.StashKey[dict]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "claim(id, section): the paper claim this property test checks (registered in <package>/claims.yaml)",
    )
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: longer than a few seconds on a laptop CPU")
    config.stash[_OUTCOMES_KEY] = {}
    _CONFIG[:] = [config]
    # the repository whose claims apply: pytest's rootdir when it holds reproductions, else this checkout
    rootpath = Path(config.rootpath)
    has_packages = (rootpath / "repro").is_dir() or (rootpath / "nanoparallel").is_dir()
    config.stash[_ROOT_KEY] = rootpath if has_packages else ROOT


def _registry(config: pytest.Config) -> dict:
    if _REGISTRY_KEY not in config.stash:
        try:
            config.stash[_REGISTRY_KEY] = load_registry(config.stash[_ROOT_KEY])
        except ClaimsError as exc:
            raise pytest.UsageError(f"claims registry: {exc}") from None
    return config.stash[_REGISTRY_KEY]


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    registry = _registry(config)
    problems: list[str] = []
    seen: set[tuple] = set()
    for item in items:
        # a marker is written once per test function: report it once, not once per parametrised case
        function = getattr(item, "function", None)
        code = getattr(function, "__code__", None)
        where = f"{item.path.relative_to(config.rootpath) if item.path.is_relative_to(config.rootpath) else item.path}"
        if code is not None:
            where += f":{code.co_firstlineno} ({getattr(item, 'originalname', item.name)})"
        else:
            where = item.nodeid
        for mark in item.iter_markers("claim"):
            key = (where, mark.args, tuple(sorted(mark.kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            if len(mark.args) != 1 or not isinstance(mark.args[0], str):
                problems.append(
                    f"{where}: @pytest.mark.claim takes one claim id, e.g. claim('kda/exact', section='§3')"
                )
                continue
            cid = mark.args[0]
            section = mark.kwargs.get("section")
            claim = registry.get(cid)
            if claim is None:
                pkg = cid.split("/")[0]
                problems.append(
                    f"{where}: claim '{cid}' is not registered; add it to {pkg}/claims.yaml or fix the id"
                )
            elif section is None:
                problems.append(f"{where}: claim '{cid}' needs section=... (registered: {claim.section!r})")
            elif section.strip() != claim.section:
                problems.append(
                    f"{where}: claim '{cid}' says section {section!r} but claims.yaml registers {claim.section!r}"
                )
    if problems:
        raise pytest.UsageError("claim markers do not match the registry:\n  " + "\n  ".join(problems))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        if not _on_gpu():
            for item in gpu_items:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    mark = item.get_closest_marker("claim")
    if mark is not None and mark.args:
        # carried on the report, so that under pytest-xdist the controller, which sees reports and
        # not items, records it (pytest_runtest_logreport)
        report.user_properties.append((_CLAIM_PROPERTY, mark.args[0]))
    return report


_CLAIM_PROPERTY = "paperclub_claim"

#: a GPU test that leaves more than this allocated after its teardown is named in the run's output
_LEFT_ALLOCATED_REPORT = 1 << 30


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem) -> None:
    """After each ``gpu`` test: collect reference cycles (and hand the caching allocator's free blocks
    back once it holds half the GPU), so that one process running every GPU test in turn (the GPU
    job's compute-sanitizer pass, without pytest-xdist) holds no more than the test at hand; a test
    that still leaves over 1 GiB allocated is named in the run's output (the job's log), with the
    amount and the largest live tensors."""
    if item.get_closest_marker("gpu") is None:
        return

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    gc.collect()
    if torch.cuda.memory_reserved() > torch.cuda.get_device_properties(0).total_memory // 2:
        torch.cuda.empty_cache()  # not after every test: under compute-sanitizer each cudaMalloc is slow
    left = torch.cuda.memory_allocated()
    if left > _LEFT_ALLOCATED_REPORT:
        lines = [f"[paperclub] {item.nodeid} left {left / 2**30:.2f} GiB allocated on the GPU"]
        lines += _large_cuda_tensors(torch)
        # pytest captures stdout and stderr during teardown (shown only for failures): the terminal
        # reporter writes past the capture
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        for line in lines:
            if reporter is not None:
                reporter.write_line(line)
            else:  # pragma: no cover - run without a terminal
                print(line, file=sys.__stderr__)


def _large_cuda_tensors(torch, min_bytes: int = 64 << 20, limit: int = 8) -> list[str]:
    """The live CUDA tensors over ``min_bytes`` that the garbage collector can see, largest first,
    each with the types of what refers to it: where a test's memory is held."""
    found = []
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.nbytes >= min_bytes:
                    found.append(obj)
            except Exception:  # noqa: BLE001 - objects that fail isinstance or attribute access
                continue
    found.sort(key=lambda t: -t.nbytes)
    out = []
    top, here = found[:limit], sys._getframe()
    for t in top:
        refs = sorted(
            {type(r).__name__ for r in gc.get_referrers(t) if not any(r is x for x in (found, top, here))}
        )
        out.append(
            f"    {tuple(t.shape)} {t.dtype} {t.nbytes / 2**20:.0f} MiB, held by {', '.join(refs) or '?'}"
        )
    if len(found) > limit:
        out.append(f"    ... {len(found) - limit} more over {min_bytes >> 20} MiB")
    return out


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    claim = next((v for k, v in report.user_properties if k == _CLAIM_PROPERTY), None)
    if claim is None:
        return
    outcomes = _CONFIG[0].stash[_OUTCOMES_KEY] if _CONFIG else None
    if outcomes is None:
        return
    prev = outcomes.get(report.nodeid)
    if report.failed:
        outcome = "failed"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "passed"
    else:
        outcome = prev[1] if prev else None
    if outcome is not None and not (prev and prev[1] == "failed"):
        outcomes[report.nodeid] = (claim, outcome, report.fspath)


_CONFIG: list[pytest.Config] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("PAPERCLUB_RECORD_CLAIMS", "1") == "0" or hasattr(session.config, "workerinput"):
        return  # (an xdist worker: its reports reach the controller, which records them)
    outcomes = session.config.stash.get(_OUTCOMES_KEY, {})
    if not outcomes:
        return
    today = _dt.date.today().isoformat()
    root = session.config.stash[_ROOT_KEY]
    for package, pdir in package_dirs(root):
        mine = {nid: v for nid, v in outcomes.items() if v[0].split("/")[0] == package}
        if not mine:
            continue
        path = results_path(pdir)
        if _on_gpu():
            path = path.with_name(GPU_RESULTS_NAME)
        old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"tests": {}}
        # a record of a test whose file or function is gone (removed, renamed) goes with it, and so
        # does one of a function recorded now in the other form: its plain id once it is
        # parametrised, its parametrised ids once it is not (the function exists in either case)
        rel_ids = {nid: _relative_nodeid(nid, Path(session.config.rootpath), root) for nid in mine}
        now_param = {r.split("[")[0] for r in rel_ids.values() if "[" in r}
        now_plain = {r for r in rel_ids.values() if "[" not in r}
        tests = {
            nid: t
            for nid, t in old.get("tests", {}).items()
            if _test_exists(root, nid)
            and not ("[" not in nid and nid in now_param)
            and not ("[" in nid and nid.split("[")[0] in now_plain)
        }
        changed = len(tests) != len(old.get("tests", {}))
        for nid, (cid, outcome, _file) in mine.items():
            rel = rel_ids[nid]
            prev = tests.get(rel)
            if prev and prev.get("outcome") == outcome and prev.get("claim") == cid:
                continue
            if (
                outcome == "skipped"
                and prev
                and prev.get("outcome") in ("passed", "failed")
                and prev.get("claim") == cid
            ):
                continue  # a skip here (no GPU, say) does not erase what a machine that ran the test saw
            tests[rel] = {"claim": cid, "outcome": outcome, "since": today, "platform": _platform()}
            changed = True
        if changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                json.dumps({"tests": dict(sorted(tests.items()))}, indent=1) + "\n", encoding="utf-8"
            )


GPU_RESULTS_NAME = "claims-gpu.json"


def _test_exists(root: Path, nodeid: str) -> bool:
    """Whether the file of ``nodeid`` exists and still defines its test function."""
    file_part, _, rest = nodeid.partition("::")
    path = root / file_part
    if not path.is_file():
        return False
    func = rest.split("::")[-1].split("[")[0]
    return not func or f"def {func}(" in path.read_text(encoding="utf-8", errors="replace")


def _no_gpu_here() -> bool:
    """True when this (Linux) machine has no GPU that torch could use, known without importing torch
    (seconds of a run that imports nothing else of it: the claims plugin's own tests, the CPU runs of
    a package's pure-Python claims, the GPU job's toy): no NVIDIA driver library (``libcuda.so.1``,
    which CUDA's runtime loads) and no AMD GPU device (``/dev/kfd``, ROCm). False where unsure: torch
    is already imported, another OS, or a driver is there (then torch is asked)."""
    if "torch" in sys.modules or not sys.platform.startswith("linux") or os.path.exists("/dev/kfd"):
        return False
    return not _cuda_driver_loads()


@functools.cache
def _cuda_driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _on_gpu() -> bool:
    if _no_gpu_here():
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing
        return False


def _relative_nodeid(nodeid: str, rootpath: Path, root: Path) -> str:
    """Node ids (relative to pytest's rootdir) made relative to the repository root."""
    file_part, _, rest = nodeid.partition("::")
    p = Path(file_part)
    if not p.is_absolute():
        p = (rootpath / p).resolve()
    try:
        file_part = str(p.relative_to(root.resolve()))
    except ValueError:
        pass
    return f"{file_part}::{rest}" if rest else file_part


def _platform() -> str:
    if _no_gpu_here():  # torch's version without importing it (its installed distribution's)
        try:
            return f"cpu, torch {importlib.metadata.version('torch')}, {platform.machine()}"
        except importlib.metadata.PackageNotFoundError:
            return platform.machine()
    try:
        import torch

        dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        return f"{dev}, torch {torch.__version__}, {platform.machine()}"
    except Exception:  # pragma: no cover
        return platform.machine()
