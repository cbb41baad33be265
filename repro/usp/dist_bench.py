"""USP on several GPUs: ``python3 -m torch.distributed.run --nproc-per-node G -m repro.usp.dist_bench --mode M``.

Modes (comma-separated, run in order in one process; one failing mode is logged and the next runs):

* ``selfcheck``: outputs and gradients of every factorisation, layout and mask against one-device
  attention (:func:`repro.usp.selfcheck.run_checks`), bf16 and fp32.
* ``timeline``: one forward + backward per configuration under torch.profiler on every rank
  (:mod:`repro.usp.timeline`): the traces, a summary (busy time per kind, communication left exposed)
  and the square-wave picture.
* ``sweep``: weak and strong scaling and every (ulysses, ring) split. The G ranks run 1-GPU
  replicas (each rank alone), 2-GPU replicas (rank pairs) and the whole world at once, so one process
  measures 1, 2 and G GPUs in interleaved rounds; blocks of S per GPU = 16k, the strong-scaling
  length (128k total), 64k and 32k, causal and not; zigzag against contiguous; local kernels.
* ``peers``: torch's context parallel (load balancing on for causal, off otherwise) and yunchang
  (forward only: its PyTorch attention types have no backward) at the same shapes, interleaved with ours.
* ``dpsp``: a global batch of G sequences: data parallel (each GPU one sequence) against sequence
  parallel (every split) and the hybrid.
* ``comm``: bytes per rank of one forward and backward, MHA against GQA: counted by our layer,
  the paper's formulas, NCCL's own record of the calls (NCCL_DEBUG=INFO log, read by ``comm-report``
  after the run) and the NVLink counters.

Every rank runs the same configurations and the same number of calls: repeat counts come from the
slowest rank's first call (an all-reduce), and the budget decisions from rank 0 (a broadcast), so no
collective is left unpaired. Each configuration is checked (output and gradients against one-device
attention computed shard by shard, :func:`repro.usp.dist_harness.shard_reference`) before it is timed; a
failed check is recorded and not timed. Results: paperclub.bench Report JSON in ``--out``, written after
every block. The world, inputs, references, candidates and the timed block are
:mod:`repro.usp.dist_harness`, which the peers and comm modes (:mod:`repro.usp.peers`,
:mod:`repro.usp.traffic`) share.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from paperclub.bench import Budget, Report, bench_parser, parse_bench_args
from repro.usp import shard, usp_attention
from repro.usp.dist_harness import (
    PACKAGES,
    Ctx,
    _env,
    _free,
    _grad,
    _ref_cache,
    _report,
    _say,
    _write,
    attention_flops,
    init,
    lazy,
    make_inputs,
    run_block,
    sdpa_entry,
    splits,
    usp_entry,
)
from repro.usp.peers import mode_peers
from repro.usp.traffic import comm_report, mode_comm

# --------------------------------------------------------------------------------------- modes


def _blocks(ctx: Ctx, args) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """(name, [(gpus, S)], first) in priority order: the first two lengths per GPU at 1, 2, 4 GPUs,
    then strong scaling at one S, then the other lengths per GPU (points already measured skipped)."""
    world = ctx.world
    ps = [p for p in (1, 2, 4, 8) if p <= world and world % p == 0]
    s_list = args.s_per_gpu or ([1024, 2048] if ctx.smoke else [16384, 65536, 32768])
    strong = args.strong or (4096 if ctx.smoke else 131072)
    seen: set = set()
    blocks = []

    def add(name, pts, first):
        pts = [pt for pt in pts if pt not in seen and pt[1] % (2 * pt[0]) == 0]
        seen.update(pts)
        if pts:
            blocks.append((name, pts, first))

    add(f"S/GPU = {s_list[0]}", [(p, s_list[0] * p) for p in ps], True)
    for s in s_list[1:2]:
        add(f"S/GPU = {s}", [(p, s * p) for p in ps], False)
    add(f"strong S = {strong}", [(p, strong) for p in ps], False)
    for s in s_list[2:]:
        add(f"S/GPU = {s}", [(p, s * p) for p in ps], False)
    return blocks


def mode_sweep(ctx: Ctx, args) -> None:
    """Weak scaling (S per GPU fixed, 1 -> 2 -> G GPUs), strong scaling (S fixed), every split."""
    report = _report(
        ctx,
        "sweep",
        notes=(
            f"bf16, B = 1, H = {ctx.H}, H_kv = {ctx.H_kv}, D = {ctx.D}, fwd+bwd. All GPUs of the machine run at "
            "once: gpus = 1 rows are one-GPU replicas on every GPU, gpus = 2 rows pairs of GPUs (each pair "
            "its own sequence), so every row is measured with the machine equally busy. ms: the slowest "
            "rank, median over interleaved rounds within a block (the rows of one S per GPU and one mask, "
            "or of the strong-scaling S). tflops_per_gpu: useful attention FLOPs (4 B S^2 H D forward, "
            "x3.5 with the backward, /2 causal) per GPU. Every row was checked (output and gradients "
            "against one-device SDPA, shard by shard; err = worst relative error) before it was timed. "
            "usp n=1 is usp_attention without groups (one local attention call)."
        ),
    )
    for name, pts, first in _blocks(ctx, args):
        for causal in (True, False):
            est = (
                sum(attention_flops(1, S, ctx.H, ctx.D, causal, "fwd+bwd") / p for p, S in pts) * 14 / 300e12
            )
            left = ctx.left()
            if left < est:
                _say(ctx, f"[sweep] skip {name} causal={causal}: estimated {est:.0f} s, {left:.0f} s left")
                continue
            _say(ctx, f"[sweep] {name} causal={causal} (estimated {est:.0f} s, {left:.0f} s left)")
            specs, keep = [], []
            for p, S in pts:
                full = make_inputs(ctx, 1, S)
                ref_for = _ref_cache(ctx, full, p, causal)
                keep.append(full)
                if p == 1:
                    specs.append(lazy(lambda full=full, ref_for=ref_for, causal=causal: sdpa_entry(
                        ctx, full, ref_for("contiguous"), causal=causal), impl="full sdpa", gpus=1, S=S))  # fmt: skip
                    for be in ["auto", "sdpa", "fa4_gluon"] if (first and ctx.cuda) else ["auto"]:
                        impl = "usp n=1" + ("" if be == "auto" else f" ({be})")
                        specs.append(lazy(lambda full=full, ref_for=ref_for, be=be, impl=impl, causal=causal: usp_entry(
                            ctx, full, ref_for("zigzag"), P=1, pu=1, pr=1, layout="zigzag", causal=causal,
                            backend=be, impl=impl), impl=impl, gpus=1, S=S))  # fmt: skip
                    continue
                for pu, pr in splits(ctx, p):
                    variants = [("zigzag", 1, "auto")]
                    if first and causal and pr > 1:
                        variants.append(("contiguous", 1, "auto"))
                    if first and pr == 1 and _groups_for(ctx, 2, pu) > 1:
                        variants.append(("zigzag", 2, "auto"))
                    if first and pu > 1 and pr > 1 and ctx.cuda:
                        variants.append(("zigzag", 1, "sdpa"))
                    for layout, hg, be in variants:
                        specs.append(lazy(lambda full=full, ref_for=ref_for, p=p, pu=pu, pr=pr, layout=layout, hg=hg, be=be, causal=causal: usp_entry(
                            ctx, full, ref_for(layout), P=p, pu=pu, pr=pr, layout=layout, causal=causal,
                            backend=be, head_groups=hg), impl=f"usp {pu}x{pr}", gpus=p, S=S))  # fmt: skip
            run_block(ctx, report, specs, causal=causal, base=dict(H=ctx.H, H_kv=ctx.H_kv, D=ctx.D),
                      target_s=0.05 if ctx.smoke else 0.3)  # fmt: skip
            del specs, keep
            _free(ctx)
            _write(ctx, report, "sweep")


def _groups_for(ctx: Ctx, requested: int, pu: int) -> int:
    """The head groups the Ulysses pipeline would use (:func:`repro.usp.ulysses.head_groups_for`)."""
    from repro.usp.ulysses import head_groups_for
    from repro.usp.usp import kv_heads_after_replication

    return head_groups_for(requested, kv_heads_after_replication(ctx.H_kv, pu), pu)


# --------------------------------------------------------------------------------------- selfcheck, timeline


def mode_selfcheck(ctx: Ctx, args) -> None:
    """Every factorisation, layout and mask against one-device attention, bf16 and fp32 (small S)."""
    from repro.usp.selfcheck import run_checks

    lines, failed = [], 0
    for dtype, hg in ((torch.bfloat16, 1), (torch.bfloat16, 2), (torch.float32, 1)):
        if dtype == torch.float32 and ctx.cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
        rows, f = run_checks(
            dtype=dtype,
            seq=64 * ctx.world,
            backend="auto",
            device=ctx.device,
            head_groups=hg,
            groups=ctx.groups,
        )
        lines += [f"{str(dtype)[6:]:9s} hg{hg} {r}" for r in rows]
        failed += f
    if ctx.rank == 0:
        ctx.out.mkdir(parents=True, exist_ok=True)
        text = (
            f"USP selfcheck, world {ctx.world}, backend auto\n" + "\n".join(lines) + f"\nfailed: {failed}\n"
        )
        (ctx.out / f"selfcheck-{ctx.world}gpu.txt").write_text(text)
        print(text, flush=True)


def _timeline_configs(ctx: Ctx) -> list[dict]:
    """What the timeline profiles: the hybrid causal and not (both kinds of traffic), the ring, Ulysses
    with and without the head-group pipeline, and the hybrid with the old local kernel (flash)."""
    w = ctx.world
    pu = 2 if w >= 4 else 1
    cfgs = [
        dict(pu=pu, pr=w // pu, causal=True, head_groups=1, backend="auto"),
        dict(pu=pu, pr=w // pu, causal=False, head_groups=1, backend="auto"),
        dict(pu=1, pr=w, causal=True, head_groups=1, backend="auto"),
        dict(pu=w, pr=1, causal=True, head_groups=1, backend="auto"),
        dict(pu=w, pr=1, causal=True, head_groups=2, backend="auto"),
    ]
    if ctx.cuda:
        cfgs.append(dict(pu=pu, pr=w // pu, causal=True, head_groups=1, backend="sdpa"))
    seen, out = set(), []
    for c in cfgs:
        key = tuple(sorted(c.items()))
        if key not in seen and ctx.H % c["pu"] == 0:
            seen.add(key)
            out.append(c)
    return out


def config_name(c: dict, S: int) -> str:
    return (
        f"usp {c['pu']}x{c['pr']} {'causal' if c['causal'] else 'non-causal'}"
        + (f" hg{c['head_groups']}" if c["head_groups"] > 1 else "")
        + (f" ({c['backend']})" if c["backend"] != "auto" else "")
        + (f" S={S // 1024}k" if S >= 1024 else f" S={S}")
    )


def mode_timeline(ctx: Ctx, args) -> None:
    """One fwd+bwd per configuration under torch.profiler on every rank: traces, summary, picture."""
    from repro.usp import timeline

    s = args.timeline_s_per_gpu or (1024 if ctx.smoke else 16384)
    S = s * ctx.world
    summary = Report(
        package="usp", title="USP timeline: where one forward + backward spends its time, per rank",
        columns=["config", "rank", "step_ms", "compute_ms", "attention_ms", "other_compute_ms", "all_to_all_ms",
                 "ring_ms", "comm_other_ms", "comm_ms", "exposed_comm_ms", "overlap_pct", "idle_ms", "kernels"],
        measure_ceilings=False, packages=PACKAGES,
        notes=(f"torch.profiler (CPU + CUDA activity), one fwd+bwd step after 2 warm-up steps, world {ctx.world}, "
               f"S = {S} ({s} per GPU), bf16, H = {ctx.H}, H_kv = {ctx.H_kv}, D = {ctx.D}. Busy times are unions of "
               "device intervals; exposed_comm_ms is communication during which no compute kernel ran; "
               "overlap_pct the share of communication hidden behind compute. NCCL kernels are filed as "
               "all-to-all or ring P2P by the usp: range that launched them. Traces: usp-raw/traces/."),
    )  # fmt: skip
    waves = Report(
        package="usp", title="USP timeline picture: busy (high) and idle (low), per kind, per rank",
        columns=["config", "rank", "lane", "lane_index", "t_ms", "level"], measure_ceilings=False, packages=PACKAGES,
        notes=("Square waves from the same traces: lane 0 compute (attention and the rest), 1 all-to-all, "
               "2 ring P2P; high while at least one kernel of that kind runs. Gaps shorter than 0.5% of the "
               "step (doubled until a lane has at most 16 pulses) are merged. Time from the moment every rank "
               "had started its step (the last rank's first kernel; one host, one clock): earlier intervals "
               "are cut there, in the summary too."),
    )  # fmt: skip
    full = make_inputs(ctx, 1, S)
    for c in _timeline_configs(ctx):
        if ctx.left() < 5:
            break
        name = config_name(c, S)
        try:
            ug, rg = ctx.groups(c["pu"], c["pr"])
            q, k, v, do = (shard(t, ctx.world, ctx.rank, "zigzag").contiguous() for t in full)
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

            def step(leaves=leaves, ug=ug, rg=rg, c=c, do=do):
                o = usp_attention(*leaves, causal=c["causal"], ulysses_group=ug, ring_group=rg, layout="zigzag",
                                  backend=c["backend"], head_groups=c["head_groups"])  # fmt: skip
                _grad(o, leaves, do)

            path = ctx.out / "traces" / f"{timeline.trace_slug(name)}-rank{ctx.rank}.json.gz"
            timeline.profile_step(step, path, warmup=2, sync=ctx.sync, barrier=dist.barrier)
            mine = {"intervals": timeline.parse_trace(timeline.load_trace(path))}
        except Exception as exc:
            traceback.print_exc()
            mine = {"error": f"{type(exc).__name__}: {exc}"}
        got = [None] * ctx.world
        dist.all_gather_object(got, mine)  # every rank's intervals: rank 0 aligns them on the host's clock
        if ctx.rank == 0:
            errors = [(r, m["error"]) for r, m in enumerate(got) if "error" in m]
            for r, err in errors:
                print(f"[timeline] {name} rank {r}: {err}", flush=True)
            if errors:
                for r in range(ctx.world):
                    summary.add(config=name, rank=r, kernels=None, step_ms=None)
                continue
            rows, picture = timeline.config_rows([m["intervals"] for m in got])
            for row in rows:
                summary.add(config=name, **row)
            for row in picture:
                waves.add(config=name, **row)
    if ctx.rank == 0:
        names = list(dict.fromkeys(r["config"] for r in waves.rows))
        for n in names[:2]:  # the picture of the hybrid, causal and not; the others are in the table
            waves.plot(**timeline.picture_plot(n))
        waves.rows = [r for r in waves.rows if r["config"] in names[:2]]
        summary.write(out_dir=ctx.out, tag=f"timeline-{ctx.world}gpu", env=_env(ctx))
        waves.write(out_dir=ctx.out, tag=f"timeline-picture-{ctx.world}gpu", env=_env(ctx))


# --------------------------------------------------------------------------------------- data vs sequence parallel


def mode_dpsp(ctx: Ctx, args) -> None:
    """A global batch of G sequences of length S on G GPUs: data parallel (each GPU its own sequences,
    no communication), sequence parallel over all G (every split), and the hybrids (DP x SP)."""
    report = _report(
        ctx,
        "dpsp",
        notes=(
            f"bf16, H = {ctx.H}, H_kv = {ctx.H_kv}, D = {ctx.D}, fwd+bwd, a global batch of {ctx.world} (and "
            f"{2 * ctx.world}) sequences of length S on {ctx.world} GPUs. gpus = the size of one replica: gpus = 1 is "
            "data parallel (each GPU B = global / G sequences alone), gpus = G sequence parallel (B = global on "
            "every SP group), in between the hybrid. tokens_per_s is per replica; the machine's is "
            "tokens_per_s x G / gpus (ingest: global_tokens_per_s). mem_gib: the peak memory one call allocates per GPU beyond its resident inputs."
        ),
    )
    world = ctx.world
    S = args.dpsp_s or (1024 if ctx.smoke else 32768)
    ps = [p for p in (1, 2, 4, 8) if p <= world and world % p == 0]
    for causal in (True, False):
        for gb in (world, 2 * world):
            if ctx.left() < attention_flops(gb, S, ctx.H, ctx.D, causal, "fwd+bwd") / world * 40 / 300e12:
                continue
            _say(ctx, f"[dpsp] S={S} global batch {gb} causal={causal}")
            specs, keep = [], []
            for p in ps:
                B = gb * p // world
                full = make_inputs(ctx, B, S)
                keep.append(full)
                ref_for = _ref_cache(ctx, full, p, causal)
                for pu, pr in splits(ctx, p):
                    specs.append(lazy(lambda full=full, ref_for=ref_for, p=p, pu=pu, pr=pr, causal=causal, gb=gb: usp_entry(
                        ctx, full, ref_for("zigzag"), P=p, pu=pu, pr=pr, layout="zigzag", causal=causal,
                        impl=("data parallel" if p == 1 else f"usp {pu}x{pr}") + f" (global batch {gb})"),
                        impl=f"usp {pu}x{pr}", gpus=p, S=S))  # fmt: skip
            run_block(ctx, report, specs, causal=causal, base=dict(H=ctx.H, H_kv=ctx.H_kv, D=ctx.D),
                      target_s=0.05 if ctx.smoke else 0.3)  # fmt: skip
            del specs, keep
            _free(ctx)
            _write(ctx, report, "dpsp")


# --------------------------------------------------------------------------------------- main


# peers: ours, torch's context parallel and yunchang at the same shapes (repro.usp.peers); comm: bytes
# per rank, counted, formulas, NVLink, and NCCL's log afterwards (repro.usp.traffic)
MODES = {
    "selfcheck": mode_selfcheck,
    "timeline": mode_timeline,
    "sweep": mode_sweep,
    "peers": mode_peers,
    "dpsp": mode_dpsp,
    "comm": mode_comm,
}


def parse_args(argv=None):
    """The options (``paperclub.bench``'s --out, --budget-s and --quick among them); ``--budget-s``
    counts from after the world's start-up (``gpu_plan.sh``'s step limits allow for it), ``--quick``
    is ``--smoke``, ``--rounds`` left out: 3, or 2 where one call takes over 0.4 s."""
    ap = bench_parser(
        __doc__.splitlines()[0], budget_s=300.0, rounds=None, quick_help="the same as --smoke", only=False,
        settings=False, tag=False, out=Path("usp-out"),
    )  # fmt: skip
    ap.add_argument("--mode", default="sweep", help=f"comma-separated, of {sorted(MODES)} (or comm-report)")
    ap.add_argument(
        "--device", default="cuda", help="cuda (NCCL) or cpu (gloo: a smoke run of the code paths)"
    )
    ap.add_argument("--smoke", action="store_true", help="toy sizes: every code path in seconds")
    ap.add_argument("--s-per-gpu", type=int, nargs="*", default=None, help="sweep/peers: tokens per GPU")
    ap.add_argument("--strong", type=int, default=None, help="sweep: the strong-scaling sequence length")
    ap.add_argument("--timeline-s-per-gpu", type=int, default=None)
    ap.add_argument("--dpsp-s", type=int, default=None)
    ap.add_argument("--comm-s", type=int, default=None)
    ap.add_argument("--heads", type=int, nargs=3, default=None, metavar=("H", "H_KV", "D"))
    ap.add_argument(
        "--nccl-log-dir", type=Path, default=None, help="comm-report: where NCCL_DEBUG_FILE wrote"
    )
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 3, or 2 for slow calls)")
    ap.add_argument("--max-reps", type=int, default=20, help="most calls per timing")
    ap.add_argument(
        "--mode-budget", action="append", default=[], metavar="MODE=SECONDS",
        help="a budget of its own for one mode (from when it starts); the others share --budget-s",
    )  # fmt: skip
    return parse_bench_args(ap, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES and m != "comm-report"]
    if bad:
        raise SystemExit(
            f"dist_bench: unknown mode(s) {bad}; expected some of {sorted(MODES)} or comm-report"
        )
    if modes == ["comm-report"]:
        comm_report(args.out, args.nccl_log_dir)
        return 0
    ctx = init(args.device)
    ctx.out, ctx.budget = args.out, Budget(args.budget_s)  # counted from after the start-up
    ctx.smoke = ctx.smoke or args.smoke or args.quick
    ctx.rounds, ctx.max_reps = args.rounds, args.max_reps
    if args.heads:
        ctx.H, ctx.H_kv, ctx.D = args.heads
    elif ctx.smoke:
        ctx.H, ctx.H_kv, ctx.D = (8, 2, 128) if ctx.cuda else (4, 2, 16)
    own = {}
    for item in args.mode_budget:
        name, _, secs = item.partition("=")
        own[name] = float(secs)
    shared = ctx.budget
    status = 0
    for m in modes:
        ctx.budget = Budget(own[m]) if m in own else shared  # a mode's own: from when it starts
        if m == "comm-report":
            if ctx.rank == 0:
                comm_report(args.out, args.nccl_log_dir)
            continue
        t = time.monotonic()
        try:
            MODES[m](ctx, args)
            _say(ctx, f"[dist_bench] mode {m} done in {time.monotonic() - t:.0f} s")
        except Exception:
            status = 1
            print(f"[dist_bench] rank {ctx.rank}: mode {m} failed", flush=True)
            traceback.print_exc()
        _free(ctx)
    dist.barrier()  # every rank is past its last collective
    return status


if __name__ == "__main__":
    # Leave without destroying the process groups: NCCL destroys its communicators one by one, and with
    # the dozens a run creates that took longer than the plan's steps leave for it (2 H100s,
    # 2026-11-28: still at 19 of 31 communicators after 6 s when the smoke step's timeout killed it;
    # 4 H100s: the dpsp step, its rows written, likewise). Every rank is past its last collective, the
    # results are written, and NCCL writes its log a line at a time (the comm report reads it).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
