"""The machinery of the multi-GPU benchmark (:mod:`repro.usp.dist_bench`), shared by its modes and by
:mod:`repro.usp.peers` and :mod:`repro.usp.traffic`: this rank's view of the run (:class:`Ctx`: device,
shapes, budget, process groups), the timing, the inputs and the one-device reference computed shard by
shard, the candidates (:class:`Entry`: ours, SDPA), the timed block (:func:`run_block`: every
configuration checked, then timed in interleaved rounds, the same calls on every rank) and the
result tables. The modes import it; it imports none of them.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paperclub.bench import Budget, Report, environment
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
    budget: Budget  # what is left of it is rank 0's (:meth:`left`)
    smoke: bool
    H: int = 32
    H_kv: int = 8
    D: int = 128
    rounds: int | None = None  # None: 3 rounds, 2 where one call takes over 0.4 s
    max_reps: int = 20
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
        t = torch.tensor([self.budget.left()], dtype=torch.float64, device=self.device)
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
        return Ctx(device=dev, dtype=torch.bfloat16, out=Path("."), budget=Budget(None), smoke=False)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    return Ctx(
        device=torch.device("cpu"), dtype=torch.float32, out=Path("."), budget=Budget(None), smoke=True
    )


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

    run, check = _run_and_check(fwd, leaves, do, ref, passes)

    name = impl or (
        f"usp {pu}x{pr}" + (" contiguous" if layout == "contiguous" and pr > 1 else "")
        + (f" hg{head_groups}" if head_groups > 1 else "") + (f" ({backend})" if backend != "auto" else "")
    )  # fmt: skip
    row = dict(impl=name, gpus=P, ulysses=pu, ring=pr, layout=layout, backend=backend, head_groups=head_groups,
               S=S, S_per_gpu=S // P, B=B, note=note)  # fmt: skip
    return Entry(row, run, check, attention_flops(B, S, ctx.H, ctx.D, causal, passes) / P, B * S)


def _run_and_check(fwd, leaves, do, ref, passes):
    """An entry's two closures over its forward ``fwd``: ``run`` (the timed pass: forward, and the
    backward into ``leaves`` with cotangent ``do`` for "fwd+bwd") and ``check`` (the largest relative
    error of the output, and of the gradients for "fwd+bwd", against ``ref``)."""

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

    return run, check


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

    run, check = _run_and_check(fwd, leaves, do, ref, passes)

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


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
