"""``python -m repro.kda.lab.ptx_snapshot OUT.json [--only CASE] [--ptxas] [--compare BEFORE.json]``:
what every Triton launch of chunk_kda (forward and backward) and decode_step compiles to for sm_90a,
at representative shapes, dtypes and configs (:data:`CASES`), recorded without a GPU.

Why: to show that a change that should not change the kernels (a refactor, a move between files)
leaves the compiled code as it was. No kernel runs: ``JITFunction.run`` is replaced by a recorder,
the public entry points run on CPU tensors (their outputs are never read: garbage in, nothing
checked), and each recorded launch is then bound by Triton's own binder (the same signature,
specialisation, constexprs and options as that launch on the GPU) and compiled offline by
``paperclub.lab.compile_sm90``. Each row: case, launch index, kernel, constexprs, num_warps, num_stages, the shared memory
Triton asks for at launch (``shared``, bytes; more than an H100's or H200's 232,448 per block fails
there with OutOfResources), and fingerprints (16 hex digits of SHA-256):

* ``ptx_body_sha``: the PTX without debug information (``paperclub.lab.normalized_ptx``: the
  ``.loc``/``.file`` lines and ``.debug_*`` sections name source files and lines) and with its
  parameters named by argument (``<kernel>_param_<name>``: dropping an unused argument renumbers
  the others) and their declarations apart (``params``), so a dropped unused argument shows as that;
* ``ttgir_sha``: Triton's GPU IR body without locations and signature (SSA values are named after the
  source's variables; anonymous ones renumbered): the code LLVM receives;
* ``opcodes_sha``: how many of each PTX instruction, in any order;
* with ``--ptxas``, ``paperclub.lab.compile_report``'s shared memory, registers, spills and
  ``sass_sha`` (the SASS nvdisasm prints from the cubin), and ``sass_sha_slots``, the same with the
  offsets of local-memory accesses masked: for a kernel that spills heavily, ptxas assigns spill
  slots differently from one compile of the same PTX to the next (seen for the state backward with
  tf32x3 products, fp16: two 8-byte slots swapped), which is not a change of the code; and
  ``sass_ops_sha``, how many of each SASS instruction, in any order.

``--state-sweep`` compiles only the two state kernels (forward recurrence and its backward) of the
benchmark's shape at head size 256 (:data:`STATE_SWEEP_SHAPE`) for each launch of
:data:`STATE_SWEEP` (the one-tile kernels at their defaults, the key-split kernels of issue #42 at
each key block, value block, warps and stages) and prints their registers, spills and shared memory:
which candidates are worth a GPU's time (lab/tuning.py STATE_CANDIDATES).

``--compare BEFORE.json`` prints, launch by launch, whether the PTX body is identical (else whether
the GPU IR body and the instruction counts are), and what differs in the constexprs, the declared
parameters and ptxas's numbers; its exit status is 1 if any GPU IR body differs. The snapshot of
main's code before issue #40 is ``ptx_main_2026-11-27.json`` beside this file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU: JITFunction, not the interpreter

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from paperclub.lab import (  # noqa: E402
    compile_report,
    compile_sm90,
    fingerprint,
    normalized_ptx,
    sass_text,
    sm90_target,
)

BACKEND = make_backend(sm90_target())
_launches: list[tuple] = []


def _record(self, *args, grid, warmup, **kwargs):
    _launches.append((self, args, dict(kwargs)))


def _compile(fn, args, kwargs):
    """Triton's own launch-time binding (JITFunction.run), then the offline sm_90a compile."""
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        BACKEND, kwargs, bound_args, specialization, options
    )
    kernel = compile_sm90(
        fn,
        constexprs=constexprs,
        signature=signature,
        attrs=attrs,
        num_warps=options.num_warps,
        num_stages=options.num_stages,
        options=options.__dict__,
    )
    named = {fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    runtime = [name for name, kind in signature.items() if kind != "constexpr"]
    return kernel, named, runtime, options


def _normalise(ptx: str, name: str, runtime: list[str]) -> tuple[str, list[str]]:
    """PTX without debug information, parameters named by argument; and the declared parameters."""
    out = []
    for line in normalized_ptx(ptx).splitlines():
        if line.strip().startswith(("$L__func_end", "$L__tmp")):  # labels only the debug info used
            continue
        out.append(line)
    text = "\n".join(out)
    # Triton appends its scratch pointers after the kernel's own arguments
    names = runtime + [f"scratch{i}" for i in range(8)]
    text = re.sub(rf"{name}_param_(\d+)", lambda m: f"{name}_param_{names[int(m.group(1))]}", text)
    declared = re.findall(rf"\.param [^\n]*?{name}_param_(\w+)", text)
    body = "\n".join(line for line in text.splitlines() if ".param " not in line or "ld.param" in line)
    return body, declared


def _normalise_ttgir(ttgir: str) -> str:
    """Triton's GPU IR without source locations and without the kernel's signature line: the ops
    of the body, their SSA values named after the source's variables and arguments, anonymous ones
    renumbered (so a removed unused argument changes the signature only, and a line moved to
    another file nothing)."""
    out = []
    for line in ttgir.splitlines():
        s = line.strip()
        if s.startswith("#loc") or s.startswith("tt.func public"):
            continue
        out.append(re.sub(r" loc\((?:[^()]|\([^()]*\))*\)", "", line))
    text = "\n".join(out)
    # anonymous values (loop-carried) are numbered after the arguments: renumber them in order of
    # first appearance
    order: dict[str, str] = {}
    return re.sub(r"%arg\d+\b", lambda m: order.setdefault(m.group(0), f"%arg_{len(order)}"), text)


def _opcode_counts(body: str) -> str:
    """How many of each PTX instruction the body holds, in any order (a digest of it)."""
    counts: dict[str, int] = {}
    for line in body.splitlines():
        s = line.strip()
        if s and not s.startswith((".", "//", "$", "{", "}", ")")):
            counts[s.split()[0]] = counts.get(s.split()[0], 0) + 1
    return fingerprint(json.dumps(sorted(counts.items())))


def _value(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


@contextlib.contextmanager
def _config(changes: dict):
    """Yields the keyword arguments that run the entry points with ``changes`` to the defaults:
    ``config=KDAConfig(**changes)`` where repro.kda has a config object, else the module settings
    of repro.kda.chunk (the code before the config object) set for the block."""
    kda = importlib.import_module("repro.kda")
    if hasattr(kda, "KDAConfig"):
        yield {"config": kda.KDAConfig(**changes)} if changes else {}
        return
    ck = importlib.import_module("repro.kda.chunk")
    old = {
        "dot_prec_fp16": "DOT_PREC_FP16",
        "state_bwd_bv": "STATE_BWD_BV",
        "check_decay_range": "CHECK_DECAY_RANGE",
    }
    with ck.changed_settings({old[n]: v for n, v in changes.items()}):
        yield {}


def _inputs(B, T, H, HV, K, V, dtype, h0):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=g).to(dtype)
    k = torch.randn(B, T, H, K, generator=g).to(dtype)
    v = torch.randn(B, T, HV, V, generator=g).to(dtype)
    gg = -torch.rand(B, T, HV, K, generator=g)
    beta = torch.rand(B, T, HV, generator=g)
    s0 = torch.randn(B, HV, K, V, generator=g) if h0 else None
    return [x.requires_grad_(True) for x in (q, k, v, gg, beta)], s0


# (name, B, T, H, HV, K, V, dtype, initial state and final state, cu_seqlens, config changes)
CASES = [
    # the benchmark's shape: state value blocks 64 (256 programs)
    ("bench-bf16", 8, 2048, 16, 16, 128, 128, torch.bfloat16, False, None, {}),
    # B = 1, 16 heads at T = 4096: value blocks 16 (the state backward at 4 warps), states in and out
    ("b1-bf16-states", 1, 4096, 16, 16, 128, 128, torch.bfloat16, True, None, {}),
    # 32 heads: value blocks 32; T off the chunk size
    ("b2-bf16-T1000", 2, 1000, 16, 16, 128, 128, torch.bfloat16, True, None, {}),
    # fla's mild fp16 case (tf32x3 products)
    ("fla-mild-fp16", 2, 1500, 4, 4, 128, 128, torch.float16, True, None, {}),
    # fp32 (ieee products), fla's head size 60 padded to 64
    ("fp32-D60", 2, 500, 3, 3, 60, 60, torch.float32, True, None, {}),
    # one head (H = 1 is specialised by Triton), fp16
    ("h1-fp16", 1, 300, 1, 1, 128, 128, torch.float16, True, None, {}),
    # more value heads than key heads, small heads
    ("bf16-D64", 4, 2048, 8, 8, 64, 64, torch.bfloat16, True, None, {}),
    ("gqa-bf16-D32", 2, 200, 2, 4, 32, 32, torch.bfloat16, True, None, {}),
    ("bf16-D16", 1, 80, 2, 2, 16, 16, torch.bfloat16, False, None, {}),
    # packed sequences (chunk-aligned, state kernels per sequence)
    ("varlen-bf16", 1, 1000, 2, 2, 128, 128, torch.bfloat16, True, [0, 256, 500, 1000], {}),
    # configs the GPU tests run besides the defaults
    ("fp16-ieee", 2, 1500, 4, 4, 128, 128, torch.float16, True, None, {"dot_prec_fp16": "ieee"}),
    ("fp16-state-bv128", 2, 1500, 4, 4, 128, 128, torch.float16, True, None, {"state_bwd_bv": 128}),
    ("bf16-no-decay-check", 2, 300, 2, 2, 64, 64, torch.bfloat16, False, None, {"check_decay_range": False}),
    # head size 256 (issue #42): configurations added after main's snapshot
    ("d256-bf16", 2, 1000, 4, 4, 256, 256, torch.bfloat16, True, None, {}),
    ("d256-fp16", 2, 1000, 4, 4, 256, 256, torch.float16, True, None, {}),
    ("d256-fp32", 1, 200, 2, 2, 256, 256, torch.float32, True, None, {}),
    ("d256-b1-bf16", 1, 4096, 16, 16, 256, 256, torch.bfloat16, False, None, {}),
    ("d256-bench-bf16", 8, 2048, 16, 16, 256, 256, torch.bfloat16, False, None, {}),
    (
        "d256-varlen-fp16",
        1,
        4096,
        4,
        4,
        256,
        256,
        torch.float16,
        True,
        [0, 100, 300, 1200, 3000, 4096],
        {},
    ),
]
# --state-sweep (issue #42): the benchmark's shape at K = V = 256 (B=8, T=2048, H=16, bf16), and the
# launches of the state kernels to compile there, as KDAConfig changes: the defaults (one-tile
# kernels), then the key-split kernels at key blocks of 64 and 128 (4 and 2 tiles) over value
# blocks, warps and pipeline stages. Value block 16 at 8 warps is left out for the backward
# (backward_inter_chunk.STATE_BWD_WARPS_BV16 takes 4 there, whatever the config says).
STATE_SWEEP_SHAPE = ("d256-bench-bf16", 8, 2048, 16, 16, 256, 256, torch.bfloat16, False, None)
STATE_SWEEP = {"defaults": {}}
for _bk in (64, 128):
    for _bv in (16, 32, 64):
        for _warps in (4, 8):
            for _stages in (1, 2, 3):
                _tag = f"k{_bk}-v{_bv}-w{_warps}-s{_stages}"
                STATE_SWEEP[f"fwd-{_tag}"] = dict(
                    state_fwd_bk=_bk, state_fwd_bv=_bv, state_fwd_warps=_warps, state_fwd_stages=_stages
                )
                if _bv > 16 or _warps == 4:
                    STATE_SWEEP[f"bwd-{_tag}"] = dict(
                        state_bwd_bk=_bk, state_bwd_bv=_bv, state_bwd_warps=_warps, state_bwd_stages=_stages
                    )
DECODE_CASES = [
    ("decode-bf16", 2, 4, 8, 128, 128, torch.bfloat16),
    ("decode-fp32-D64", 1, 2, 2, 64, 64, torch.float32),
]


def record(case) -> list[tuple]:
    """The launches of one forward + backward of chunk_kda at ``case``."""
    kda = importlib.import_module("repro.kda")
    name, B, T, H, HV, K, V, dtype, states, cu, changes = case
    (q, k, v, g, beta), s0 = _inputs(B if cu is None else len(cu) - 1, T, H, HV, K, V, dtype, states)
    if cu is not None:
        q, k, v, g, beta = (x[:1].detach().requires_grad_(True) for x in (q, k, v, g, beta))
    _launches.clear()
    with _config(changes) as extra:
        kw = dict(initial_state=s0, output_final_state=states, **extra)
        if cu is not None:
            kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
        o, hT = kda.chunk_kda(q, k, v, g, beta, **kw)
        outs = [o] + ([hT] if states else [])
        torch.autograd.grad(outs, [q, k, v, g, beta], [torch.ones_like(x) for x in outs], allow_unused=True)
    return list(_launches)


def record_decode(case) -> list[tuple]:
    kda = importlib.import_module("repro.kda")
    name, B, H, HV, K, V, dtype = case
    (q, k, v, g, beta), _ = _inputs(B, 1, H, HV, K, V, dtype, False)
    state = torch.zeros(B, HV, K, V)
    _launches.clear()
    with torch.no_grad():
        kda.decode_step(q, k, v, g, beta, state)
    return list(_launches)


def snapshot(
    only: str = "", ptx_dir: str | None = None, ptxas: bool = False, cases=None, kernels: str = ""
) -> list[dict]:
    """The rows of every launch of ``cases`` (default CASES and DECODE_CASES) whose case name
    contains ``only`` and whose kernel name contains ``kernels``."""
    JITFunction.run = _record
    # the entry points refuse CPU tensors outside the interpreter; here nothing runs on them
    for name in ("chunk", "decode"):
        module = importlib.import_module(f"repro.kda.{name}")
        if hasattr(module, "check_kernel_device"):
            module.check_kernel_device = lambda *args: None
    rows, cache = [], {}
    todo = [(c[0], lambda c=c: record(c)) for c in CASES] + [
        (c[0], lambda c=c: record_decode(c)) for c in DECODE_CASES
    ]
    if cases is not None:
        todo = [(c[0], lambda c=c: record(c)) for c in cases]
    for case_name, fn in todo:
        if only and only not in case_name:
            continue
        for i, (kernel, args, kwargs) in enumerate(fn()):
            if kernels not in kernel.__name__:
                continue
            t0 = time.perf_counter()
            compiled, constexprs, runtime, options = _compile(kernel, args, kwargs)
            key = (kernel.__name__, compiled.hash)
            if key not in cache:
                body, declared = _normalise(compiled.asm["ptx"], kernel.__name__, runtime)
                ttgir = _normalise_ttgir(compiled.asm["ttgir"])
                digests = [fingerprint(x) for x in (body, ttgir)]
                usage = {}
                if ptxas:  # shared memory, ptxas's registers and spills, the SASS fingerprint
                    rep = compile_report(compiled)
                    usage = {
                        n: rep[n] for n in ("shared", "registers", "spill_stores", "spill_loads", "sass_sha")
                    }
                    sass = sass_text(compiled.asm["cubin"])
                    if sass is not None:  # the same SASS but for which stack slot each spill uses
                        masked = re.sub(r"\[R1(\+0x[0-9a-f]+)?\]", "[R1+*]", sass)
                        usage["sass_sha_slots"] = fingerprint(masked)
                        ops = sorted(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_.]+)", sass, re.M))
                        usage["sass_ops_sha"] = fingerprint(" ".join(ops))
                cache[key] = (*digests, _opcode_counts(body), declared, usage)
                if ptx_dir:  # the normalised PTX and GPU IR, to diff where a hash differs
                    os.makedirs(ptx_dir, exist_ok=True)
                    for text, ext in ((body, "ptx"), (ttgir, "ttgir")):
                        with open(os.path.join(ptx_dir, f"{kernel.__name__}-{digests[0]}.{ext}"), "w") as f:
                            f.write(text)
            digest, ir_digest, opcodes, declared, usage = cache[key]
            rows.append({
                "case": case_name, "launch": i, "kernel": kernel.__name__,
                "constexprs": {n: _value(v) for n, v in sorted(constexprs.items())},
                "num_warps": options.num_warps, "num_stages": options.num_stages,
                "shared": compiled.metadata.shared,
                "params": declared, "ptx_body_sha": digest, "ttgir_sha": ir_digest,
                "opcodes_sha": opcodes, **({"usage": usage} if usage else {}),
            })  # fmt: skip
            print(
                f"{case_name:18s} {i} {kernel.__name__:34s} {digest} ({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
    return rows


def state_sweep(ptx_dir: str | None = None) -> list[dict]:
    """--state-sweep: the state kernels' rows (with ptxas's numbers) for each launch of STATE_SWEEP,
    each row's ``case`` the sweep's name, and a table of them printed."""
    name, *shape = STATE_SWEEP_SHAPE
    cases = [(f"{name}/{tag}", *shape, change) for tag, change in STATE_SWEEP.items()]
    rows = snapshot(ptx_dir=ptx_dir, ptxas=True, cases=cases, kernels="kda_state_")
    # the defaults' row of each kernel, and each kernel only in the sweeps that change it
    keep = [
        r for r in rows
        if r["case"].endswith("/defaults")
        or ("_fwd_split" in r["kernel"] and "/fwd-" in r["case"])
        or ("_bwd_split" in r["kernel"] and "/bwd-" in r["case"])
    ]  # fmt: skip
    print(f"\n{'launch':22s} {'kernel':27s} {'BK':>4s} {'BV':>3s} {'warps':>5s} {'stages':>6s} "
          f"{'regs':>4s} {'spill st/ld (B)':>15s} {'shared (KiB)':>12s}")  # fmt: skip
    for r in keep:
        c, u = r["constexprs"], r.get("usage", {})
        spills = f"{u.get('spill_stores')}/{u.get('spill_loads')}"
        stages = c.get("STAGES", "-")
        print(f"{r['case'].split('/')[1]:22s} {r['kernel']:27s} {c.get('BK', c['K']):>4} {c['BV']:>3} "
              f"{r['num_warps']:>5} {stages:>6} {u.get('registers')!s:>4} {spills:>15s} "
              f"{r['shared'] / 1024:>12.1f}")  # fmt: skip
    return keep


def compare(before: list[dict], after: list[dict]) -> int:
    """Launch by launch: same kernel, same PTX body (else: same GPU IR body?); constexpr and
    parameter differences listed. Non-zero if a GPU IR body differs."""
    key = lambda r: (r["case"], r["launch"])  # noqa: E731
    old = {key(r): r for r in before}
    new = {key(r): r for r in after}
    differing = ir_differing = 0
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a is None or b is None:
            differing += 1
            print(f"{k}: only {'after' if a is None else 'before'}: {(a or b)['kernel']}")
            continue
        notes = []
        if a["kernel"] != b["kernel"]:
            notes.append(f"kernel {a['kernel']} -> {b['kernel']}")
        if (a["num_warps"], a["num_stages"]) != (b["num_warps"], b["num_stages"]):
            notes.append(
                f"warps/stages {a['num_warps']}/{a['num_stages']} -> {b['num_warps']}/{b['num_stages']}"
            )
        gone = {n: v for n, v in a["constexprs"].items() if n not in b["constexprs"]}
        changed = {
            n: (v, b["constexprs"][n])
            for n, v in a["constexprs"].items()
            if n in b["constexprs"] and b["constexprs"][n] != v
        }
        added = {n: v for n, v in b["constexprs"].items() if n not in a["constexprs"]}
        if gone or changed or added:
            notes.append(f"constexprs removed {gone} changed {changed} added {added}")
        ua, ub = a.get("usage") or {}, b.get("usage") or {}
        moved = {n: (ua[n], ub[n]) for n in ua if n in ub and not n.startswith("sass") and ua[n] != ub[n]}
        if moved:
            notes.append(f"ptxas/shared (before, after) {moved}")
        if ua.get("sass_sha") and ub.get("sass_sha"):
            if ua["sass_sha"] == ub["sass_sha"]:
                notes.append("SASS identical")
            elif ua.get("sass_sha_slots") and ua.get("sass_sha_slots") == ub.get("sass_sha_slots"):
                notes.append("SASS identical but for the stack slots of spills")
            elif ua.get("sass_ops_sha") and ua.get("sass_ops_sha") == ub.get("sass_ops_sha"):
                notes.append("SASS: the same instructions in another order or registers")
            else:
                notes.append("SASS differs")
        if a["params"] != b["params"]:
            notes.append(
                f"parameters removed {sorted(set(a['params']) - set(b['params']))} added {sorted(set(b['params']) - set(a['params']))}"
            )
        same, same_ir = a["ptx_body_sha"] == b["ptx_body_sha"], a["ttgir_sha"] == b["ttgir_sha"]
        differing += not same
        ir_differing += not same_ir
        same_ops = a["opcodes_sha"] == b["opcodes_sha"]
        verdict = "PTX identical"
        if not same:
            verdict = "PTX differs: " + (
                "same instructions in another order" if same_ops else "OTHER INSTRUCTIONS"
            )
            verdict += ", GPU IR body " + ("identical" if same_ir else "DIFFERS")
        print(f"{k[0]:19s} {k[1]} {b['kernel']:31s} {verdict}" + (f"; {'; '.join(notes)}" if notes else ""))
    print(f"{len(new)} launches: {differing} with another PTX body, {ir_differing} with another GPU IR body")
    return 1 if ir_differing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file for the rows")
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--ptx-dir", default=None, help="write each normalised PTX here as <kernel>-<hash>.ptx")
    ap.add_argument("--ptxas", action="store_true", help="also record registers, spills, shared memory")
    ap.add_argument("--compare", default=None, help="a snapshot taken before: report launch by launch")
    ap.add_argument(
        "--state-sweep", action="store_true", help="only the state kernels at K = V = 256 over STATE_SWEEP"
    )
    args = ap.parse_args(argv)
    if args.state_sweep:
        rows = state_sweep(args.ptx_dir)
    else:
        rows = snapshot(args.only, args.ptx_dir, args.ptxas)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            return compare(json.load(f), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
