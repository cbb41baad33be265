"""Local attention backends: one block of attention that also returns its log-sum-exp (LSE).

Ring attention (fang2024usp, "SP approaches") merges the blocks of a row exactly through their LSE, and its
backward recomputes each block's probabilities from the row's *final* output and LSE. So a backend
must offer

    forward(q, k, v, causal, scale)  -> (o, lse, aux)
    backward(do, q, k, v, o, lse, causal, scale, aux) -> (dq, dk, dv)

with q [B, S_q, H, D], k/v [B, S_k, H_kv, D], lse [B, H, S_q] in natural log, float32 (float64 for
float64 inputs), and ``backward`` using the o and lse it is given, not those of its own forward.

* ``"math"``: explicit matmuls (:mod:`repro.usp.reference`); any dtype, any device.
* ``"sdpa"`` (default): PyTorch's fused flash attention through the ATen ops that expose the LSE:
  ``_scaled_dot_product_flash_attention`` on CUDA (fp16/bf16; fp32 falls back to ``"math"``
  because the flash kernel has no fp32), ``_scaled_dot_product_flash_attention_for_cpu`` on CPU.
* ``"sdpa_cudnn"``: ``_scaled_dot_product_cudnn_attention`` (CUDA, fp16/bf16): on an H100 the
  fastest of PyTorch's kernels for bf16 at D = 128, and the one ``F.scaled_dot_product_attention``
  picks there (our one-GPU baseline); ATen's flash kernel (``"sdpa"``) is FlashAttention-2 and runs
  at about 0.55x its speed there (results/nvidia-h100-80gb-hbm3.json: usp n=1 with "sdpa" cost 2.09x
  one SDPA call, most of it this).
* ``"auto"`` (the default of :func:`repro.usp.usp_attention`): ``"sdpa_cudnn"`` for CUDA fp16/bf16
  with D <= 128, falling back to ``"sdpa"`` if cuDNN refuses the call; ``"sdpa"`` everywhere else.
* ``"fa4"``: the group's Triton kernels, through :mod:`repro.fa4`'s entry points for callers that
  keep the LSE themselves (:func:`repro.fa4.attention_forward` returns it in natural log,
  :func:`repro.fa4.attention_backward` takes o and LSE as inputs), so they serve the ring as is.
  ``"fa4_gluon"``: the same with fa4's warp-specialised Gluon forward (Hopper only). Both run FA2's
  two-kernel Triton backward (``Switches(bwd="fa2")``), the backward this backend has always run.

GQA: the PyTorch kernels take K/V with as many heads as Q, so those backends expand K/V for each
call and fold dK/dV back; at the lengths this package is for (a block of thousands of tokens) the
copy is a fraction of a percent of the call (a K/V block is read once, its attention is
O(S_q S_k)). fa4 takes GQA natively.
"""

from __future__ import annotations

import torch

from repro.usp import reference

__all__ = ["BACKENDS", "LocalAttention", "get_backend"]


class LocalAttention:
    """Interface; see the module docstring."""

    name = "abstract"

    def forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, do, q, k, v, o, lse, causal: bool, scale: float, aux):
        raise NotImplementedError


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class MathAttention(LocalAttention):
    name = "math"

    def forward(self, q, k, v, causal, scale):
        o, lse = reference.attention_lse(q, k, v, causal, scale)
        return o, lse, None

    def backward(self, do, q, k, v, o, lse, causal, scale, aux):
        return reference.attention_lse_backward(do, q, k, v, o, lse, causal, scale)


def _expand(k: torch.Tensor, h: int) -> torch.Tensor:
    return k if k.shape[2] == h else k.repeat_interleave(h // k.shape[2], dim=2)


def _fold(dk: torch.Tensor, h_kv: int) -> torch.Tensor:
    b, s, h, d = dk.shape
    return dk if h == h_kv else dk.view(b, s, h_kv, h // h_kv, d).sum(3)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> the [B, H, S, D] view the SDPA ops take (no copy)."""
    return t.transpose(1, 2)


class SdpaAttention(LocalAttention):
    """PyTorch's fused kernels through the ATen ops that return the LSE (GQA by expanding K/V)."""

    name = "sdpa"

    def _fallback(self, q) -> bool:
        return q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal, scale):
        if self._fallback(q):
            return MathAttention().forward(q, k, v, causal, scale)
        h = q.shape[2]
        qt, kt, vt = _bhsd(q), _bhsd(_expand(k, h)), _bhsd(_expand(v, h))
        if q.device.type == "cuda":
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, causal, False, scale=scale
            )
            o, lse = out[0], out[1]
            aux = (out[2], out[3], out[6], out[7])  # cum_seq_q/k, rng state: unused without dropout
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, scale=scale
            )
            aux = None
        return o.transpose(1, 2), lse.to(_lse_dtype(q.dtype)), aux

    def backward(self, do, q, k, v, o, lse, causal, scale, aux):
        if self._fallback(q):
            return MathAttention().backward(do, q, k, v, o, lse, causal, scale, None)
        h, h_kv = q.shape[2], k.shape[2]
        qt, kt, vt = _bhsd(q), _bhsd(_expand(k, h)), _bhsd(_expand(v, h))
        dot, ot = _bhsd(do.to(q.dtype)), _bhsd(o.to(q.dtype))
        if q.device.type == "cuda":
            cum_q, cum_k, seed, offset = aux
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot, qt, kt, vt, ot, lse.float().contiguous(), cum_q, cum_k,
                q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale,
            )  # fmt: skip
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse.contiguous(), 0.0, causal, scale=scale
            )
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, _fold(dk, h_kv), _fold(dv, h_kv)


class CudnnAttention(SdpaAttention):
    """cuDNN's fused attention (CUDA, fp16/bf16); the LSE comes back as [B, H, S_q, 1] there."""

    name = "sdpa_cudnn"

    def forward(self, q, k, v, causal, scale):
        if q.device.type != "cuda" or self._fallback(q):
            raise RuntimeError(
                f"local attention 'sdpa_cudnn' needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}"
            )
        h = q.shape[2]
        qt, kt, vt = _bhsd(q), _bhsd(_expand(k, h)), _bhsd(_expand(v, h))
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
        o, lse = out[0], out[1]
        aux = (out[2], out[3], out[6], out[7], lse.dim())
        return o.transpose(1, 2), lse.reshape(lse.shape[:3]).float(), aux

    def backward(self, do, q, k, v, o, lse, causal, scale, aux):
        cum_q, cum_k, seed, offset, lse_dim = aux
        h, h_kv = q.shape[2], k.shape[2]
        qt, kt, vt = _bhsd(q), _bhsd(_expand(k, h)), _bhsd(_expand(v, h))
        dot, ot = _bhsd(do.to(q.dtype).contiguous()), _bhsd(o.to(q.dtype).contiguous())
        lse = lse.float().contiguous()
        if lse_dim == 4:
            lse = lse[..., None]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse, seed, offset, None, cum_q, cum_k,
            q.shape[1], k.shape[1], 0.0, causal, scale=scale,
        )  # fmt: skip
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, _fold(dk, h_kv), _fold(dv, h_kv)


class Fa4Attention(LocalAttention):
    """repro.fa4's kernels through its public :func:`~repro.fa4.attention_forward` (the forward and its
    natural-log LSE) and :func:`~repro.fa4.attention_backward` (gradients from a given o and LSE), with
    ``Switches(gluon=gluon, bwd="fa2")``: the Triton forward (or, with ``gluon=True``, the Gluon
    forward) and FA2's two-kernel Triton backward. Every use of repro.fa4 in this package is here.

    Why ``bwd="fa2"``: it is the backward this backend ran before fa4 had public entry points (the
    internal dispatch ran "fa2" for a config resolved without tensors), so the ring's GPU tests and
    benchmark rows stay comparable; fa4's own default on Hopper is now its Gluon backward.

    Limits are fa4's: fp16/bf16 (fp32 too under the interpreter), head sizes up to 256 (64 and 128 are
    the GPU-verified tiles; others are padded to a tile), CUDA or TRITON_INTERPRET=1; ``gluon=True``
    needs a Hopper GPU and D 64 or 128. fa4 checks the inputs and names what is wrong.
    """

    def __init__(self, gluon: bool = False):
        self.gluon = gluon
        self.name = "fa4_gluon" if gluon else "fa4"

    def _config(self, q):
        from paperclub.triton_compat import interpreting
        from repro.fa4 import Switches

        if q.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"local attention '{self.name}' needs CUDA, or TRITON_INTERPRET=1 on CPU")
        if self.gluon and q.device.type != "cuda":
            raise RuntimeError("local attention 'fa4_gluon' is a Hopper GPU kernel; it does not run on CPU")
        return Switches(gluon=self.gluon, bwd="fa2")

    def forward(self, q, k, v, causal, scale):
        from repro.fa4 import attention_forward

        o, lse = attention_forward(q, k, v, causal=causal, scale=scale, config=self._config(q))
        return o, lse, None

    def backward(self, do, q, k, v, o, lse, causal, scale, aux):
        from repro.fa4 import attention_backward

        # attention_backward makes its inputs contiguous (the ring hands in slices of its local
        # sequence) and casts do and o to q's dtype
        return attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, config=self._config(q))


class AutoAttention(LocalAttention):
    """cuDNN where it applies (CUDA fp16/bf16, D <= 128, D % 8 == 0), else ``"sdpa"``; a call cuDNN
    refuses (an unsupported shape raises before any kernel runs) goes to ``"sdpa"``, and its backward
    follows whichever backend ran the forward (recorded in ``aux``)."""

    name = "auto"

    def __init__(self):
        self._cudnn, self._sdpa = CudnnAttention(), SdpaAttention()

    def _wants_cudnn(self, q) -> bool:
        d = q.shape[-1]
        return (
            q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and d <= 128 and d % 8 == 0
        )

    def forward(self, q, k, v, causal, scale):
        if self._wants_cudnn(q):
            try:
                o, lse, aux = self._cudnn.forward(q, k, v, causal, scale)
                return o, lse, ("cudnn", aux)
            except RuntimeError:
                pass
        o, lse, aux = self._sdpa.forward(q, k, v, causal, scale)
        return o, lse, ("sdpa", aux)

    def backward(self, do, q, k, v, o, lse, causal, scale, aux):
        which, inner = aux
        be = self._cudnn if which == "cudnn" else self._sdpa
        return be.backward(do, q, k, v, o, lse, causal, scale, inner)


BACKENDS = {
    "auto": AutoAttention(),
    "math": MathAttention(),
    "sdpa": SdpaAttention(),
    "sdpa_cudnn": CudnnAttention(),
    "fa4": Fa4Attention(),
    "fa4_gluon": Fa4Attention(gluon=True),
}


def get_backend(backend: str | LocalAttention) -> LocalAttention:
    """A backend by name (``"auto"``, ``"sdpa"``, ``"math"``, ``"sdpa_cudnn"``, ``"fa4"``,
    ``"fa4_gluon"``) or an instance."""
    if isinstance(backend, LocalAttention):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"usp_attention: backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend]
