"""What one layer forward and one backward ask of the GPU besides their matmuls, counted without a GPU.

    python -m repro.nsa.lab.fixed_costs [--t 8192] [--heads 192,128] [--dtype bf16] [--json]

Runs ``layer.nsa_attention``'s forward and backward at the paper's configuration on CPU tensors with
every Triton kernel replaced by a recorder at its GPU launch shape (``launches.gpu_launchers``: the
kernels do not run, their outputs are left as allocated), under a dispatch mode that records every
aten op. Per phase (forward, backward) it prints each Triton launch with its grid (programs), each
aten op that does work on the device (allocations and views left out, ``FREE``) with the bytes it
reads and writes, and the ops that would make the host wait for the GPU (``SYNC``: a value read back,
a data-dependent shape, a device-to-host copy). At short lengths (8k-16k) these fixed costs are a
larger share of the layer's time than at 64k: the counts say where they are; how long each takes needs
a GPU profile (``lab/breakdown`` times the forward's stages; torch.profiler on the GPU the rest).

Counts only: the compression MLP and the projections are outside ``nsa_attention`` and not counted.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from repro.nsa.lab import launches as ln  # first: it removes TRITON_INTERPRET before Triton loads

#: aten ops that only allocate or reinterpret memory: no device work
FREE = {
    "empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default", "view.default",
    "unsqueeze.default", "alias.default", "slice.Tensor", "select.int", "detach.default",
    "_unsafe_view.default", "expand.default", "t.default", "transpose.int", "permute.default",
    "as_strided.default", "lift_fresh.default", "unbind.int", "split.Tensor", "squeeze.dim",
}  # fmt: skip
#: aten ops that make the host wait for the device (values read back, data-dependent shapes)
SYNC = {
    "_local_scalar_dense.default",
    "nonzero.default",
    "is_nonzero.default",
    "equal.default",
    "item.default",
}


class _Grids(ln.Recorder):
    """A recorder that keeps each launch's grid (a callable grid evaluated for the launch's BM, as
    the score kernel's autotuner would with any of its configs, all BM = 64)."""

    def stub(self, kernel):
        rec = self

        class Stub:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    g = grid({"BM": kwargs.get("BM", 64)}) if callable(grid) else grid
                    programs = 1
                    for x in g:
                        programs *= int(x)
                    name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
                    rec.launches.append(ln.Launch(rec.scenario, name, args, {"programs": programs}))

                return launch

        return Stub()


def count(t: int = 8192, dk: int = 192, dv: int = 128, dtype: str = "bfloat16", b: int = 1, hq: int = 64,
          h: int = 4) -> dict:  # fmt: skip
    """{"forward" | "backward": {"launches": [(kernel, programs)], "ops": Counter of work ops,
    "bytes": {op: bytes read + written}, "sync": [ops]}} of one layer forward and backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    api = ln.Api()
    ref = api.ref
    cfg = ref.NSAConfig()
    dt = getattr(torch, dtype)
    phase = {"name": "forward"}
    result = {
        p: {"launches": [], "ops": Counter(), "bytes": Counter(), "sync": []} for p in ("forward", "backward")
    }

    def nbytes(x) -> int:
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func).removeprefix("aten.")
            r = result[phase["name"]]
            if name in SYNC:
                r["sync"].append(name)
            if name not in FREE:
                r["ops"][name] += 1
                flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple | list) else [out])]
                r["bytes"][name] += sum(nbytes(x) for x in flat)
            return out

    q = torch.zeros(b, t, hq, dk, dtype=dt)
    ks = [torch.zeros(b, t, h, dk, dtype=dt) for _ in range(3)]
    vs = [torch.zeros(b, t, h, dv, dtype=dt) for _ in range(3)]
    kc = ref.compress(ks[0], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    vc = ref.compress(vs[0], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    gates = torch.zeros(b, t, hq, 3, dtype=dt)
    leaves = [x.requires_grad_() for x in (q, kc, vc, ks[1], vs[1], ks[2], vs[2], gates)]
    rec = _Grids()
    with ln.gpu_launchers(api.modules, api.checks, rec):
        with Ops():
            o, _ = api.nsa_attention(leaves, cfg)
        result["forward"]["launches"] = [(x.kernel, x.kwargs["programs"]) for x in rec.launches]
        n = len(rec.launches)
        phase["name"] = "backward"
        do = torch.zeros_like(o)
        with Ops():
            torch.autograd.grad(o, leaves, do, allow_unused=True)
        result["backward"]["launches"] = [(x.kernel, x.kwargs["programs"]) for x in rec.launches[n:]]
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--heads", default="192,128", help="Dk,Dv or one D")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON object instead")
    args = ap.parse_args(argv)
    heads = [int(x) for x in args.heads.split(",")]
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype]
    res = count(args.t, heads[0], heads[-1], dtype)
    if args.json:
        print(
            json.dumps({p: {**r, "ops": dict(r["ops"]), "bytes": dict(r["bytes"])} for p, r in res.items()})
        )
        return 0
    for phase, r in res.items():
        work = sum(r["ops"].values())
        print(f"{phase} at T = {args.t}, heads {args.heads}: {len(r['launches'])} Triton launches, "
              f"{work} aten ops with device work, {len(r['sync'])} host synchronisations")  # fmt: skip
        for kernel, programs in r["launches"]:
            print(f"  triton {kernel:30s} {programs:9d} programs")
        for op, n in r["ops"].most_common():
            print(f"  aten   {op:30s} x{n:<3d} {r['bytes'][op] / 2**20:10.1f} MiB read + written")
        for op in r["sync"]:
            print(f"  SYNC   {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
