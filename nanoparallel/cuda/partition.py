"""How a call's elements are cut up: among programs, into pipeline steps, into per-rank slices.

Host arithmetic only (no torch, no Triton), shared by the backend (``backend.py``) and every
collective's launcher (``all_reduce.py``, ``reduce_scatter.py``, ``all_gather.py``,
``broadcast.py``, ``all_to_all.py``); the CPU tests compute the same launches with it.
"""

from __future__ import annotations

# 8 KiB per program per step: 8 warps x 32 threads x 32 bytes, two 16-byte vectors per thread
STEP_BYTES = 8192
NUM_WARPS = 8


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def split_work(n: int, max_programs: int, step: int) -> tuple[int, int]:
    """(elements per program, programs) for n elements: a multiple of ``step`` each, few programs
    for small n (each program costs a barrier round trip), at most ``max_programs`` for large n."""
    chunk = _round_up(max(-(-n // max_programs), 1), step)
    return chunk, max(1, -(-n // chunk))


def slice_size(n: int, world_size: int) -> int:
    """Elements each rank owns in two-shot and ring all-reduce: 64-element (256-byte) aligned."""
    return _round_up(-(-n // world_size), 64)


def ring_barriers(world_size: int, gather: bool) -> int:
    """Barriers in one ring call: after the copy-in, between reduce steps, between copy steps."""
    return 2 * world_size - 2 if gather else world_size - 1


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pipeline_steps(chunk: int, steps: int, block: int) -> tuple[int, int]:
    """(elements per step, steps) for a program range of ``chunk`` elements cut into at most
    ``steps`` steps of whole ``block``s; fewer steps when the range is short."""
    sub = _round_up(max(-(-chunk // max(steps, 1)), 1), block)
    return sub, max(1, -(-chunk // sub))
