"""Argument checks shared by every KDA entry point: one clear error per kind of bad input."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperclub.triton_compat import interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The Triton kernels hold a [K, BV] state tile and [chunk, K] tiles in registers; these sizes
# are the ones they are written and tested for (256: issue #42, on by default since fla's
# matrix at 192 and 256 passed on an H200, 28 Nov 2026).
TRITON_K = (16, 32, 64, 128, 256)
TRITON_V = (16, 32, 64, 128, 256)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KDADims:
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    fn: str,
    *,
    triton: bool,
    pad_heads: bool = False,
    max_head: int = max(TRITON_K),
) -> KDADims:
    """Check shapes, head grouping, dtypes and devices; return the dimensions.

    Raises ValueError naming the argument, what was got and what was expected.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must be 4-D [B, T, H, K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if _shape(k) != (B, T, H, K):
        raise ValueError(f"{fn}: k must have q's shape [B, T, H, K] = {(B, T, H, K)}, got {_shape(k)}")
    if v.dim() != 4 or v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"{fn}: v must be 4-D [B, T, HV, V] with B={B}, T={T}, got shape {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(
            f"{fn}: the number of value heads HV={HV} (v.shape[2]) must be a multiple of the key heads H={H}"
        )
    if _shape(g) != (B, T, HV, K):
        raise ValueError(
            f"{fn}: g (log-decay) must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {_shape(g)}"
        )
    if _shape(beta) != (B, T, HV):
        raise ValueError(f"{fn}: beta must have shape [B, T, HV] = {(B, T, HV)}, got {_shape(beta)}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise ValueError(
                f"{fn}: initial_state must be a torch.Tensor or None, got {type(initial_state).__name__}"
            )
        if _shape(initial_state) != (B, HV, K, V):
            raise ValueError(
                f"{fn}: initial_state must have shape [B, HV, K, V] = {(B, HV, K, V)}, got {_shape(initial_state)}"
            )
    allowed = TRITON_DTYPES if triton else FLOAT_DTYPES
    names = ", ".join(str(d).replace("torch.", "") for d in allowed)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.dtype not in allowed:
            raise ValueError(f"{fn}: {name} has dtype {t.dtype}; expected one of {names}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{fn}: q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    devices = {t.device for t in (q, k, v, g, beta) if t is not None}
    if initial_state is not None:
        devices.add(initial_state.device)
    if len(devices) > 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if triton and pad_heads:
        # chunk_kda zero-pads other head sizes up to the next kernel size (see chunk.chunk_kda)
        for name, d, arg in (("key", K, "q.shape[-1]"), ("value", V, "v.shape[-1]")):
            if d > max(TRITON_K):
                raise ValueError(
                    f"{fn}: {name} head dim {d} ({arg}) is larger than the Triton kernels take "
                    f"(at most {max(TRITON_K)}, as flash-linear-attention)"
                )
    elif triton:
        sizes_k = tuple(d for d in TRITON_K if d <= max_head)
        sizes_v = tuple(d for d in TRITON_V if d <= max_head)
        if K not in sizes_k:
            raise ValueError(
                f"{fn}: key head dim K={K} is not supported by the Triton kernels; supported: {sizes_k}"
            )
        if V not in sizes_v:
            raise ValueError(
                f"{fn}: value head dim V={V} is not supported by the Triton kernels; supported: {sizes_v}"
            )
    return KDADims(B=B, T=T, H=H, K=K, HV=HV, V=V)


def check_cu_seqlens(
    cu_seqlens: torch.Tensor, T: int, B: int, initial_state, HV: int, K: int, V: int, fn: str
):
    """Packed variable-length batches (flash-linear-attention's ``cu_seqlens``): B must be 1, the
    offsets ``[0, ..., T]`` strictly increasing integers, one initial state per sequence. Returns
    the sequence lengths as a Python list."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D integer tensor of offsets [0, ..., T]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: cu_seqlens must hold int32 or int64 offsets, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(
            f"{fn}: with cu_seqlens the sequences are packed along T: q must have B=1, got B={B}"
        )
    offs = cu_seqlens.tolist()
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != T:
        raise ValueError(f"{fn}: cu_seqlens must start at 0 and end at T={T}, got {offs[:3]}...{offs[-2:]}")
    lengths = [b - a for a, b in zip(offs[:-1], offs[1:], strict=True)]
    bad = [i for i, n in enumerate(lengths) if n <= 0]
    if bad:
        raise ValueError(
            f"{fn}: cu_seqlens must be strictly increasing; sequence {bad[0]} has length {lengths[bad[0]]}"
        )
    N = len(lengths)
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(
            f"{fn}: with cu_seqlens, initial_state holds one state per sequence: shape [N, HV, K, V] = "
            f"{(N, HV, K, V)}, got {tuple(initial_state.shape)}"
        )
    return lengths


def check_kernel_device(x: torch.Tensor, fn: str) -> None:
    """The Triton kernels run on a CUDA device; Triton's interpreter (``TRITON_INTERPRET=1``) also
    takes CPU tensors. Anything else is refused before a launch fails obscurely."""
    if x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"{fn}: the tensors are on {x.device}; the Triton kernels run on a CUDA device "
        "(or on CPU tensors with TRITON_INTERPRET=1, Triton's interpreter)"
    )
