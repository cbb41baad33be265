"""The single-device transformer layer that tensor and sequence parallelism split: the ground truth.

The GPT layer of shoeybi2019megatron §3 (Fig. 2) and korthikanti2022reducing §4.1 (Fig. 3), in their
[s, b, h] layout (sequence, batch, hidden), with the paper's symbols: ``a`` attention heads of size
``d = h / a``, an MLP of width ``4h``, pre-layer-norm residual blocks:

    X1 = X + Dropout(Attention(LayerNorm1(X)))        Attention: Q, K, V = Y W_q, Y W_k, Y W_v (a heads)
    X2 = X1 + Dropout(MLP(LayerNorm2(X1)))             MLP(Y) = GeLU(Y A + b_A) B + b_B

Linear layers are written ``Y W + b`` with ``W`` [in, out], as the papers write ``XA``. Dropout is
``torch.native_dropout`` (its backward keeps a one-byte mask, which is what korthikanti2022reducing §4.1
counts); p = 0 makes the layer deterministic for the equivalence tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

__all__ = ["LayerWeights", "attention_core", "dropout", "init_weights", "reference_layer"]


@dataclass
class LayerWeights:
    """One transformer layer's parameters (the whole layer, or one rank's shard of it).

    ``w_qkv`` [h, 3 h_l] holds the Q, K and V projections side by side, each grouped by head; ``w_o``
    [h_l, h] the output projection; ``w_1`` [h, f_l] and ``w_2`` [f_l, h] the MLP's A and B (f = 4h).
    On a tensor-parallel rank, h_l = h / t and f_l = 4h / t (its heads and its MLP columns)."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    w_o: torch.Tensor
    b_o: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    w_1: torch.Tensor
    b_1: torch.Tensor
    w_2: torch.Tensor
    b_2: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def names(self) -> list[str]:
        return [f.name for f in fields(self)]

    def map(self, fn) -> LayerWeights:
        return LayerWeights(*(fn(t) for t in self.tensors()))


def init_weights(
    h: int, seed: int, dtype: torch.dtype = torch.float64, ffn: int | None = None
) -> LayerWeights:
    """A layer's weights drawn from ``seed`` (the same on every process), leaves that require grad."""
    ffn = 4 * h if ffn is None else ffn
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift
        return t.to(dtype).requires_grad_(True)

    return LayerWeights(
        ln1_w=draw(h, scale=0.1, shift=1.0),
        ln1_b=draw(h, scale=0.1),
        w_qkv=draw(h, 3 * h, scale=h**-0.5),
        b_qkv=draw(3 * h, scale=0.1),
        w_o=draw(h, h, scale=h**-0.5),
        b_o=draw(h, scale=0.1),
        ln2_w=draw(h, scale=0.1, shift=1.0),
        ln2_b=draw(h, scale=0.1),
        w_1=draw(h, ffn, scale=h**-0.5),
        b_1=draw(ffn, scale=0.1),
        w_2=draw(ffn, h, scale=ffn**-0.5),
        b_2=draw(h, scale=0.1),
    )


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout whose backward keeps only the boolean mask (1 byte per element)."""
    return torch.native_dropout(x, p, True)[0]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_attn: float) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) with dropout, times V. q, k, v: [b, a, s, d] -> [b, a, s, d].

    Saved for the backward (korthikanti2022reducing §4.1): Q and K (by the first product), the softmax
    output, the dropout mask and the dropout output (by the second product) and V."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    probs = dropout(torch.softmax(scores, dim=-1), p_attn)
    return torch.matmul(probs, v)


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, 3 a d] (Q | K | V, each grouped by head) -> three [b, a, s, d] views."""
    s, b, three_hd = qkv.shape
    d = three_hd // (3 * heads)
    q, k, v = qkv.view(s, b, 3, heads, d).permute(2, 1, 3, 0, 4).unbind(0)
    return q, k, v


def merge_heads(ctx: torch.Tensor) -> torch.Tensor:
    """[b, a, s, d] -> [s, b, a d]."""
    b, a, s, d = ctx.shape
    return ctx.permute(2, 0, 1, 3).reshape(s, b, a * d)


def reference_layer(x: torch.Tensor, w: LayerWeights, heads: int, p_drop: float = 0.0) -> torch.Tensor:
    """The whole layer on one device. x: [s, b, h] -> [s, b, h]; ``heads`` = a must divide h."""
    s, b, h = x.shape
    if h % heads:
        raise ValueError(f"reference_layer: hidden size h={h} is not divisible by heads a={heads}")
    y = F.layer_norm(x, (h,), w.ln1_w, w.ln1_b)
    q, k, v = split_heads(y @ w.w_qkv + w.b_qkv, heads)
    attn = merge_heads(attention_core(q, k, v, p_drop)) @ w.w_o + w.b_o
    x1 = x + dropout(attn, p_drop)
    y2 = F.layer_norm(x1, (h,), w.ln2_w, w.ln2_b)
    mlp = F.gelu(y2 @ w.w_1 + w.b_1) @ w.w_2 + w.b_2
    return x1 + dropout(mlp, p_drop)
