"""Tools for the lab folders (``repro/<name>/lab/``): Nsight Compute and the offline sm_90a compile report.

Never imported by a fast path: a kernel file does not call these; a reproduction's ``lab/`` scripts and
its CPU tests of compiled code do. Everything here works without a GPU except running ncu itself.

**Offline compile for sm_90a** (Triton's compiler and its bundled ptxas / nvdisasm need no GPU)::

    from paperclub.lab import compile_sm90, compile_report
    c = compile_sm90(kernels._fwd_kernel, constexprs={"D": 128, ...}, types={"Q": "*bf16", ...},
                     num_warps=8, num_stages=3)
    row = compile_report(c, case="fwd d128")

:func:`signature_of` fills a kernel's signature from its argument names (pointers and descriptors as
given, the rest ``i32`` or as named); :func:`compile_sm90` compiles a ``triton.jit`` or ``gluon.jit``
kernel (told apart by its type) for :func:`sm90_target` (``GPUTarget("cuda", 90, 32)``); :func:`compile_report` reads one
compiled kernel into a row: ``kernel``, ``shared`` (bytes), ``num_warps``, ``target_ok`` (the PTX
targets sm_90a), ``registers``, ``spill_stores``, ``spill_loads`` (ptxas ``-v``, as Triton ran it
to assemble the cubin; the launch allocation, which ``setmaxnreg`` then moves), instruction counts in the PTX (:func:`ptx_counts`:
wgmma, TMA loads and stores, TMA bulk reductions, atomics, bulk-group commits and waits, mbarrier
waits, barrier syncs, ``setmaxnreg`` values) and two fingerprints, ``ptx_sha`` and ``sass_sha``:
SHA-256 (16 hex digits) of the PTX without its debug information (:func:`normalized_ptx`: ``.file``
/ ``.loc`` lines and ``.debug_*`` sections, which name source files and lines) and of the SASS that
nvdisasm prints from the cubin. Equal fingerprints mean the same machine code whatever file the
kernel's source sits in: what a refactoring that moves kernels must keep.

Kernels defined while ``TRITON_INTERPRET=1`` (every CPU test run) are interpreter objects and cannot
be compiled; :func:`offline` runs a compile driver, ``"package.module:function"`` taking a JSON list of
cases and returning rows, in a fresh process without the interpreter and with a fresh Triton cache
(so ptxas really runs), and returns its rows: the driver's module is imported there, so it may
define the kernels' signatures at import time. ``python -m paperclub.lab compile MODULE:FUNCTION
'<cases JSON>'`` is the same from a shell (the rows as JSON on the last line).

**Nsight Compute**: :func:`find_ncu` (PATH, then the usual install folders), :func:`ncu_command` and
:func:`run_ncu` (profile a command that marks its region with :func:`profile_once`, i.e.
``cudaProfilerStart/Stop``, export the raw and details pages as CSV, retry without extra metrics
when ncu refuses a metric name, and export per-instruction SASS views of chosen kernels), and
:func:`ncu_summary` (the raw page reduced to :data:`NCU_SUMMARY`'s metrics per kernel, in base units,
with the largest warp stall reasons). ``python -m paperclub.lab ncu --out DIR -- python3 -m
repro.fa4.lab.ncu --target`` and ``python -m paperclub.lab ncu-summary FILE.csv`` from a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from paperclub import ROOT, usable_cpus
from paperclub.triton_compat import ptxas_log_usage, ptxas_usage

__all__ = [
    "HOPPER_SMEM_PER_BLOCK",
    "NCU_PIPE_METRICS",
    "NCU_SECTIONS",
    "NCU_SUMMARY",
    "compile_report",
    "compile_sm90",
    "find_ncu",
    "fingerprint",
    "ncu_command",
    "ncu_summary",
    "normalized_ptx",
    "offline",
    "print_ncu_summary",
    "profile_once",
    "ptx_counts",
    "run_ncu",
    "sass_text",
    "signature_of",
    "sm90_target",
]

# ---------------------------------------------------------------------------------------------
# Offline compile for sm_90a
# ---------------------------------------------------------------------------------------------


def signature_of(
    fn,
    types: Mapping[str, str] | None = None,
    constexprs: Mapping[str, Any] | None = None,
    default: str = "i32",
) -> dict[str, str]:
    """Triton's signature of kernel ``fn``: ``"constexpr"`` for the names in ``constexprs``, ``types[name]``
    for the others named there (``"*bf16"``, ``"fp32"``, ``"tensordesc<...>"``), ``default`` for the
    rest (integer sizes and strides). A name in ``types`` or ``constexprs`` that is not an argument
    of ``fn`` is an error naming it (a typo would otherwise compile a different kernel)."""
    types, constexprs = dict(types or {}), dict(constexprs or {})
    args = list(fn.arg_names)
    unknown = (set(types) | set(constexprs)) - set(args)
    if unknown:
        raise ValueError(f"signature_of({_name(fn)}): {sorted(unknown)} are not arguments; it takes {args}")
    return {a: "constexpr" if a in constexprs else types.get(a, default) for a in args}


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", repr(fn))


def _is_gluon(fn) -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:  # pragma: no cover - a Triton without Gluon
        return False
    return isinstance(fn, GluonJITFunction)


def sm90_target(capability: int = 90, warp_size: int = 32):
    """Triton's ``GPUTarget`` for an offline compile: CUDA, sm_``capability`` (90: Hopper, sm_90a), 32
    threads a warp. What :func:`compile_sm90` compiles for; a tool that binds a launch's arguments
    itself (``triton.compiler.make_backend(sm90_target())``) takes the same."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", capability, warp_size)


def compile_sm90(
    fn,
    *,
    constexprs: Mapping[Any, Any],
    types: Mapping[str, str] | None = None,
    signature: Mapping[str, str] | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    divisible: Sequence[str] = (),
    capability: int = 90,
    warp_size: int = 32,
    attrs: Mapping[tuple, Any] | None = None,
    options: Mapping[str, Any] | None = None,
):
    """Compile kernel ``fn`` (``triton.jit`` or ``gluon.jit``) for sm_``capability``a without a GPU; returns
    Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).

    ``constexprs`` by argument name, or by argument path as a launch's binder gives them
    (``JITFunction._pack_args``); ``signature`` is taken as given, or built by :func:`signature_of` from
    ``types``; ``divisible`` names arguments specialised as divisible by 16 (as a launch does for aligned
    pointers and sizes), ``attrs`` adds Triton's specialisation attributes by argument path as that
    binder makes them; ``options`` are further compile options (Triton's ``CUDAOptions`` fields, e.g. a
    launch's whole set), under ``num_warps`` and ``num_stages`` (None: ``options``' or Triton's default).
    ``warp_size``: the target's threads per warp (:func:`sm90_target`); before 2026-11-29 it was
    misnamed ``ptx_version`` with a default of 128, which Triton's CUDA backend does not read (its
    options' own warp size, 32, is what it compiles with), so the compiled code was the same.
    Raises ``RuntimeError`` under ``TRITON_INTERPRET=1``, where kernels are interpreter objects (use
    :func:`offline`)."""
    import triton

    if not hasattr(fn, "arg_names") or type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError(
            f"compile_sm90({_name(fn)}): not a compilable kernel (defined under TRITON_INTERPRET=1?); "
            "compile in a process without the interpreter: paperclub.lab.offline"
        )
    sig = dict(signature) if signature is not None else signature_of(fn, types, constexprs)
    args = list(fn.arg_names)
    bad = [a for a in divisible if a not in args]
    if bad:
        raise ValueError(f"compile_sm90({_name(fn)}): divisible names {bad} are not arguments")
    attrs = {**(attrs or {}), **{(args.index(a),): [["tt.divisibility", 16]] for a in divisible}}
    if _is_gluon(fn):
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    src = Source(fn, sig, constexprs=dict(constexprs), attrs=attrs or None)
    opts: dict[str, Any] = {**(options or {}), "num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    # Triton runs ``ptxas -v`` to make the cubin and drops what it prints unless asked to print it:
    # keep it, so that compile_report reads registers and spills from the assembly the GPU would load
    # instead of assembling the PTX a second time (a quarter of an offline compile's time)
    printed = io.StringIO()
    knob = triton.knobs.nvidia
    before = knob.dump_ptxas_log
    try:
        knob.dump_ptxas_log = True
        with contextlib.redirect_stdout(printed):
            compiled = triton.compile(src, target=sm90_target(capability, warp_size), options=opts)
    except BaseException:
        sys.stdout.write(printed.getvalue())  # Triton's own report of a failed ptxas, as it printed it
        raise
    finally:
        knob.dump_ptxas_log = before
    compiled.ptxas_log = printed.getvalue()  # empty when the kernel came from Triton's cache
    return compiled


# the most shared memory one block may use on an H100 or H200 (227 KiB, the opt-in maximum); a
# compiled kernel asking for more (``compile_report``'s ``shared``) is refused at launch there
HOPPER_SMEM_PER_BLOCK = 227 * 1024

_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug_\w+\s*\{.*?^\s*\}", re.S | re.M)


def normalized_ptx(ptx: str) -> str:
    """The PTX without what names the source: ``.file`` and ``.loc`` lines, the ``.debug_*`` sections
    and comment lines. What is left is the code the kernel's source compiles to."""
    ptx = _DEBUG_SECTION.sub("", ptx)
    keep = []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith((".file", ".loc", "//")) or not s:
            continue
        keep.append(line.rstrip())
    return "\n".join(keep) + "\n"


def fingerprint(text: str) -> str:
    """SHA-256 of ``text``, 16 hex digits."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _bundled(tool: str) -> Path | None:
    import triton

    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    return p if p.exists() else None


def sass_text(cubin: bytes) -> str | None:
    """The SASS of ``cubin`` as Triton's bundled ``nvdisasm`` prints it (code only, no line
    information); None where this Triton bundles no nvdisasm."""
    tool = _bundled("nvdisasm")
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "k.cubin"
        f.write_bytes(cubin)
        r = subprocess.run([str(tool), "-c", str(f)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None
    return r.stdout


def ptx_counts(ptx: str) -> dict:
    """Counts of the instructions a Hopper kernel's schedule rests on, from its PTX."""

    def n(pattern: str) -> int:
        return len(re.findall(pattern, ptx))

    copies = n(r"cp\.async\.bulk\.tensor")
    stores = n(r"cp\.async\.bulk\.tensor\.\d+d\.global\.shared")
    return {
        "wgmma": n(r"wgmma\.mma_async"),
        "tma_loads": copies - stores,
        "tma_stores": stores,
        "bulk_reduce": n(r"cp\.reduce\.async\.bulk"),
        "bulk_reduce_kinds": sorted(set(re.findall(r"cp\.reduce\.async\.bulk[\w.:]*", ptx))),
        "atomics": sorted(set(re.findall(r"\b(?:red|atom)\.global[\w.]*", ptx))),
        "atomic_count": n(r"\b(?:red|atom)\.global"),
        "bulk_commit": n(r"cp\.async\.bulk\.commit_group"),
        "bulk_wait": n(r"cp\.async\.bulk\.wait_group"),
        "mbarrier_waits": n(r"mbarrier\.try_wait"),
        "bar_syncs": n(r"\bbar(?:rier)?\.sync"),
        "setmaxnreg": sorted(
            {int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        ),
    }


def compile_report(compiled, *, ptxas: bool = True, sass: bool = True, **fields) -> dict:
    """One compiled kernel as a row (see the module docstring): ``fields`` first (what the caller
    names the case by), then ``kernel``, ``shared``, ``num_warps``, ``target_ok``, ``ptx_sha``,
    ``sass_sha`` (None without nvdisasm, or with ``sass=False``, which saves a disassembly per
    kernel), :func:`ptx_counts` and, with ``ptxas``, registers and spills
    (:func:`paperclub.triton_compat.ptxas_usage`)."""
    ptx = compiled.asm["ptx"]
    sass = sass_text(compiled.asm["cubin"]) if sass and "cubin" in compiled.asm else None
    row = dict(fields)
    row.update(
        kernel=compiled.metadata.name,
        shared=compiled.metadata.shared,
        num_warps=compiled.metadata.num_warps,
        target_ok=".target sm_90a" in ptx,
        ptx_sha=fingerprint(normalized_ptx(ptx)),
        sass_sha=fingerprint(sass) if sass is not None else None,
        **ptx_counts(ptx),
    )
    if ptxas:
        log = getattr(compiled, "ptxas_log", "")  # compile_sm90's capture of Triton's own ptxas -v
        usage = ptxas_log_usage(log) if "Used " in log else {}
        row.update(usage if usage.get("registers") is not None else ptxas_usage(ptx))
    return row


def report_or_error(make: Callable[[], Any], *, ptxas: bool = True, sass: bool = True, **fields) -> dict:
    """:func:`compile_report` of ``make()``, or the row ``{**fields, "error": ...}`` when compiling raises:
    a compile driver reports every case and lets the caller decide."""
    try:
        return compile_report(make(), ptxas=ptxas, sass=sass, **fields)
    except Exception as exc:  # the compiler's error is the result for this case
        return {**fields, "error": f"{type(exc).__name__}: {exc}"[-3000:]}


#: Processes for :func:`offline`'s ``jobs`` where a caller wants every CPU this process may use.
CPU_JOBS = usable_cpus()


def offline(
    target: str,
    cases: Any,
    *,
    cache_dir: Path | str | None = None,
    timeout_s: float = 900,
    jobs: int = 1,
) -> list[dict]:
    """Rows of compile driver ``target`` run in a fresh process without ``TRITON_INTERPRET`` and with
    Triton's cache in ``cache_dir`` (a new temporary folder when None). ``target`` is
    ``"package.module:function"`` (a function of the JSON-able ``cases`` returning a list of dicts) or
    ``"package.module"`` (run as ``python -m package.module '<cases JSON>'``, printing the rows as JSON
    on its last line of output). Raises ``RuntimeError`` with the driver's error output when it fails.

    ``jobs`` > 1 (e.g. :data:`CPU_JOBS`), for a driver that returns one row per case, each compiled on
    its own: a list of cases is dealt round-robin to up to ``jobs`` such processes at once (sharing
    ``cache_dir``) and their rows put back in the cases' order, the same rows as one process gives
    (a compile is single-threaded: the CPU test suite's offline compiles took minutes in one)."""
    module, sep, func = target.partition(":")
    if not module or (sep and not func):
        raise ValueError(
            f"offline: target must be 'package.module:function' or 'package.module', got {target!r}"
        )
    n = min(jobs, len(cases)) if isinstance(cases, list) else 1
    if n > 1:
        from concurrent.futures import ThreadPoolExecutor

        parts = [cases[i::n] for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            done = list(
                pool.map(lambda part: offline(target, part, cache_dir=cache_dir, timeout_s=timeout_s), parts)
            )
        rows: list[dict] = [{}] * len(cases)
        for i, (part, got) in enumerate(zip(parts, done, strict=True)):
            if len(got) != len(part):
                raise RuntimeError(
                    f"offline: driver {target} returned {len(got)} rows for {len(part)} cases; jobs > 1 "
                    "needs one row per case"
                )
            rows[i::n] = got
        return rows
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(ROOT / "site"), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = (
        [sys.executable, "-m", "paperclub.lab", "compile", target] if sep else [sys.executable, "-m", module]
    )
    with tempfile.TemporaryDirectory() as tmp:
        env["TRITON_CACHE_DIR"] = str(cache_dir or tmp)
        r = subprocess.run(
            [*cmd, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT
        )
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
    if r.returncode != 0 or not lines:
        raise RuntimeError(
            f"offline compile driver {target} failed (exit {r.returncode}):\n{r.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def _run_driver(target: str, cases_json: str) -> list[dict]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)(json.loads(cases_json))


# ---------------------------------------------------------------------------------------------
# Nsight Compute
# ---------------------------------------------------------------------------------------------

#: The sections a kernel comparison needs (speed of light, launch, occupancy, pipes, scheduler, stalls, memory).
NCU_SECTIONS = (
    "SpeedOfLight",
    "LaunchStats",
    "Occupancy",
    "ComputeWorkloadAnalysis",
    "SchedulerStats",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
)
_PCT = "avg.pct_of_peak_sustained_active"
#: Pipe utilisations no section prints: tensor (and its GMMA share), XU (MUFU: exp2), FMA, ALU.
NCU_PIPE_METRICS = (
    f"sm__pipe_tensor_cycles_active.{_PCT}",
    f"sm__inst_executed_pipe_tensor_op_gmma.{_PCT}",
    f"sm__pipe_xu_cycles_active.{_PCT}",
    f"sm__pipe_fma_cycles_active.{_PCT}",
    f"sm__pipe_alu_cycles_active.{_PCT}",
    f"sm__inst_executed_pipe_xu.{_PCT}",
)


def find_ncu() -> str | None:
    """The ``ncu`` executable: on PATH, else the newest under /opt/nvidia/nsight-compute or a CUDA
    install; None when there is none."""
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in (
        "/opt/nvidia/nsight-compute/*/ncu",
        "/usr/local/cuda*/bin/ncu",
        "/usr/local/cuda*/nsight-compute*/ncu",
    ):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_command(
    target: Sequence[str],
    report: Path | str,
    *,
    ncu: str = "ncu",
    sections: Sequence[str] = NCU_SECTIONS,
    metrics: Sequence[str] = (),
    kernels: str | None = None,
    full: bool = False,
    from_start: bool = False,
) -> list[str]:
    """The ncu command line that profiles ``target`` (a command, e.g. ``["python3", "-m", "repro.fa4.lab.ncu",
    "--target"]``) into ``report`` (``.ncu-rep``): ``--profile-from-start off`` unless ``from_start``
    (the target marks its region with :func:`profile_once`), clocks not locked (``--clock-control
    none``: compare kernels in cycles), ``--set full`` or the ``sections``, extra ``metrics``, and
    ``kernels`` a regex of kernel names to profile."""
    cmd = [ncu, "--profile-from-start", "on" if from_start else "off", "--clock-control", "none"]
    if full:
        cmd += ["--set", "full"]
    else:
        for s in sections:
            cmd += ["--section", s]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    if kernels:
        cmd += ["-k", f"regex:{kernels}"]
    return [*cmd, "-f", "-o", str(Path(report).with_suffix("")), *target]


def run_ncu(
    target: Sequence[str],
    out_dir: Path | str,
    *,
    name: str = "ncu",
    timeout_s: float = 120,
    sections: Sequence[str] = NCU_SECTIONS,
    metrics: Sequence[str] = NCU_PIPE_METRICS,
    kernels: str | None = None,
    full: bool = False,
    source_kernels: Sequence[str] = (),
    ncu: str | None = None,
) -> dict:
    """Profile ``target`` with ncu (:func:`ncu_command`) and export what reading it needs, into ``out_dir``:
    ``<name>.log`` (ncu's and the target's output), ``<name>-raw.csv`` (the raw page in base units),
    ``<name>-details.csv``, and ``<name>-source-<kernel>.csv`` (per-instruction SASS) for each regex in
    ``source_kernels``. When the report comes out empty and extra ``metrics`` were asked for, it
    retries once without them (an unknown metric name fails the whole run). Returns ``{"status": ...,
    "files": [...]}``; status "no ncu" where there is none. Never raises for ncu's failures: a
    profile that did not happen is a line in the log."""
    ncu = ncu or find_ncu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.log"
    if ncu is None:
        log.write_text("ncu not found\n")
        return {"status": "no ncu", "files": [str(log)]}
    rep = Path(tempfile.mkdtemp()) / f"{name}.ncu-rep"

    def profile(with_metrics: Sequence[str]) -> int:
        cmd = ncu_command(
            target, rep, ncu=ncu, sections=sections, metrics=with_metrics, kernels=kernels, full=full
        )
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                f.write(f"ncu: timed out after {timeout_s:g} s\n")
                return 124

    log.write_text("")
    rc = profile(metrics)
    if not (rep.exists() and rep.stat().st_size) and metrics:
        with open(log, "a") as f:
            f.write("retrying without the extra metrics\n")
        rc = profile(())
    files = [str(log)]
    if not (rep.exists() and rep.stat().st_size):
        return {"status": f"no report (ncu exit {rc})", "files": files}

    def export(dest: Path, *args: str) -> bool:
        r = subprocess.run(
            [ncu, "--import", str(rep), "--csv", *args], capture_output=True, text=True, timeout=60
        )
        if r.returncode == 0 and r.stdout.strip():
            dest.write_text(r.stdout)
            files.append(str(dest))
            return True
        return False

    raw = out / f"{name}-raw.csv"
    export(raw, "--print-units", "base", "--page", "raw") or export(raw, "--page", "raw")
    export(out / f"{name}-details.csv", "--page", "details")
    for k in source_kernels:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", k)
        export(
            out / f"{name}-source-{safe}.csv",
            "--page",
            "source",
            "--print-source",
            "sass",
            "-k",
            f"regex:{k}",
        )
    return {"status": f"ok (ncu exit {rc})", "files": files}


def profile_once(fn: Callable[[], object], *, warmup: int = 3) -> None:
    """``warmup`` untimed calls of ``fn`` (compile, autotune, caches), then one call between
    ``cudaProfilerStart`` and ``cudaProfilerStop``: what ``ncu --profile-from-start off`` profiles."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


#: What the ncu summary prints: a label and the raw-page metric names to try, first found wins.
NCU_SUMMARY: dict[str, tuple[str, ...]] = {
    "duration (us)": ("gpu__time_duration.sum",),
    "registers/thread": ("launch__registers_per_thread",),
    "dyn. shared mem/block (B)": ("launch__shared_mem_per_block_dynamic",),
    "achieved occupancy %": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "tensor pipe %": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",),
    "tensor GMMA inst. %": ("sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",),
    "XU (MUFU, exp2) pipe %": (
        "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    ),
    "FMA pipe %": (
        "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    ),
    "ALU pipe %": ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",),
    "issue slots busy %": (
        "sm__inst_issued.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
    ),
    "SM throughput %": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "DRAM throughput %": (
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",  # the name ncu 2025 prints
    ),
    # Clocks are not locked under --clock-control none: compare kernels in cycles, not microseconds.
    "SM cycles active": ("sm__cycles_active.avg",),
}

#: ncu's time units (it scales them per metric unless told --print-units base) in microseconds.
TIME_UNITS_IN_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def _units(rows: list[list[str]], header: list[str], column: str) -> str:
    if len(rows) > 1 and column in header and not rows[1][0].strip().isdigit():
        return rows[1][header.index(column)]
    return ""


def ncu_summary(csv_text: str, top_stalls: int = 4) -> list[dict]:
    """ncu's ``--csv --page raw`` output reduced to the metrics of :data:`NCU_SUMMARY`, one dict per kernel.

    Each dict has ``kernel`` (the name, cut to 60 characters), the NCU_SUMMARY labels (None where the
    report lacks every candidate metric; durations converted to microseconds by the units row) and
    ``stalls``: the ``top_stalls`` largest ``smsp__average_warps_issue_stalled_*_per_issue_active.ratio``
    values as "reason ratio" strings (``selected``, the issuing warp itself, left out). Lines that ncu
    prefixes with ``==`` and the units row are skipped."""
    lines = [ln for ln in csv_text.splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header, out = rows[0], []
    for r in rows[1:]:
        rec = dict(zip(header, r, strict=False))
        if not rec.get("ID", "").strip().isdigit():  # the units row
            continue
        item: dict = {"kernel": rec.get("Kernel Name", "?")[:60]}
        for label, names in NCU_SUMMARY.items():
            item[label] = next((_number(rec[n]) for n in names if rec.get(n, "") != ""), None)
        if isinstance(item["duration (us)"], float):
            unit = _units(rows, header, "gpu__time_duration.sum")
            item["duration (us)"] *= TIME_UNITS_IN_US.get(unit, float("nan"))
        stalls = []
        for name, val in rec.items():
            if name.startswith("smsp__average_warps_issue_stalled_") and name.endswith(
                "_per_issue_active.ratio"
            ):
                v = _number(val)
                reason = name.removeprefix("smsp__average_warps_issue_stalled_").removesuffix(
                    "_per_issue_active.ratio"
                )
                # "selected" is the warp that issued (always 1 per issue), not a stall.
                if isinstance(v, float) and reason != "selected":
                    stalls.append((v, reason))
        item["stalls"] = [f"{reason} {v:.2f}" for v, reason in sorted(stalls, reverse=True)[:top_stalls]]
        out.append(item)
    return out


def print_ncu_summary(csv_text: str) -> None:
    """The ncu summary as a markdown table, one row per profiled kernel."""
    from paperclub.bench import markdown_table

    items = ncu_summary(csv_text)
    if not items:
        print("ncu summary: no kernels in the report")
        return
    print(markdown_table(list(items[0]), [{**i, "stalls": "; ".join(i["stalls"])} for i in items]))


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paperclub.lab", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="run an offline compile driver, print its rows as JSON")
    c.add_argument("target", help="package.module:function")
    c.add_argument("cases", help="the cases as JSON")
    s = sub.add_parser("ncu-summary", help="summarise ncu's raw page (CSV)")
    s.add_argument("csv", type=Path)
    n = sub.add_parser(
        "ncu", help="profile a command with ncu: python -m paperclub.lab ncu --out DIR -- CMD ..."
    )
    n.add_argument("--out", type=Path, required=True)
    n.add_argument("--name", default="ncu")
    n.add_argument("--timeout-s", type=float, default=120)
    n.add_argument("--kernels", default=None, help="regex of the kernels to profile")
    n.add_argument("--full", action="store_true", help="--set full instead of the sections")
    n.add_argument("--no-metrics", action="store_true", help="without NCU_PIPE_METRICS")
    n.add_argument(
        "--source", action="append", default=[], metavar="REGEX", help="export this kernel's SASS view"
    )
    n.add_argument("target", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.cmd == "compile":
        print(json.dumps(_run_driver(args.target, args.cases), default=str))
    elif args.cmd == "ncu-summary":
        print_ncu_summary(args.csv.read_text(encoding="utf-8", errors="replace"))
    else:
        target = args.target[1:] if args.target[:1] == ["--"] else args.target
        if not target:
            ap.error("ncu: give the command to profile after --")
        res = run_ncu(target, args.out, name=args.name, timeout_s=args.timeout_s, kernels=args.kernels,
                      full=args.full, metrics=() if args.no_metrics else NCU_PIPE_METRICS,
                      source_kernels=args.source)  # fmt: skip
        print(json.dumps(res))
        raw = args.out / f"{args.name}-raw.csv"
        if raw.exists():
            print_ncu_summary(raw.read_text(encoding="utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
