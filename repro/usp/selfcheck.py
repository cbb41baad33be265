"""Check USP on a real world: ``torchrun --nproc-per-node G -m repro.usp.selfcheck [--dtype bf16]``.

Every rank builds the same full inputs, takes its shard, runs :func:`repro.usp.usp_attention` forward
and backward for every factorisation P_u x P_r of the world (P_u dividing the heads), both layouts,
causal and not, and compares its output and gradient shards with single-device attention computed
on its own device. NCCL on GPUs (one per rank, ``LOCAL_RANK``), gloo on CPU. Rank 0 prints a table;
the exit status is 1 if any case exceeds the tolerance (float32: 1e-4 with TF32 off; bf16: 2e-2).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from paperclub.testing import rel_error
from repro.usp import make_groups, shard, usp_attention
from repro.usp.reference import attention


def run_checks(
    *, dtype: torch.dtype, seq: int, backend: str, device, head_groups: int = 1, groups=None
) -> tuple[list[str], int]:
    """Every factorisation, layout and mask on the initialised world; returns (table rows, failures).
    Collective: every rank calls it with the same arguments. ``groups(P_u, P_r)`` gives the (Ulysses,
    ring) groups of a mesh, default :func:`repro.usp.make_groups` (new groups on every call); a caller
    that checks several times passes a cache, so that each mesh's communicators are made once."""
    groups = groups or make_groups
    world = dist.get_world_size()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    B, H, H_kv, D = 2, 8, 2, 64
    S = seq or 16 * world
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(B, S, h, D, generator=gen).to(device, dtype) for h in (H, H_kv, H_kv, H)]
    leaves = [t.detach().float().clone().requires_grad_(True) for t in full[:3]]
    failed = 0
    rows = []
    for causal in (False, True):
        for t in leaves:
            t.grad = None
        o_ref = attention(*leaves, causal=causal)
        o_ref.backward(full[3].float())
        ref = [o_ref.detach(), *(t.grad for t in leaves)]
        for pu in [u for u in range(1, world + 1) if world % u == 0 and H % u == 0]:
            ug, rg = groups(pu, world // pu)
            sp_rank = dist.get_rank(rg) * pu + dist.get_rank(ug)
            for layout in ("zigzag", "contiguous"):
                q, k, v, do = (shard(t, world, sp_rank, layout).clone() for t in full)
                q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                o = usp_attention(
                    q, k, v, causal=causal, ulysses_group=ug, ring_group=rg, layout=layout,
                    backend=backend, head_groups=head_groups,
                )  # fmt: skip
                o.backward(do)
                errs = [
                    rel_error(got.float(), shard(want, world, sp_rank, layout))
                    for got, want in zip((o.detach(), q.grad, k.grad, v.grad), ref, strict=True)
                ]
                worst = torch.tensor([max(errs)], device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                ok = worst.item() <= tol
                failed += not ok
                rows.append(
                    f"{pu}x{world // pu:<3d} causal={causal!s:5s} {layout:10s} {worst.item():.2e} {'ok' if ok else 'FAIL'}"
                )
    return rows, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default 16 x world size)")
    ap.add_argument("--backend", default="auto", help="local attention: auto, sdpa, sdpa_cudnn, math, fa4")
    ap.add_argument("--head-groups", type=int, default=1, help="Ulysses pipeline head groups (ring degree 1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rows, failed = run_checks(
        dtype=dtype, seq=args.seq, backend=args.backend, device=device, head_groups=args.head_groups
    )
    if dist.get_rank() == 0:
        S = args.seq or 16 * dist.get_world_size()
        print(
            f"USP selfcheck: world {dist.get_world_size()}, {args.dtype}, backend {args.backend}, "
            f"head groups {args.head_groups}, S = {S}, tolerance {1e-4 if dtype == torch.float32 else 2e-2:g}"
        )
        print("\n".join(rows))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
