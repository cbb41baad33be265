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
attention computed shard by shard, :func:`shard_reference`) before it is timed; a failed check is
recorded and not timed. Results: paperclub.bench Report JSON in ``--out``, written after every block.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paperclub.bench import Report, environment
from paperclub.testing import rel_error
from repro.usp import make_groups, positions, shard, usp_attention

COLUMNS = [
    "impl", "gpus", "ulysses", "ring", "layout", "backend", "head_groups", "causal", "S", "S_per_gpu",
    "B", "H", "H_kv", "D", "pass", "ms", "ms_min", "ms_max", "reps", "check", "err", "tflops_per_gpu",
    "tokens_per_s", "mem_gib", "note",
]  # fmt: skip
TOL = 2e-2  # bf16: O and each gradient round to ~4e-3; sums over blocks add a little
PACKAGES = ["yunchang"]
TITLES = {
    "sweep": "USP on several GPUs: weak and strong scaling, every (ulysses, ring) split",
    "peers": "USP against torch context parallel and yunchang on several GPUs",
    "dpsp": "Data parallel against sequence parallel at equal global batch",
}


def attention_flops(b: int, s: int, h: int, d: int, causal: bool, passes: str) -> float:
    """Useful FLOPs of softmax attention: 4 B S^2 H D forward (QK^T and PV), 2.5x that backward,
    halved by a causal mask."""
    fwd = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
    return fwd * (3.5 if passes == "fwd+bwd" else 1.0)


# --------------------------------------------------------------------------------------- the world


@dataclass
class Ctx:
    """This rank's view of the run: device, shapes, budget, cached groups."""

    device: torch.device
    dtype: torch.dtype
    out: Path
    budget_s: float
    smoke: bool
    H: int = 32
    H_kv: int = 8
    D: int = 128
    rounds: int = 0  # 0: 3 rounds, 2 where one call takes over 0.4 s
    max_reps: int = 20
    t0: float = field(default_factory=time.monotonic)
    _groups: dict = field(default_factory=dict)
    _sp: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return dist.get_world_size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def all_max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def left(self) -> float:
        """Seconds left of the budget, rank 0's clock, the same on every rank (a broadcast)."""
        t = torch.tensor(
            [self.budget_s - (time.monotonic() - self.t0)], dtype=torch.float64, device=self.device
        )
        dist.broadcast(t, 0)
        return float(t.item())

    def groups(self, pu: int, pr: int):
        """(ulysses group, ring group) of this rank for a P_u x P_r mesh (replicated over the world)."""
        if (pu, pr) not in self._groups:
            self._groups[pu, pr] = make_groups(pu, pr)
        return self._groups[pu, pr]

    def sp_group(self, p: int):
        """The process group of this rank's replica of p consecutive ranks (None for p = 1)."""
        if p == 1:
            return None
        if p == self.world:
            return dist.group.WORLD
        if p not in self._sp:
            mine = None
            for base in range(0, self.world, p):
                g = dist.new_group(list(range(base, base + p)))
                if base <= self.rank < base + p:
                    mine = g
            self._sp[p] = mine
        return self._sp[p]

    def mem_reset(self) -> None:
        """Start measuring the memory a call allocates beyond what is resident now."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._mem0 = torch.cuda.memory_allocated()

    def mem_gib(self) -> float | None:
        """GiB the calls since :meth:`mem_reset` allocated at their peak, beyond what was resident then
        (the largest over the ranks)."""
        if not self.cuda:
            return None
        return self.all_max((torch.cuda.max_memory_allocated() - getattr(self, "_mem0", 0)) / 2**30)


def init(device: str) -> Ctx:
    """Join the torchrun world: NCCL on the local GPU, or gloo on CPU."""
    timeout = timedelta(seconds=int(os.environ.get("USP_PG_TIMEOUT_S", "180")))
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=dev, timeout=timeout)
        return Ctx(device=dev, dtype=torch.bfloat16, out=Path("."), budget_s=0, smoke=False)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    return Ctx(device=torch.device("cpu"), dtype=torch.float32, out=Path("."), budget_s=0, smoke=True)


def time_ms(ctx: Ctx, fn, reps: int) -> float:
    """Mean ms of ``reps`` calls of ``fn`` on every rank after a barrier; the slowest rank's (all ranks
    get the same number, and every rank makes the same calls)."""
    ctx.sync()
    dist.barrier()
    if ctx.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / reps
    else:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        ms = (time.perf_counter() - t) * 1e3 / reps
    return ctx.all_max(ms)


# --------------------------------------------------------------------------------------- inputs, reference


def make_inputs(ctx: Ctx, B: int, S: int, h_kv: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Full q, k, v, dO [B, S, H(_kv), D], the same on every rank."""
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    h_kv = ctx.H_kv if h_kv is None else h_kv
    return [
        torch.randn(B, S, h, ctx.D, device=ctx.device, dtype=ctx.dtype, generator=gen)
        for h in (ctx.H, h_kv, h_kv, ctx.H)
    ]


def _expand(t: torch.Tensor, h: int) -> torch.Tensor:
    return t if t.shape[2] == h else t.repeat_interleave(h // t.shape[2], dim=2)


def _runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions: [(start, length)]."""
    p = pos.tolist()
    out, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            out.append((p[start], i - start))
            start = i
    return out


def shard_reference(ctx: Ctx, full, P: int, layout: str, causal: bool) -> dict[str, torch.Tensor]:
    """One-device attention for this rank's shard of an SP replica of P ranks: o and dQ of its own
    queries, and its share of dK/dV summed over the replica (an all-reduce), each as this rank's
    shard [B, S/P, ...]. Computed with PyTorch's SDPA (the causal prefix of each chunk with a
    lower-right causal mask), not with any code of this package."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, do = full
    B, S, H, D = q.shape
    sp = ctx.rank % P
    pos = positions(S, P, sp, layout).to(ctx.device)
    kf = _expand(k, H).detach().requires_grad_(True)
    vf = _expand(v, H).detach().requires_grad_(True)
    os_, dqs = [], []
    for a, c in _runs(pos.cpu()):
        qc = q[:, a : a + c].detach().requires_grad_(True)
        end = a + c if causal else S
        qt, kt, vt = qc.transpose(1, 2), kf[:, :end].transpose(1, 2), vf[:, :end].transpose(1, 2)
        mask = causal_lower_right(c, end) if (causal and end != c) else None
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None)
        o = o.transpose(1, 2)
        o.backward(do[:, a : a + c])
        os_.append(o.detach())
        dqs.append(qc.grad)
    h_kv = k.shape[2]
    dk = kf.grad.float().view(B, S, h_kv, H // h_kv, D).sum(3)
    dv = vf.grad.float().view(B, S, h_kv, H // h_kv, D).sum(3)
    del kf, vf
    g = ctx.sp_group(P)
    if g is not None:
        dist.all_reduce(dk, group=g)
        dist.all_reduce(dv, group=g)
    return {"o": torch.cat(os_, 1), "dq": torch.cat(dqs, 1), "dk": dk[:, pos], "dv": dv[:, pos]}


def full_reference(ctx: Ctx, ref: dict, P: int, layout: str) -> dict[str, torch.Tensor]:
    """The whole sequence's reference on every rank of a replica, gathered from the shards."""
    g = ctx.sp_group(P)
    out = {}
    for name, t in ref.items():
        parts = [torch.empty_like(t) for _ in range(P)]
        if g is None:
            parts = [t]
        else:
            dist.all_gather(parts, t.contiguous(), group=g)
        B, s = t.shape[:2]
        full = t.new_empty(B, s * P, *t.shape[2:])
        for r, part in enumerate(parts):
            full[:, positions(s * P, P, r, layout).to(t.device)] = part
        out[name] = full
    return out


# --------------------------------------------------------------------------------------- candidates


@dataclass
class Entry:
    """One thing to time at one shape: its row, its call and its check."""

    row: dict
    run: object  # () -> None, one timed call
    check: object  # () -> float, the worst relative error on this rank
    flops_per_gpu: float
    tokens: int
    times: list = field(default_factory=list)
    reps: int = 1
    first: float = 0.0
    context: object = None  # () -> context manager around its calls (torch CP)


def _grad(out, leaves, do):
    return torch.autograd.grad(out, leaves, do)


def usp_entry(ctx, full, ref, *, P, pu, pr, layout, causal, passes="fwd+bwd", backend="auto",
              head_groups=1, impl=None, note="") -> Entry:  # fmt: skip
    """usp_attention on a P_u x P_r mesh (replicated over the world), this rank's shards."""
    ug, rg = ctx.groups(pu, pr)
    sp = ctx.rank % P
    B, S = full[0].shape[:2]
    q, k, v, do = (shard(t, P, sp, layout).contiguous() for t in full)
    leaves = [t.detach().clone().requires_grad_(passes == "fwd+bwd") for t in (q, k, v)]

    def fwd():
        return usp_attention(
            *leaves, causal=causal, ulysses_group=ug, ring_group=rg, layout=layout, backend=backend,
            head_groups=head_groups,
        )  # fmt: skip

    def run():
        if passes == "fwd+bwd":
            _grad(fwd(), leaves, do)
        else:
            with torch.no_grad():
                fwd()

    def check():
        o = fwd()
        errs = [rel_error(o.detach().float(), ref["o"].float())]
        if passes == "fwd+bwd":
            for name, g in zip(("dq", "dk", "dv"), _grad(o, leaves, do), strict=True):
                errs.append(rel_error(g.float(), ref[name].float()))
        return max(errs)

    name = impl or (
        f"usp {pu}x{pr}" + (" contiguous" if layout == "contiguous" and pr > 1 else "")
        + (f" hg{head_groups}" if head_groups > 1 else "") + (f" ({backend})" if backend != "auto" else "")
    )  # fmt: skip
    row = dict(impl=name, gpus=P, ulysses=pu, ring=pr, layout=layout, backend=backend, head_groups=head_groups,
               S=S, S_per_gpu=S // P, B=B, note=note)  # fmt: skip
    return Entry(row, run, check, attention_flops(B, S, ctx.H, ctx.D, causal, passes) / P, B * S)


def sdpa_entry(ctx, full, ref, *, causal, passes="fwd+bwd") -> Entry:
    """One F.scaled_dot_product_attention call over the whole local sequence (K/V expanded to H heads
    inside the call, as a model without GQA kernels does): the one-GPU baseline, with the backend
    SDPA picks (recorded)."""
    q, k, v, do = full
    B, S = q.shape[:2]
    leaves = [t.detach().clone().requires_grad_(passes == "fwd+bwd") for t in (q, k, v)]

    def fwd():
        kk, vv = _expand(leaves[1], ctx.H), _expand(leaves[2], ctx.H)
        o = F.scaled_dot_product_attention(
            leaves[0].transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), is_causal=causal
        )
        return o.transpose(1, 2)

    def run():
        if passes == "fwd+bwd":
            _grad(fwd(), leaves, do)
        else:
            with torch.no_grad():
                fwd()

    def check():
        o = fwd()
        errs = [rel_error(o.detach().float(), ref["o"].float())]
        if passes == "fwd+bwd":
            for name, g in zip(("dq", "dk", "dv"), _grad(o, leaves, do), strict=True):
                errs.append(rel_error(g.float(), ref[name].float()))
        return max(errs)

    row = dict(impl="full sdpa", gpus=1, ulysses=1, ring=1, layout="-", backend=_sdpa_choice(ctx, q, causal),
               head_groups=1, S=S, S_per_gpu=S, B=B, note="one call, K/V expanded inside it")  # fmt: skip
    return Entry(row, run, check, attention_flops(B, S, ctx.H, ctx.D, causal, passes), B * S)


def _sdpa_choice(ctx, q, causal) -> str:
    """The kernel F.scaled_dot_product_attention picks for these inputs (cuDNN or flash on an H100)."""
    try:
        from torch.nn.attention import SDPBackend

        t = q.transpose(1, 2)  # metadata only: no kernel runs
        return "sdpa:" + SDPBackend(torch._fused_sdp_choice(t, t, t, None, 0.0, causal)).name.lower()
    except Exception as exc:  # private API: record that we do not know
        return f"sdpa:unknown ({type(exc).__name__})"


def splits(ctx: Ctx, P: int) -> list[tuple[int, int]]:
    """Every (P_u, P_r) with P_u P_r = P and P_u dividing H."""
    return [(u, P // u) for u in range(1, P + 1) if P % u == 0 and ctx.H % u == 0]


# --------------------------------------------------------------------------------------- the timing loop


def run_block(ctx: Ctx, report: Report, specs: list, *, causal: bool, passes: str = "fwd+bwd",
              target_s: float = 0.3, max_reps: int = 20, base: dict | None = None) -> None:  # fmt: skip
    """Build, check and time a block of entries in interleaved rounds; add their rows to ``report``.

    ``specs``: builders (``lazy(fn, **meta)``: fn() -> Entry); the entries of one block share their
    rounds. Every rank runs the same sequence of calls: a failed build or check is all-reduced, so
    every rank drops the same entries."""
    live, done = [], []
    for builder in specs:
        try:
            e = builder()
            ctx.mem_reset()  # after the builder: its inputs and the reference are not the call's memory
            err = e.check()
            msg = ""
        except Exception as exc:  # recorded; the rest of the block goes on
            e, err, msg = None, float("inf"), f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"
            if ctx.rank == 0:
                traceback.print_exc()
        err = ctx.all_max(err)
        if e is None or not (err <= TOL):
            row = dict(e.row) if e is not None else dict(getattr(builder, "meta", {}))
            check = f"failed: {msg}" if msg else f"failed: relative error {err:.3g} > {TOL}"
            done.append({**row, "check": check, "err": None if math.isinf(err) else err})
            continue
        e.row.update(check="ok", err=err, mem_gib=ctx.mem_gib())
        with e.context() if e.context else _nullcontext():
            e.first = time_ms(ctx, e.run, 1)  # also the warm-up after the check
        e.reps = max(1, min(max_reps, ctx.max_reps, int(target_s * 1e3 / max(e.first, 1e-3))))
        live.append(e)
    rounds = ctx.rounds or (3 if all(e.first < 400 for e in live) else 2)
    for _ in range(rounds):
        if ctx.left() < 0:
            break
        for e in live:
            with e.context() if e.context else _nullcontext():
                e.times.append(time_ms(ctx, e.run, e.reps))
    for e in live:
        if not e.times:
            done.append({**e.row, "check": "ok (not timed: out of budget)"})
            continue
        ms = sorted(e.times)[len(e.times) // 2]
        done.append({
            **e.row, "ms": ms, "ms_min": min(e.times), "ms_max": max(e.times), "reps": e.reps,
            "tflops_per_gpu": e.flops_per_gpu / (ms * 1e-3) / 1e12, "tokens_per_s": e.tokens / (ms * 1e-3),
        })  # fmt: skip
    for row in done:
        report.add(**{**(base or {}), "causal": causal, "pass": passes, **row})


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def lazy(fn, **meta):
    """A builder: ``fn()`` makes the Entry when its block runs; ``meta`` names its row if it fails."""
    fn.meta = meta
    return fn


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


def _ref_cache(ctx: Ctx, full, p: int, causal: bool):
    """layout -> this rank's shard reference, computed on first use."""
    refs: dict = {}

    def get(layout):
        if layout not in refs:
            refs[layout] = shard_reference(ctx, full, p, layout, causal)
        return refs[layout]

    return get


def _say(ctx: Ctx, msg: str) -> None:
    if ctx.rank == 0:
        print(msg, flush=True)


def _free(ctx: Ctx) -> None:
    import gc

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def _report(ctx: Ctx, mode: str, notes: str) -> Report:
    return Report(
        package="usp",
        title=TITLES.get(mode, f"USP {mode}"),
        peer="torch context_parallel; yunchang 0.6.4" if mode == "peers" else "",
        columns=COLUMNS,
        packages=PACKAGES,
        measure_ceilings=False,
        notes=notes + f" World of {ctx.world} ranks.",
    )


def _write(ctx: Ctx, report: Report, tag: str) -> None:
    if ctx.rank == 0:
        report.write(out_dir=ctx.out, tag=f"{tag}-{ctx.world}gpu", env=_env(ctx))


_ENV: dict = {}


def _env(ctx: Ctx) -> dict:
    if not _ENV:
        _ENV.update(environment(PACKAGES))
        if ctx.cuda:
            _ENV["world_size"] = ctx.world
    return _ENV


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


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def mode_peers(ctx: Ctx, args) -> None:
    """Ours, torch's context parallel and yunchang at the same shapes (:mod:`repro.usp.peers`)."""
    from repro.usp.peers import mode_peers as run

    run(ctx, args)


def mode_comm(ctx: Ctx, args) -> None:
    """Bytes per rank: counted, formulas, NVLink; NCCL's log afterwards (:mod:`repro.usp.traffic`)."""
    from repro.usp.traffic import mode_comm as run

    run(ctx, args)


def comm_report(out: Path, log_dir: Path | None) -> None:
    from repro.usp.traffic import comm_report as run

    run(out, log_dir)


MODES = {
    "selfcheck": mode_selfcheck,
    "timeline": mode_timeline,
    "sweep": mode_sweep,
    "peers": mode_peers,
    "dpsp": mode_dpsp,
    "comm": mode_comm,
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="sweep", help=f"comma-separated, of {sorted(MODES)} (or comm-report)")
    ap.add_argument("--out", type=Path, default=Path("usp-out"), help="directory for the results")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new blocks near this")
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
    ap.add_argument("--rounds", type=int, default=0, help="timing rounds (default 3, or 2 for slow calls)")
    ap.add_argument("--max-reps", type=int, default=20, help="most calls per timing")
    ap.add_argument(
        "--mode-budget", action="append", default=[], metavar="MODE=SECONDS",
        help="a budget of its own for one mode (from when it starts); the others share --budget-s",
    )  # fmt: skip
    return ap.parse_args(argv)


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
    ctx.out, ctx.budget_s, ctx.t0 = args.out, args.budget_s, time.monotonic()
    ctx.smoke = ctx.smoke or args.smoke
    ctx.rounds, ctx.max_reps = args.rounds, args.max_reps
    if args.heads:
        ctx.H, ctx.H_kv, ctx.D = args.heads
    elif ctx.smoke:
        ctx.H, ctx.H_kv, ctx.D = (8, 2, 128) if ctx.cuda else (4, 2, 16)
    own = {}
    for item in args.mode_budget:
        name, _, secs = item.partition("=")
        own[name] = float(secs)
    shared = (ctx.t0, ctx.budget_s)
    status = 0
    for m in modes:
        ctx.t0, ctx.budget_s = (time.monotonic(), own[m]) if m in own else shared
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
