"""Host time of one decode step, without a GPU: how long ``nsa_decode`` keeps the CPU busy per call.

    python -m repro.nsa.lab.decode_host [--b 16] [--t 8192] [--heads 128 | 192,128] [--calls 200]
    python -m repro.nsa.lab.decode_host --legacy ...   # run from a checkout before the stage split

A decode step is two Triton launches around one ``torch.topk`` (decode.py), a few microseconds of GPU
work at short caches, so its time on the GPU is the host's: the input checks, the allocations, the
launches' argument binding. This runs the step on CPU tensors with every kernel replaced by a
recorder (``launches.gpu_launchers``: the kernels do not run, ``topk`` does, on zeros), and reports
microseconds per call over ``--calls`` calls after 20 warm-up calls, and the launches per call. The
stubbed launches cost less than Triton's own launch path, which is the same for the same kernel and
arguments; what this compares is the Python around them, before and after a change of files.

``--legacy`` drives ``launches.LegacyApi`` (``ops.nsa_decode``, main before the stage split of issue
#40). To use it, put this file and ``launches.py`` on the path of a checkout of that commit (for
example ``git worktree add /tmp/old 66d26a2~1`` and ``PYTHONPATH=/tmp/old/site:/tmp/old:<dir with the
two files>``, the import below then falling back to a top-level ``launches``).
"""

from __future__ import annotations

import argparse
import time

try:
    from repro.nsa.lab import launches as ln  # first: it removes TRITON_INTERPRET before Triton loads
except ImportError:  # a checkout without lab/ (see the docstring)
    import launches as ln  # type: ignore[no-redef]

import torch  # noqa: E402


def decode_inputs(ref, cfg, b: int, t: int, hq: int, h: int, dk: int, dv: int, dtype=torch.bfloat16):
    """Zero caches of ``t`` tokens for a batch of ``b``, in the layout ``nsa_decode`` takes."""
    nc = ref.num_compressed(t, cfg.block_len, cfg.stride)

    def z(*shape):
        return torch.zeros(*shape, dtype=dtype)

    return (z(b, 1, hq, dk), z(b, nc, h, dk), z(b, nc, h, dv), z(b, t, h, dk), z(b, t, h, dv),
            z(b, t, h, dk), z(b, t, h, dv), z(b, 1, hq, 3))  # fmt: skip


def host_us(api, args, cfg, calls: int) -> tuple[float, float]:
    """(microseconds per call, launches per call) of ``api.decode`` with stubbed kernels."""
    rec = ln.Recorder()
    with ln.gpu_launchers(api.modules, api.checks, rec):
        for _ in range(20):
            api.decode(args, cfg)
        rec.launches.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            api.decode(args, cfg)
        per_call = (time.perf_counter() - t0) / calls
    return per_call * 1e6, len(rec.launches) / calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=16)
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--heads", default="128", help="Dk,Dv or one D (default 128)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--legacy", action="store_true", help="main before the stage split (see the docstring)")
    args = ap.parse_args(argv)
    try:
        dk, dv = (int(x) for x in (args.heads.split(",") * 2)[:2])
    except ValueError:
        raise SystemExit(f"--heads {args.heads!r}: expected Dk,Dv or one D, integers") from None
    if min(args.b, args.t, args.calls, dk, dv) < 1:
        raise SystemExit("--b, --t, --calls and the head sizes must be positive")
    api = ln.LegacyApi() if args.legacy else ln.Api()
    cfg = api.ref.NSAConfig()
    inputs = decode_inputs(api.ref, cfg, args.b, args.t, 64, 4, dk, dv)
    us, n = host_us(api, inputs, cfg, args.calls)
    layout = "legacy (ops.py)" if args.legacy else "stages"
    print(
        f"{layout}: B={args.b} T={args.t} Dk={dk} Dv={dv}: {us:.1f} us of host time per call, {n:.0f} launches"
    )


if __name__ == "__main__":
    main()
