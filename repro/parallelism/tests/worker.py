"""Tasks the spawned CPU workers run (nanoparallel.launch.World): one gloo world of 4 processes for the
whole session, many drawn cases per spawn. The parent draws each case (hypothesis) and builds the
single-device reference; a task rebuilds its rank's inputs from the case's seed, runs the parallel
code and returns what the parent compares. Ranks outside a case's group return None."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from repro.parallelism import async_tp
from repro.parallelism.comm import count_collectives
from repro.parallelism.megatron import parallel_attention, parallel_layer, parallel_mlp, shard_weights
from repro.parallelism.pipeline import run_stage, split_micro
from repro.parallelism.pipeline_schedule import gpipe, one_f_one_b, zb_h1, zb_h2
from repro.parallelism.reference import LayerWeights, init_weights
from repro.parallelism.rsa import ring_self_attention
from repro.parallelism.sequence_parallel import SavedActivations, sequence_parallel_layer, shard_sequence
from repro.parallelism.zero import zero_init, zero_step

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2}


def setup(ctx: dict, timeout_s: float = 60.0) -> int:
    """Join the gloo world once per worker and build the groups of the first 2, 3 and 4 ranks
    (collective: every rank creates every group, in the same order)."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("parallelism", ctx["store"]),
            rank=ctx["rank"],
            world_size=ctx["world_size"],
            timeout=timedelta(seconds=timeout_s),
        )
        ctx["groups"] = {n: dist.new_group(list(range(n))) for n in range(2, ctx["world_size"] + 1)}
    return dist.get_world_size()


def group_of(ctx: dict, n: int):
    """(the group of the first n ranks or None for n = 1, whether this rank is in it)."""
    member = ctx["rank"] < n
    return (None if n == 1 else ctx["groups"][n]), member


# ---------------------------------------------------------------- tensor and sequence parallelism


@dataclass(frozen=True)
class LayerCase:
    """One transformer layer [s, b, h] with ``heads`` heads, on ``t`` tensor-parallel ranks."""

    seed: int
    s: int
    b: int
    h: int
    heads: int
    t: int
    dtype: str = "float64"
    p_drop: float = 0.0


def layer_inputs(case: LayerCase) -> tuple[torch.Tensor, torch.Tensor, LayerWeights]:
    """The whole input x [s, b, h], the upstream gradient dy and the whole layer's weights."""
    dt = DTYPES[case.dtype]
    gen = torch.Generator().manual_seed(case.seed + 1)
    x = torch.randn(case.s, case.b, case.h, generator=gen, dtype=torch.float64).to(dt)
    dy = torch.randn(case.s, case.b, case.h, generator=gen, dtype=torch.float64).to(dt)
    return x, dy, init_weights(case.h, case.seed, dt)


def run_tensor_parallel(ctx: dict, case: LayerCase, block: str) -> dict | None:
    """Megatron's tensor-parallel ``block`` ("mlp", "attention" or "layer") on this rank's shard: its
    output, the input's and the shard's gradients, and the collectives counted in each pass."""
    group, member = group_of(ctx, case.t)
    if not member:
        return None
    x, dy, full = layer_inputs(case)
    w = shard_weights(full, case.heads, ctx["rank"], case.t)
    x = x.clone().requires_grad_(True)
    with count_collectives() as fwd:
        if block == "mlp":
            y = parallel_mlp(x, w, group)
        elif block == "attention":
            y = parallel_attention(x, w, case.heads, group, case.p_drop)
        else:
            y = parallel_layer(x, w, case.heads, group, case.p_drop)
    with count_collectives() as bwd:
        y.backward(dy)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "grads": {n: t.grad for n, t in zip(w.names(), w.tensors(), strict=True) if t.grad is not None},
        "fwd": dict(fwd),
        "bwd": dict(bwd),
    }


def run_sequence_parallel(ctx: dict, case: LayerCase, overlap: bool) -> dict | None:
    """The layer with tensor + sequence parallelism (async TP's decomposed collectives when
    ``overlap``): this rank's output tokens, their input gradient, the shard's weight gradients."""
    group, member = group_of(ctx, case.t)
    if not member:
        return None
    x, dy, full = layer_inputs(case)
    w = shard_weights(full, case.heads, ctx["rank"], case.t)
    x_l = shard_sequence(x, ctx["rank"], case.t).clone().requires_grad_(True)
    with count_collectives() as fwd:
        y = sequence_parallel_layer(x_l, w, case.heads, group, case.p_drop, overlap=overlap)
    with count_collectives() as bwd:
        y.backward(shard_sequence(dy, ctx["rank"], case.t))
    return {
        "y": y.detach(),
        "dx": x_l.grad,
        "grads": {n: t.grad for n, t in zip(w.names(), w.tensors(), strict=True)},
        "fwd": dict(fwd),
        "bwd": dict(bwd),
    }


def measure_activations(ctx: dict, case: LayerCase, sequence_parallel: bool) -> dict | None:
    """Bytes this rank's layer keeps for the backward (bf16 activations, dropout on), measured by
    :class:`SavedActivations`: tensor parallelism alone, or with sequence parallelism."""
    group, member = group_of(ctx, case.t)
    if not member:
        return None
    x, _, full = layer_inputs(case)
    w = shard_weights(full, case.heads, ctx["rank"], case.t)
    with SavedActivations(exclude=w.tensors()) as saved:
        if sequence_parallel:
            x_l = shard_sequence(x, ctx["rank"], case.t).clone().requires_grad_(True)
            sequence_parallel_layer(x_l, w, case.heads, group, case.p_drop)
        else:
            parallel_layer(x.clone().requires_grad_(True), w, case.heads, group, case.p_drop)
    return {"bytes": saved.bytes, "stats_elements": saved.stats_elements}


# ---------------------------------------------------------------- async TP (decomposition)


@dataclass(frozen=True)
class MatmulCase:
    """A [t m, b, k] x [k, n] product on t ranks (the sequence split in t shards of m)."""

    seed: int
    m: int
    b: int
    k: int
    n: int
    t: int
    dtype: str = "float64"


def matmul_inputs(case: MatmulCase, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole A [t m, b, k] (the same on every rank), this rank's partial-sum input P [t m, b, k]
    (different per rank) and this rank's weight shard W [k, n]."""
    dt = DTYPES[case.dtype]
    gen = torch.Generator().manual_seed(case.seed)
    a = torch.randn(case.t * case.m, case.b, case.k, generator=gen, dtype=torch.float64).to(dt)
    g = torch.Generator().manual_seed(case.seed * 7919 + rank + 1)
    p = torch.randn(case.t * case.m, case.b, case.k, generator=g, dtype=torch.float64).to(dt)
    w = torch.randn(case.k, case.n, generator=g, dtype=torch.float64).to(dt)
    return a, p, w


def run_decomposition(ctx: dict, case: MatmulCase) -> dict | None:
    """All-gather + matmul and matmul + reduce-scatter, plain and decomposed, on this rank."""
    group, member = group_of(ctx, case.t)
    if not member:
        return None
    a, p, w = matmul_inputs(case, ctx["rank"])
    a_shard = a[ctx["rank"] * case.m : (ctx["rank"] + 1) * case.m]
    out = {}
    for decomposed in (False, True):
        with count_collectives() as counted:
            gathered, ag = async_tp.all_gather_matmul(a_shard, w, group, decomposed=decomposed)
            rs = async_tp.matmul_reduce_scatter(p, w, group, decomposed=decomposed)
        out["decomposed" if decomposed else "plain"] = {
            "a": gathered,
            "ag": ag,
            "rs": rs,
            "counts": dict(counted),
        }
    return out


# ---------------------------------------------------------------- ZeRO


@dataclass(frozen=True)
class ZeroCase:
    """A small MLP (``sizes``: in, hidden..., out) trained ``steps`` Adam steps on n_d data-parallel ranks."""

    seed: int
    sizes: tuple[int, ...]
    n_d: int
    stage: int
    steps: int = 2
    batch: int = 3
    low: str = "float64"
    high: str = "float64"


def zero_model(case: ZeroCase) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """The MLP's parameter shapes (W, b per layer) and its flat initial parameters [Psi] (float64)."""
    shapes = []
    for n_in, n_out in zip(case.sizes[:-1], case.sizes[1:], strict=True):
        shapes += [(n_in, n_out), (n_out,)]
    gen = torch.Generator().manual_seed(case.seed)
    psi = sum(torch.Size(s).numel() for s in shapes)
    return shapes, torch.randn(psi, generator=gen, dtype=torch.float64) * 0.5


def zero_loss_fn(case: ZeroCase, shapes, rank: int, step: int):
    """Rank ``rank``'s loss at ``step``: mean squared error of the MLP on its own micro-batch."""
    gen = torch.Generator().manual_seed(case.seed * 1009 + step * 31 + rank)
    x = torch.randn(case.batch, case.sizes[0], generator=gen, dtype=torch.float64)
    target = torch.randn(case.batch, case.sizes[-1], generator=gen, dtype=torch.float64)

    def loss(flat: torch.Tensor) -> torch.Tensor:
        h, i = x.to(flat.dtype), 0
        views = []
        for s in shapes:
            n = torch.Size(s).numel()
            views.append(flat[i : i + n].view(s))
            i += n
        for layer in range(0, len(views), 2):
            h = h @ views[layer] + views[layer + 1]
            if layer + 2 < len(views):
                h = torch.tanh(h)
        return ((h - target.to(flat.dtype)) ** 2).mean()

    return loss


def nanoparallel_comm(ctx: dict, n: int):
    """A nanoparallel communicator of the first n ranks (shared memory), made once per worker and
    closed by the World when it shuts down."""
    import nanoparallel

    comms = ctx.setdefault("comms", {})
    key = f"parallelism-zero-{n}"
    if key not in comms:
        comms[key] = nanoparallel.init(
            ctx["rank"], n, store=ctx["store"], transport="shm", timeout_s=30.0, name=key
        )
    return comms[key]


def run_zero(ctx: dict, case: ZeroCase) -> dict | None:
    """``case.steps`` steps of ZeRO stage ``case.stage`` (stage 0: plain data parallelism over gloo);
    returns this rank's fp32/fp64 master partition (or whole master for stage 0), its 16-bit weights,
    the losses and the bytes of model states it holds after each step."""
    if ctx["rank"] >= case.n_d:
        return None
    shapes, flat = zero_model(case)
    state = zero_init(flat, case.stage, ctx["rank"], case.n_d, DTYPES[case.low], DTYPES[case.high])
    comm = nanoparallel_comm(ctx, case.n_d) if case.stage else None
    dp_group, _ = group_of(ctx, case.n_d)
    losses, held = [], []
    for step in range(case.steps):
        loss_fn = zero_loss_fn(case, shapes, ctx["rank"], step)
        losses.append(zero_step(state, loss_fn, comm=comm, dp_group=dp_group, lr=1e-2))
        held.append(state.held_bytes())
    return {
        "master": state.master.clone(),
        "params": state.params.clone(),
        "padded": state.padded,
        "losses": losses,
        "held": held,
    }


# ---------------------------------------------------------------- ring attention (repro.usp's ring)


@dataclass(frozen=True)
class RingCase:
    """Attention [B, S, H, D] split over a ring of n ranks, each holding a block of c = S/n tokens."""

    seed: int
    B: int
    c: int
    H: int
    D: int
    n: int
    causal: bool

    @property
    def S(self) -> int:
        return self.c * self.n


def ring_inputs(case: RingCase) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(case.seed)
    return tuple(
        torch.randn(case.B, case.S, case.H, case.D, generator=gen, dtype=torch.float64) for _ in range(4)
    )


def run_ring(ctx: dict, case: RingCase) -> dict | None:
    """repro.usp's ring attention (math local attention, zigzag layout) over the first n ranks: this
    rank's output and gradient blocks, and the bytes its autograd graph keeps for the backward."""
    from repro.usp.layout import shard
    from repro.usp.local import get_backend
    from repro.usp.ring import ring_attention

    group, member = group_of(ctx, case.n)
    if not member:
        return None
    r = ctx["rank"]
    q, k, v, do = (shard(t, case.n, r, "zigzag").clone() for t in ring_inputs(case))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with SavedActivations(exclude=[], norm_stats=False) as saved:
        o = ring_attention(
            q,
            k,
            v,
            causal=case.causal,
            scale=case.D**-0.5,
            group=group,
            layout="zigzag",
            backend=get_backend("math"),
        )
    o.backward(do)
    return {"rank": r, "o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "saved": saved.bytes}


def run_rsa(ctx: dict, case: RingCase) -> dict | None:
    """Ring Self-Attention over the first n ranks, rank r holding the r-th contiguous block."""
    group, member = group_of(ctx, case.n)
    if not member:
        return None
    r, c = ctx["rank"], case.c
    q, k, v, _ = (t[:, r * c : (r + 1) * c] for t in ring_inputs(case))
    with count_collectives() as counted:
        o = ring_self_attention(q, k, v, group)
    return {"o": o, "counts": dict(counted)}


# ---------------------------------------------------------------- pipeline parallelism


@dataclass(frozen=True)
class PipelineCase:
    """A chain of p tanh layers of width h on p ranks, a mini-batch of ``batch`` in m micro-batches."""

    seed: int
    p: int
    m: int
    h: int
    batch: int
    schedule: str


def pipeline_inputs(case: PipelineCase):
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.batch, case.h, generator=gen, dtype=torch.float64)
    target = torch.randn(case.batch, case.h, generator=gen, dtype=torch.float64)
    weights = [
        (torch.randn(case.h, case.h, generator=gen, dtype=torch.float64) * case.h**-0.5,
         torch.randn(case.h, generator=gen, dtype=torch.float64) * 0.1)
        for _ in range(case.p)
    ]  # fmt: skip
    return x, target, weights


def run_pipeline(ctx: dict, case: PipelineCase) -> dict | None:
    """Stage ``rank`` of the pipeline, running its passes in the schedule's order."""
    r = ctx["rank"]
    if r >= case.p:
        return None
    x, target, weights = pipeline_inputs(case)
    ops = SCHEDULES[case.schedule](case.p, case.m)[r]
    dw, db, loss = run_stage(
        ops,
        *weights[r],
        stage=r,
        stages=case.p,
        micro_inputs=split_micro(x, case.m) if r == 0 else None,
        micro_targets=split_micro(target, case.m) if r == case.p - 1 else None,
        batch=case.batch,
        hidden=case.h,
    )
    return {"stage": r, "dw": dw, "db": db, "loss": loss}


# ---------------------------------------------------------------- on GPUs (test_gpu.py)


def gpu_decomposition_rank(rank: int, world: int, port: int, args: dict, results) -> None:
    """One rank per GPU (nanoparallel.launch.spawn_ranks), NCCL with NVLink multicast off: the
    decomposed pairs and PyTorch's symmetric-memory async-TP ops against the plain pairs; puts
    (rank, {name: relative error}, error text or None)."""
    import os

    from paperclub.testing import rel_error
    from repro.parallelism.bench import MULTICAST_OFF, _torch_ops
    from repro.parallelism.comm import all_gather, reduce_scatter

    try:
        os.environ.update(MULTICAST_OFF)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        group = dist.group.WORLD
        ops, name, why = _torch_ops(group)
        errors = {"torch symm_mem": why}
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device="cuda").manual_seed(99 + rank)
            for s, h, n in args["shapes"]:
                a_shard = torch.randn(s // world, h, device="cuda", dtype=dtype, generator=gen)
                w = torch.randn(h, n, device="cuda", dtype=dtype, generator=gen)
                a_row = torch.randn(s, n, device="cuda", dtype=dtype, generator=gen)
                w_row = torch.randn(n, h, device="cuda", dtype=dtype, generator=gen)
                plain_ag = all_gather(a_shard, group, "fwd") @ w
                plain_rs = reduce_scatter(a_row @ w_row, group, "fwd")
                key = f"{str(dtype).split('.')[-1]} s={s} h={h} n={n}"
                ours_ag = async_tp.all_gather_matmul(a_shard, w, group, decomposed=True)[1]
                ours_rs = async_tp.matmul_reduce_scatter(a_row, w_row, group, decomposed=True)
                errors[f"ours ag {key}"] = rel_error(ours_ag.float(), plain_ag.float())
                errors[f"ours rs {key}"] = rel_error(ours_rs.float(), plain_rs.float())
                if ops is not None:
                    try:  # the peer: a failure to run is recorded, not ours to fail on
                        t_ag = ops.fused_all_gather_matmul(a_shard, [w], 0, name, return_A=False)[1][0]
                        t_rs = ops.fused_matmul_reduce_scatter(a_row, w_row, "sum", 0, name)
                        errors[f"torch ag {key}"] = rel_error(t_ag.float(), plain_ag.float())
                        errors[f"torch rs {key}"] = rel_error(t_rs.float(), plain_rs.float())
                    except Exception as exc:  # noqa: BLE001
                        ops, errors["torch symm_mem"] = None, f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, errors, None))
    except BaseException as exc:  # noqa: BLE001 - the parent stops the run with this text
        results.put((rank, None, f"rank {rank}: {type(exc).__name__}: {exc}"))
