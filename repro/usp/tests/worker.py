"""Tasks the spawned CPU workers run (nanoparallel.launch.World): one process group per world, many
cases per spawn. The parent draws the cases (hypothesis) and checks the answers against the
single-device reference; the workers only shard, run USP forward and backward, and count."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from repro.usp import count_bytes, make_groups, shard, usp_attention
from repro.usp.local import LocalAttention, get_backend

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One USP problem: full shapes, the mesh P_u x P_r, and what to run."""

    seed: int
    B: int
    S: int
    H: int
    H_kv: int
    D: int
    ulysses: int
    ring: int
    causal: bool
    layout: str
    dtype: str = "float64"
    backend: str = "math"
    head_groups: int = 1

    @property
    def P(self) -> int:
        return self.ulysses * self.ring


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full q, k, v [B, S, H(_kv), D] and the upstream gradient dO, the same on every process."""
    gen = torch.Generator().manual_seed(case.seed)
    dt = DTYPES[case.dtype]
    q = torch.randn(case.B, case.S, case.H, case.D, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, case.S, case.H_kv, case.D, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, case.S, case.H_kv, case.D, generator=gen, dtype=torch.float64)
    do = torch.randn(case.B, case.S, case.H, case.D, generator=gen, dtype=torch.float64)
    return q.to(dt), k.to(dt), v.to(dt), do.to(dt)


class CountingBackend(LocalAttention):
    """Wraps a backend and counts the unmasked (query, key) pairs of every forward call (per head)."""

    def __init__(self, inner: LocalAttention):
        self.inner, self.pairs, self.name = inner, 0, inner.name

    def forward(self, q, k, v, causal, scale):
        sq, sk = q.shape[1], k.shape[1]
        self.pairs += sq * (sq + 1) // 2 if causal else sq * sk
        return self.inner.forward(q, k, v, causal, scale)

    def backward(self, *args):
        return self.inner.backward(*args)


def setup(ctx: dict, timeout_s: float = 30.0) -> int:
    """Join the gloo world once per worker (a bounded timeout, so a broken case errors, not hangs)."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("usp", ctx["store"]),
            rank=ctx["rank"],
            world_size=ctx["world_size"],
            timeout=timedelta(seconds=timeout_s),
        )
        ctx["groups"] = {}
    return dist.get_world_size()


def _groups(ctx: dict, case: Case):
    """The mesh for this case, built once: all world ranks when P divides the world (data-parallel
    replicas of the SP group), else the first P ranks (the others idle)."""
    world = ctx["world_size"]
    ranks = None if world % case.P == 0 else tuple(range(case.P))
    key = (case.ulysses, case.ring, ranks)
    if key not in ctx["groups"]:
        ctx["groups"][key] = make_groups(case.ulysses, case.ring, ranks=ranks)
    return ctx["groups"][key]


def run_cases(ctx: dict, cases: list[Case]) -> list[dict | None]:
    """For each case: this rank's output and gradient shards, bytes sent and attention pairs computed.

    None for a rank outside the case's SP domain. ``sp_rank`` = ring_rank * P_u + ulysses_rank."""
    out = []
    for case in cases:
        ug, rg = _groups(ctx, case)
        if ug is None:
            out.append(None)
            continue
        u, r = dist.get_rank(ug), dist.get_rank(rg)
        sp_rank = r * case.ulysses + u
        q, k, v, do = (shard(t, case.P, sp_rank, case.layout) for t in inputs(case))
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        backend = CountingBackend(get_backend(case.backend))
        with count_bytes() as sent:
            o = usp_attention(
                q,
                k,
                v,
                causal=case.causal,
                ulysses_group=ug,
                ring_group=rg,
                layout=case.layout,
                backend=backend,
                head_groups=case.head_groups,
            )
            o.backward(do)
        out.append(
            {
                "sp_rank": sp_rank,
                "replica": dist.get_rank() // case.P,
                "o": o.detach(),
                "dq": q.grad,
                "dk": k.grad,
                "dv": v.grad,
                "bytes": dict(sent),
                "pairs": backend.pairs,
            }
        )
    return out


def run_errors(ctx: dict, calls: list[tuple[str, dict]]) -> list[str]:
    """Call make_groups / usp_attention with bad arguments; return each error's type and message."""
    msgs = []
    for fn, kwargs in calls:
        try:
            if fn == "make_groups":
                make_groups(**kwargs)
            else:
                raise ValueError(f"unknown call {fn}")
            msgs.append("no error")
        except (ValueError, TypeError, RuntimeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    return msgs


class _Local(torch.autograd.Function):
    """One local attention call with its backend's backward: Ulysses without any ring code."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend):
        o, lse, aux = backend.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.backend, ctx.aux = causal, scale, backend, aux
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale, ctx.aux)
        return dq, dk, dv, None, None, None


def run_reductions(ctx: dict, cases: list[Case]) -> list[dict | None]:
    """USP against plain Ulysses (P_r = 1) or plain Ring (P_u = 1) on the same shards: outputs,
    gradients and traffic of both, for a bit-for-bit comparison in the parent."""
    import math

    from repro.usp.ring import ring_attention
    from repro.usp.ulysses import head_to_seq, seq_to_head
    from repro.usp.usp import _ring_order, kv_heads_after_replication

    out = []
    for case in cases:
        ug, rg = _groups(ctx, case)
        if ug is None:
            out.append(None)
            continue
        u, r = dist.get_rank(ug), dist.get_rank(rg)
        shards = [shard(t, case.P, r * case.ulysses + u, case.layout) for t in inputs(case)]
        backend = get_backend(case.backend)
        scale = 1.0 / math.sqrt(case.D)
        res = {}
        for name in ("usp", "plain"):
            q, k, v = (t.clone().requires_grad_(True) for t in shards[:3])
            with count_bytes() as sent:
                if name == "usp":
                    o = usp_attention(
                        q, k, v, causal=case.causal, ulysses_group=ug, ring_group=rg, layout=case.layout,
                        backend=backend,
                    )  # fmt: skip
                elif case.ring == 1:  # DeepSpeed-Ulysses: all-to-all, one attention, all-to-all back
                    rep = kv_heads_after_replication(case.H_kv, case.ulysses) // case.H_kv
                    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
                    qh, kh, vh = (seq_to_head(t, ug) for t in (q, kk, vv))
                    if case.layout == "zigzag" and case.ulysses > 1:
                        order = _ring_order(case.ulysses, q.shape[1], q.device)
                        qh, kh, vh = (t.index_select(1, order) for t in (qh, kh, vh))
                        oh = _Local.apply(qh, kh, vh, case.causal, scale, backend)
                        oh = oh.index_select(1, torch.argsort(order))
                    else:
                        oh = _Local.apply(qh, kh, vh, case.causal, scale, backend)
                    o = head_to_seq(oh, ug)
                else:  # Ring attention alone on the sequence shards
                    o = ring_attention(
                        q,
                        k,
                        v,
                        causal=case.causal,
                        scale=scale,
                        group=rg,
                        layout=case.layout,
                        backend=backend,
                    )
                o.backward(shards[3])
            res[name] = {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "bytes": dict(sent)}
        out.append(res)
    return out


def run_usp_heads_error(ctx: dict, ulysses: int, H: int) -> str:
    """usp_attention with H not divisible by the Ulysses degree: the error every rank raises."""
    ug, rg = make_groups(ulysses, ctx["world_size"] // ulysses)
    x = torch.zeros(1, 4, H, 4, dtype=torch.float64)
    try:
        usp_attention(x, x, x, ulysses_group=ug, ring_group=rg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def trace_shards(ctx: dict, ulysses: int, ring: int, S: int, H: int, layout: str = "zigzag") -> dict:
    """Move *labels* through the real communication: each element of q is ``position * 100 + head``, so
    what a rank holds after the Ulysses all-to-all and at each ring step can be read off the values.
    Returns this rank's held (position, head) labels at each stage (for the walkthrough)."""
    from repro.usp import comm
    from repro.usp.ulysses import seq_to_head
    from repro.usp.usp import _ring_order

    ug, rg = _groups(ctx, Case(0, 1, S, H, H, 1, ulysses, ring, True, layout))
    if ug is None:
        return {}
    u, r = dist.get_rank(ug), dist.get_rank(rg)
    sp_rank = r * ulysses + u
    pos = torch.arange(S, dtype=torch.float64)[None, :, None, None]
    heads = torch.arange(H, dtype=torch.float64)[None, None, :, None]
    labels = pos * 100 + heads  # [1, S, H, 1]
    local = shard(labels, ulysses * ring, sp_rank, layout)
    after = seq_to_head(local, ug)
    if layout == "zigzag" and ulysses > 1:
        after = after.index_select(1, _ring_order(ulysses, local.shape[1], after.device))
    steps = [after]
    block = after
    for _ in range(ring - 1):
        (block,) = comm.ring_shift([block], rg, "trace").wait()
        steps.append(block)

    def tokens(t):  # the positions along the sequence (read off head 0)
        return (t[0, :, 0, 0] // 100).long().tolist()

    return {
        "sp_rank": sp_rank,
        "ulysses_rank": u,
        "ring_rank": r,
        "local_positions": tokens(local),
        "local_heads": (local[0, 0, :, 0] % 100).long().tolist(),
        "after_all_to_all": {"positions": tokens(after), "heads": (after[0, 0, :, 0] % 100).long().tolist()},
        "ring_steps": [tokens(b) for b in steps],
    }


def run_nanoparallel(ctx: dict, case: Case, kind: str = "ulysses") -> dict:
    """Ulysses (``kind="ulysses"``) or Ring (``"ring"``) over the whole world with a nanoparallel
    Communicator (shared-memory transport) as the group: the traffic goes through our own collectives
    library instead of gloo, whose transport counts the payload bytes it hands to peers
    (``transport.bytes_sent``, headers included) independently of repro.usp.comm's count."""
    import nanoparallel

    if "npl" not in ctx:
        ctx["npl"] = nanoparallel.init(
            ctx["rank"], ctx["world_size"], store=dist.PrefixStore("usp-npl", ctx["store"]), transport="shm"
        )
        ctx.setdefault("comms", {})["usp"] = ctx["npl"]  # closed by the worker at exit
    comm = ctx["npl"]
    q, k, v, do = (shard(t, case.P, comm.rank, case.layout) for t in inputs(case))
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    groups = {"ulysses_group": comm} if kind == "ulysses" else {"ring_group": comm}
    before = comm.transport.bytes_sent
    with count_bytes() as sent:
        o = usp_attention(
            q, k, v, causal=case.causal, layout=case.layout, backend=case.backend, head_groups=case.head_groups,
            **groups,
        )  # fmt: skip
        o.backward(do)
    return {"sp_rank": comm.rank, "replica": 0, "o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "bytes": dict(sent), "transport_bytes": comm.transport.bytes_sent - before}  # fmt: skip


def run_nanoparallel_ulysses(ctx: dict, case: Case) -> dict:
    """Ulysses through nanoparallel (kept for the walkthrough)."""
    return run_nanoparallel(ctx, case, "ulysses")


def run_dist_bench(ctx: dict, modes: str, out: str, extra: list[str]) -> dict:
    """repro.usp.dist_bench's modes on this gloo world (tiny sizes): what they wrote, for the parent."""
    import json
    from pathlib import Path

    from paperclub.bench import Budget
    from repro.usp import dist_bench

    args = dist_bench.parse_args(["--mode", modes, "--out", out, "--device", "cpu", "--smoke", *extra])
    bctx = dist_bench.Ctx(device=torch.device("cpu"), dtype=torch.float32, out=Path(out), budget=Budget(300.0),
                          smoke=True, H=8, H_kv=4, D=8, rounds=args.rounds, max_reps=args.max_reps)  # fmt: skip
    for m in modes.split(","):
        dist_bench.MODES[m](bctx, args)
    dist.barrier()
    return {p.name: json.loads(p.read_text()) for p in Path(out).glob("*.json")} if ctx["rank"] == 0 else {}


def nccl_selfcheck_rank(rank: int, world: int, port: int, args, results) -> None:
    """One rank of a real NCCL world (one GPU each): every factorisation, layout and mask against
    one-device attention (repro.usp.selfcheck.run_checks); puts (rank, failures, table) on ``results``."""
    import os

    try:
        from repro.usp.selfcheck import run_checks

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=dev, timeout=timedelta(seconds=120)
        )
        failed, rows = 0, []
        for head_groups in (1, 2):
            r, f = run_checks(dtype=torch.bfloat16, seq=args["seq"], backend=args["backend"], device=dev,
                              head_groups=head_groups)  # fmt: skip
            failed, rows = failed + f, rows + r
        dist.destroy_process_group()
        results.put((rank, failed, rows))
    except Exception as exc:  # the parent stops at once instead of waiting for this rank
        results.put((rank, -1, [f"{type(exc).__name__}: {exc}"]))
