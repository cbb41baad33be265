"""Sequence parallelism (korthikanti2022reducing §4.2.2) and the activation-memory count of its §4.

Tensor parallelism leaves the layer norms and dropouts replicated: every rank computes them on, and
keeps for the backward, the whole [s, b, h] activation. Sequence parallelism splits those regions along
the sequence instead (they are independent per token): rank i holds tokens ``i s/t ... (i+1) s/t - 1``.
The all-reduce ``g`` of Megatron becomes a reduce-scatter (``g-bar``: sum the row-parallel partial
outputs and keep one's own tokens) and the identity ``f`` becomes an all-gather (``g``: collect the
tokens before the column-parallel layer); their backwards swap. A ring all-reduce costs one
reduce-scatter plus one all-gather, so the traffic is the same as tensor parallelism's.

The column-parallel layer after the all-gather keeps only this rank's sequence shard of its input and
all-gathers it again in the backward (§4.2.2, last paragraph): with that, every activation of the layer
is divided by t. Per layer, in bytes, for 16-bit activations and one-byte dropout masks (§4.1-4.2,
Eqs. 1, 2 and 4 of arXiv 2205.05198v1):

    no parallelism:                       s b h (34 + 5 a s / h)
    tensor parallelism (t ranks):         s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallelism:        s b h / t (34 + 5 a s / h)

:class:`SavedActivations` measures what the autograd graph keeps (the tensors saved for the backward,
parameters excluded, every byte counted once however many views share it), so the formulas can be
checked exactly. ``overlap=True`` computes the all-gather + matmul and matmul + reduce-scatter pairs with
the decomposed, overlapped loops of :mod:`repro.parallelism.async_tp` (wang2023overlap).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from repro.parallelism import async_tp
from repro.parallelism.comm import all_gather, group_size
from repro.parallelism.megatron import check_divisible
from repro.parallelism.reference import LayerWeights, attention_core, dropout, merge_heads, split_heads

__all__ = [
    "SavedActivations",
    "activation_bytes",
    "sequence_parallel_layer",
    "shard_sequence",
    "unshard_sequence",
]


def shard_sequence(x: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of x [s, b, h]: [s/t, b, h]."""
    s = x.shape[0]
    if s % t:
        raise ValueError(f"shard_sequence: sequence length s={s} is not divisible by t={t}")
    return x[rank * (s // t) : (rank + 1) * (s // t)]


def unshard_sequence(shards: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(shards, dim=0)


class _GatherLinear(torch.autograd.Function):
    """All-gather the sequence shards, then the column-parallel ``Y W + b``; keeps only the shard.

    Forward: x [s/t, b, h] -> [s, b, n_l]. Backward: all-gather x again for dW, and reduce-scatter dX
    (the matmul + reduce-scatter, decomposed when ``overlap``)."""

    @staticmethod
    def forward(ctx, x, w, bias, group, overlap):
        _, out = async_tp.all_gather_matmul(x, w, group, decomposed=overlap, pass_="fwd")
        ctx.save_for_backward(x, w)  # the shard, not the gathered input: §4.2.2
        ctx.group, ctx.overlap = group, overlap
        return out + bias

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        x_full = all_gather(x, ctx.group, "bwd")  # again, instead of keeping it
        dw = torch.einsum("sbi,sbo->io", x_full, grad)
        db = grad.sum(dim=(0, 1))
        dx = async_tp.matmul_reduce_scatter(grad, w.t(), ctx.group, decomposed=ctx.overlap, pass_="bwd")
        return dx, dw, db, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """The row-parallel ``Y W`` summed over the group and scattered along the sequence.

    Forward: y [s, b, n_l] -> [s/t, b, h]. Backward: all-gather the output gradient (fused with the
    matmul for dY, decomposed when ``overlap``)."""

    @staticmethod
    def forward(ctx, y, w, group, overlap):
        ctx.save_for_backward(y, w)
        ctx.group, ctx.overlap = group, overlap
        return async_tp.matmul_reduce_scatter(y, w, group, decomposed=overlap, pass_="fwd")

    @staticmethod
    def backward(ctx, grad):
        y, w = ctx.saved_tensors
        grad_full, dy = async_tp.all_gather_matmul(
            grad, w.t(), ctx.group, decomposed=ctx.overlap, pass_="bwd"
        )
        dw = torch.einsum("sbi,sbo->io", y, grad_full)
        return dy, dw, None, None


def sequence_parallel_layer(
    x: torch.Tensor, w: LayerWeights, heads: int, group, p_drop: float = 0.0, overlap: bool = False
) -> torch.Tensor:
    """A layer with tensor + sequence parallelism. x: [s/t, b, h], this rank's tokens; w: this rank's
    :func:`repro.parallelism.megatron.shard_weights`. Returns this rank's tokens of the output, [s/t, b, h].

    The layer norms' and the replicated biases' gradients are this rank's partial sums (its tokens only):
    add them over the group before an optimizer step (Megatron all-reduces them)."""
    t = group_size(group)
    s_l, b, h = x.shape
    check_divisible(h, heads, w.w_1.shape[1] * t, t, "sequence_parallel_layer")
    y = F.layer_norm(x, (h,), w.ln1_w, w.ln1_b)
    q, k, v = split_heads(_GatherLinear.apply(y, w.w_qkv, w.b_qkv, group, overlap), heads // t)
    attn = _LinearReduceScatter.apply(merge_heads(attention_core(q, k, v, p_drop)), w.w_o, group, overlap)
    x1 = x + dropout(attn + w.b_o, p_drop)
    y2 = F.layer_norm(x1, (h,), w.ln2_w, w.ln2_b)
    hidden = F.gelu(_GatherLinear.apply(y2, w.w_1, w.b_1, group, overlap))
    mlp = _LinearReduceScatter.apply(hidden, w.w_2, group, overlap)
    return x1 + dropout(mlp + w.b_2, p_drop)


class _LayerNormStats(TorchDispatchMode):
    """Notes the storages of every layer norm's mean and 1/std as the op creates them."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_layer_norm.default:
            self.storages.update(t.untyped_storage().data_ptr() for t in out[1:])
        return out


def activation_bytes(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool) -> int:
    """korthikanti2022reducing's activation memory of one layer, in bytes (16-bit activations, 1-byte
    dropout masks; §4.1 Eq. 1 for t = 1, §4.2.1 Eq. 2, §4.2.2 Eq. 4), layer-norm statistics left out as
    the paper does. Exact integers: every term is a whole number of bytes when t divides a and s."""
    if sequence_parallel:
        return (34 * s * b * h + 5 * a * s * s * b) // t
    return 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t


class SavedActivations:
    """Counts the bytes the autograd graph keeps for the backward while the context is open.

    Every tensor saved for the backward (``torch.autograd.graph.saved_tensors_hooks``) is recorded;
    parameters (``exclude``) are not activations and are skipped. Bytes are counted per storage, each
    element once however many saved views cover it (Q, K and V are views of one projection output).
    With ``norm_stats``, the layer norms' per-token mean and 1/std (the second and third outputs of
    ``aten.native_layer_norm``, recognised by their storage as the op returns them), which the paper's
    count leaves out, are counted apart (``stats_elements``); ``bytes`` is the rest."""

    def __init__(self, exclude: list[torch.Tensor], norm_stats: bool = True):
        self._norm_stats = norm_stats
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._stat_storages: set[int] = set()
        self._views: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._stats: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._mode = _LayerNormStats(self._stat_storages) if norm_stats else None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self._excluded:
            (self._stats if key in self._stat_storages else self._views)[key].append(t.detach())
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)

    @staticmethod
    def _covered(groups: dict[int, list[torch.Tensor]]) -> tuple[int, int]:
        """(bytes, elements) covered by the saved views, each element of a storage once."""
        nbytes = elements = 0
        for views in groups.values():
            elem = views[0].element_size()
            index = torch.arange(views[0].untyped_storage().nbytes() // elem)
            covered = torch.cat(
                [index.as_strided(v.shape, v.stride(), v.storage_offset()).reshape(-1) for v in views]
            )
            n = int(covered.unique().numel())
            nbytes, elements = nbytes + n * elem, elements + n
        return nbytes, elements

    @property
    def bytes(self) -> int:
        return self._covered(self._views)[0]

    @property
    def stats_elements(self) -> int:
        return self._covered(self._stats)[1]
