"""The models: a small decoder-only target, the DFlash block-diffusion drafter, and a KV cache.

* :class:`Target`: pre-norm decoder (RMSNorm, rotary positions, SDPA attention, GELU MLP), byte
  vocabulary. It can return the hidden states of chosen layers, which DFlash reads (chen2026dflash,
  "target context features").
* :class:`KVCache`: preallocated keys and values with a length pointer; rolling back a rejected draft
  is ``cache.crop(n)``, O(1).
* :class:`DFlashDrafter`: the drafter of chen2026dflash. The concatenated target features are fused
  by a linear layer and RMSNorm into one context vector per position; every draft layer projects
  them with its own K/V weights and puts them in front of the block's keys and values (KV
  injection); the block ``[anchor, MASK x (B-1)]`` attends to them and to itself without a causal
  mask; the target's embedding and LM head are shared and frozen. ``DrafterConfig.injection =
  "input"`` builds the ablation of chen2026dflash §5.5.5 instead (the features enter only as the
  context's input to the first layer and go through the layers causally, like tokens).

The EAGLE-3-style baseline drafter is in ``eagle.py``; it reuses :class:`Block` and :class:`KVCache`.

Shapes: token ids ``[b, T]``; hidden ``[b, T, d]``; keys/values ``[b, H, T, d/H]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TargetConfig:
    """Size of a :class:`Target` (also used for the autoregressive baseline drafter)."""

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    max_len: int = 1024  # longest sequence a KV cache holds (rotary tables are built to this length)
    mlp_mult: int = 4

    def __post_init__(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"TargetConfig: d_model={self.d_model} must split into n_heads={self.n_heads} heads of even size"
            )
        for name in ("vocab_size", "n_layers", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TargetConfig: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DrafterConfig:
    """Size of a :class:`DFlashDrafter`; width and heads are the target's.

    ``feature_layers``: which target layers' outputs are read (None: ``n_features`` layers spread
    evenly over the target's depth, see :func:`spread_layers`). ``injection``: see below.
    """

    n_layers: int = 2
    n_features: int = 3
    feature_layers: tuple[int, ...] | None = None
    max_block: int = 16
    # where the fused target features enter: "kv", the paper's KV injection (every layer projects
    # them into its own keys and values); "input", the ablation of chen2026dflash §5.5.5 (EAGLE-3
    # style input fusion: the features are the context positions' input to the first layer and go
    # through the drafter's layers like tokens, so deeper layers see them only as processed there)
    injection: str = "kv"

    def __post_init__(self):
        if self.injection not in ("kv", "input"):
            raise ValueError(f"DrafterConfig: injection must be 'kv' or 'input', got {self.injection!r}")


def spread_layers(n_target_layers: int, k: int) -> tuple[int, ...]:
    """``k`` target layer indices spread evenly from the second layer to the second-to-last.

    (chen2026dflash: features "from shallow to deep"; the first and last layers are skipped when the
    target is deep enough.) Returns 0-based indices of layer *outputs*.
    """
    if k < 1 or k > n_target_layers:
        raise ValueError(f"spread_layers: k must be in [1, n_target_layers={n_target_layers}], got {k}")
    lo, hi = (1, n_target_layers - 2) if n_target_layers - 2 >= k else (0, n_target_layers - 1)
    if k == 1:
        return ((lo + hi) // 2,)
    return tuple(round(lo + i * (hi - lo) / (k - 1)) for i in range(k))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)  # one op: launches count here


class Rotary(nn.Module):
    """Rotary position embedding tables for positions ``0..max_len-1`` (half-split convention)."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotation for positions ``[T]`` or ``[b, T]``, built once per model forward and shared
        by every layer. For positions ``[T]`` it is one ``[T, Dh, Dh]`` matrix per position, applied
        with one batched matmul (instead of seven elementwise kernels: at this model size every
        kernel launch counts); per-batch positions (the drafter's training) use cos/sin."""
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        if cos.dim() == 3:  # per-batch positions [b, T, Dh/2] -> [b, 1, T, Dh/2]
            return Rope(cos[:, None], sin[:, None])
        c, s = torch.diag_embed(cos), torch.diag_embed(sin)  # [T, Dh/2, Dh/2]
        # row vector x = [x1, x2] times [[C, S], [-S, C]] = [x1 C - x2 S, x1 S + x2 C]
        return Rope(cos, sin, torch.cat([torch.cat([c, s], -1), torch.cat([-s, c], -1)], -2))


class Rope:
    """Rotary embedding at fixed positions: ``rope(x)`` rotates x ``[..., b, H, T, Dh]``
    (half-split convention: the first and second halves of Dh are the two coordinates)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, matrix: torch.Tensor | None = None):
        self.cos, self.sin, self.matrix = cos, sin, matrix

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.matrix is not None:
            return torch.einsum("...td,tde->...te", x, self.matrix.to(x.dtype))
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class KVCache:
    """Keys and values of every layer in preallocated ``[L, b, H, max_len, Dh]`` buffers.

    ``length`` positions are valid. Speculative decoding writes a whole drafted block and then
    rolls back the rejected part with :meth:`crop` (no copy).
    """

    def __init__(self, n_layers, batch, n_heads, max_len, head_dim, device, dtype):
        self.k = torch.zeros(n_layers, batch, n_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.max_len = max_len

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions (KV-cache rollback after a rejected draft)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"KVCache.crop: n must be in [0, length={self.length}], got {n}")
        self.length = n

    def check_room(self, t: int) -> None:
        if self.length + t > self.max_len:
            raise ValueError(
                f"KVCache: {self.length} cached + {t} new positions exceed max_len={self.max_len}; "
                "build the model with a larger max_len or generate fewer tokens"
            )


def _mlp(d: int, mult: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, mult * d, bias=False), nn.GELU(), nn.Linear(mult * d, d, bias=False))


class Block(nn.Module):
    """One pre-norm decoder layer with causal self-attention."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.attn_norm = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.mlp = _mlp(d, cfg.mlp_mult)

    def forward(self, x, rope, layer=None, cache=None, attn_mask=None):
        b, t, d = x.shape
        h = self.n_heads
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k = rope(qkv[:2]).unbind(0)  # q and k rotated in one go
        v = qkv[2]
        if cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=attn_mask is None, attn_mask=attn_mask)
        else:
            n = cache.length
            cache.k[layer, :, :, n : n + t] = k
            cache.v[layer, :, :, n : n + t] = v
            k_all, v_all = cache.k[layer, :, :, : n + t], cache.v[layer, :, :, : n + t]
            a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))

    def forward_static(self, x, rope, layer, cache, positions, mask):
        """The capturable form of :meth:`forward` (no host value decides a shape or an index): the new
        keys and values are written at the device positions ``positions [t]`` by ``index_copy_``,
        and the queries attend to the whole preallocated cache under ``mask [t, max_len]``."""
        b, t, d = x.shape
        h = self.n_heads
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k = rope(qkv[:2]).unbind(0)
        a = _attend_cache(q, k, qkv[2], cache, layer, positions, mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))


def _attend_cache(q, k, v, cache: KVCache, layer: int, positions, mask) -> torch.Tensor:
    """Write k, v ``[b, H, t, Dh]`` into layer ``layer`` of the cache at ``positions [t]`` (a device
    tensor) and attend with q over all ``max_len`` cached positions; ``mask`` hides the stale ones."""
    cache.k[layer].index_copy_(2, positions, k)
    cache.v[layer].index_copy_(2, positions, v)
    return F.scaled_dot_product_attention(q, cache.k[layer], cache.v[layer], attn_mask=mask)


def causal_offset_mask(n_cached: int, t: int, device) -> torch.Tensor | None:
    """Boolean ``[t, n_cached + t]`` mask: new position i sees cached positions and new ones <= i."""
    if t == 1:
        return None
    cols = torch.arange(n_cached + t, device=device)
    rows = torch.arange(t, device=device) + n_cached
    return cols[None, :] <= rows[:, None]


class Target(nn.Module):
    """The target model: a small decoder-only transformer over bytes."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.d_model // cfg.n_heads, cfg.max_len)
        self.apply(_init)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, batch: int = 1) -> KVCache:
        c = self.cfg
        return KVCache(
            c.n_layers, batch, c.n_heads, c.max_len, c.d_model // c.n_heads, self.device, self.dtype
        )

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids ``[b, t]`` -> logits ``[b, t, V]`` and the concatenated outputs of ``feature_layers``
        ``[b, t, len(feature_layers) * d]`` (None when empty).

        With a cache, the ids continue the cached sequence at positions ``cache.length ..``; the
        cache then holds them too (``cache.length`` grows by t).
        """
        if ids.dim() != 2:
            raise ValueError(f"Target: ids must be [batch, time], got shape {tuple(ids.shape)}")
        b, t = ids.shape
        start = 0 if cache is None else cache.length
        if cache is not None:
            cache.check_room(t)
        elif t > self.cfg.max_len:
            raise ValueError(f"Target: sequence of {t} tokens exceeds max_len={self.cfg.max_len}")
        positions = torch.arange(start, start + t, device=ids.device)
        mask = None if cache is None else causal_offset_mask(start, t, ids.device)
        x = self.embed(ids)
        rope = self.rotary.at(positions, x.dtype)
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, layer=i, cache=cache, attn_mask=mask)
            if i in feature_layers:
                feats.append(x)
        if cache is not None:
            cache.length += t
        logits = self.head(self.norm(x))
        return logits, (torch.cat(feats, dim=-1) if feats else None)

    def forward_static(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        start: torch.Tensor,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The capturable form of ``forward(ids, cache, feature_layers)``: ids ``[b, t]`` continue the
        sequence at positions ``start ..`` with ``start`` a device tensor ``[1]`` (int64), so no host
        value is read and every shape depends on t only (CUDA graphs replay it). The keys and values
        are written at those positions; attention runs over the whole cache, masked to positions
        ``<= start + i`` for new token i. ``cache.length`` is neither read nor changed: the caller
        keeps the length on the device. The caller must keep ``start + t <= max_len``.
        """
        b, t = ids.shape
        positions = start + torch.arange(t, device=ids.device)
        cols = torch.arange(cache.max_len, device=ids.device)
        mask = cols[None, :] <= positions[:, None]  # [t, max_len]
        x = self.embed(ids)
        rope = self.rotary.at(positions, x.dtype)
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer.forward_static(x, rope, i, cache, positions, mask)
            if i in feature_layers:
                feats.append(x)
        logits = self.head(self.norm(x))
        return logits, (torch.cat(feats, dim=-1) if feats else None)


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


class DraftLayer(nn.Module):
    """A drafter layer: queries from the block, keys/values from [context features; block] (KV injection)."""

    def __init__(self, d: int, n_heads: int, mlp_mult: int):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.mlp = _mlp(d, mlp_mult)

    def context_kv(self, c: torch.Tensor, rope: Rope):
        """Fused target features c ``[b, n, d]`` -> this layer's context keys and values ``[b, H, n, Dh]``
        (chen2026dflash, KV injection: K = [c; H_blk] W_K, V = [c; H_blk] W_V, context half)."""
        b, n, d = c.shape
        k, v = self.kv(c).view(b, n, 2, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        return rope(k), v

    def context_qkv(self, x: torch.Tensor, rope: Rope):
        """Input injection only: the context stream's queries, keys and values ``[b, H, n, Dh]`` (q, k
        rotated) from its hidden states x ``[b, n, d]``, the same projections as a block's."""
        b, n, d = x.shape
        h = self.n_heads
        hn = self.attn_norm(x)
        q = rope(self.q(hn).view(b, n, h, d // h).transpose(1, 2))
        k, v = self.kv(hn).view(b, n, 2, h, d // h).permute(2, 0, 3, 1, 4)
        return q, rope(k), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update of x ``[b, t, d]`` with the attention output ``[b, H, t, Dh]``, then the MLP."""
        b, t, d = x.shape
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, rope, k_ctx=None, v_ctx=None, attn_mask=None, cache=None, layer=None):
        """x ``[b, t, d]`` block hidden states; the context's keys and values either given (k_ctx,
        v_ctx ``[b, H, n, Dh]``, already rotated) or the first ``cache.length`` positions of ``cache``
        (layer ``layer``), behind which the block's own keys and values are written and attended
        without advancing ``cache.length``: DFlash's append-then-crop, with no copy of the context.

        No causal mask: every block position sees the whole block and the context (``attn_mask``
        only restricts which context/blocks a query sees when many blocks are trained at once).
        """
        b, t, d = x.shape
        h = self.n_heads
        hn = self.attn_norm(x)
        q = rope(self.q(hn).view(b, t, h, d // h).transpose(1, 2))
        k, v = self.kv(hn).view(b, t, 2, h, d // h).permute(2, 0, 3, 1, 4)
        k = rope(k)
        if cache is not None:
            n = cache.length
            cache.k[layer, :, :, n : n + t] = k
            cache.v[layer, :, :, n : n + t] = v
            k_all, v_all = cache.k[layer, :, :, : n + t], cache.v[layer, :, :, : n + t]
        else:
            k_all, v_all = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)
        a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))

    def forward_static(self, x, rope, cache, layer, positions, mask):
        """The capturable form of ``forward(x, rope, cache=cache, layer=layer)``: the block's keys and
        values go to the device positions ``positions [t]``; attention over the whole cache under
        ``mask`` (context and block visible, the rest hidden)."""
        b, t, d = x.shape
        h = self.n_heads
        hn = self.attn_norm(x)
        q = rope(self.q(hn).view(b, t, h, d // h).transpose(1, 2))
        k, v = self.kv(hn).view(b, t, 2, h, d // h).permute(2, 0, 3, 1, 4)
        a = _attend_cache(q, rope(k), v, cache, layer, positions, mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))


class DFlashDrafter(nn.Module):
    """The DFlash block-diffusion drafter (chen2026dflash), conditioned on a :class:`Target`.

    The target's embedding and LM head are used but not owned: ``parameters()`` holds only the
    drafter's own weights (fusion, layers, final norm, the mask embedding), so training it leaves
    the target frozen.
    """

    def __init__(self, target: Target, cfg: DrafterConfig = DrafterConfig()):
        super().__init__()
        tc = target.cfg
        layers = cfg.feature_layers or spread_layers(tc.n_layers, cfg.n_features)
        if any(not 0 <= i < tc.n_layers for i in layers):
            raise ValueError(f"DFlashDrafter: feature_layers {layers} must lie in [0, {tc.n_layers})")
        if cfg.max_block < 2:
            raise ValueError(f"DFlashDrafter: max_block must be >= 2, got {cfg.max_block}")
        self.cfg = cfg
        self.feature_layers = tuple(layers)
        d = tc.d_model
        # fusion of the target features: concat -> linear -> RMSNorm (chen2026dflash, target context features)
        self.fuse = nn.Linear(len(layers) * d, d, bias=False)
        self.fuse_norm = RMSNorm(d)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(d, tc.n_heads, tc.mlp_mult) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(d)
        self.rotary = Rotary(d // tc.n_heads, tc.max_len)
        self.apply(_init)
        nn.init.normal_(self.mask_embedding, std=0.02)
        self._target = (target,)  # a tuple: not registered as a submodule, so not trained or saved

    @property
    def target(self) -> Target:
        return self._target[0]

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target hidden states ``[b, n, k*d]`` -> context vectors c ``[b, n, d]``."""
        return self.fuse_norm(self.fuse(features))

    def embed_block(self, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
        """anchors ``[b, m]`` -> block inputs ``[b, m * block_size, d]``: each block is the anchor's
        target embedding followed by ``block_size - 1`` mask embeddings."""
        b, m = anchors.shape
        e = self.target.embed(anchors)  # [b, m, d]
        mask = self.mask_embedding.to(e.dtype).expand(b, m, block_size - 1, -1)
        return torch.cat([e[:, :, None], mask], dim=2).reshape(b, m * block_size, -1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states -> logits through the drafter's norm and the target's LM head."""
        return self.target.head(self.norm(h))

    def new_cache(self, batch: int = 1) -> KVCache:
        tc = self.target.cfg
        return KVCache(
            self.cfg.n_layers, batch, tc.n_heads, tc.max_len, tc.d_model // tc.n_heads, self.target.device,
            self.target.dtype,
        )  # fmt: skip

    def extend_context(self, cache: KVCache, features: torch.Tensor) -> None:
        """Append the context keys/values of new target features ``[1, m, k*d]`` (positions
        ``cache.length ..``) to the drafter's context cache."""
        m = features.shape[1]
        if m == 0:
            return
        cache.check_room(m)
        n = cache.length
        c = self.fuse_features(features)
        rope = self.rotary.at(torch.arange(n, n + m, device=features.device), c.dtype)
        x = c  # input injection: the context stream, causal over the cached context
        for i, layer in enumerate(self.layers):
            if self.cfg.injection == "kv":
                k, v = layer.context_kv(c, rope)
            else:
                q, k, v = layer.context_qkv(x, rope)
            cache.k[i, :, :, n : n + m] = k
            cache.v[i, :, :, n : n + m] = v
            if self.cfg.injection == "input":
                mask = causal_offset_mask(n, m, c.device)
                attn = F.scaled_dot_product_attention(
                    q, cache.k[i, :, :, : n + m], cache.v[i, :, :, : n + m], attn_mask=mask
                )
                x = layer.finish(x, attn)
        cache.length += m

    def draft_logits(self, cache: KVCache, anchor: torch.Tensor, block_size: int) -> torch.Tensor:
        """One drafter forward over the block ``[anchor, MASK x (block_size-1)]`` at positions
        ``cache.length ..`` given the cached context; returns logits ``[block_size - 1, V]`` for the
        masked positions (chen2026dflash, single-pass drafting). The cache is unchanged afterwards.
        """
        if not 2 <= block_size <= self.cfg.max_block:
            raise ValueError(
                f"draft_logits: block_size must be in [2, {self.cfg.max_block}], got {block_size}"
            )
        n = cache.length
        cache.check_room(block_size)  # the block's keys and values go behind the context, uncounted
        x = self.embed_block(anchor.view(1, 1), block_size)
        rope = self.rotary.at(torch.arange(n, n + block_size, device=x.device), x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache=cache, layer=i)
        return self.logits(x[0, 1:])

    def extend_context_static(self, cache: KVCache, features: torch.Tensor, start: torch.Tensor) -> None:
        """Capturable :meth:`extend_context`: the context keys/values of features ``[1, m, k*d]`` are
        written at positions ``start ..`` (``start``: device tensor ``[1]``). After a verification m is
        the block size whatever was accepted (padded context update): the positions past the accepted
        ones hold features of rejected drafts, which the next draft overwrites or the mask hides.
        ``cache.length`` is not used."""
        m = features.shape[1]
        positions = start + torch.arange(m, device=features.device)
        c = self.fuse_features(features)
        rope = self.rotary.at(positions, c.dtype)
        if self.cfg.injection == "input":  # the context stream through the layers, causal
            cols = torch.arange(cache.max_len, device=features.device)
            mask, x = cols[None, :] <= positions[:, None], c
            for i, layer in enumerate(self.layers):
                q, k, v = layer.context_qkv(x, rope)
                x = layer.finish(x, _attend_cache(q, k, v, cache, i, positions, mask))
            return
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(c, rope)
            cache.k[i].index_copy_(2, positions, k)
            cache.v[i].index_copy_(2, positions, v)

    def draft_logits_static(
        self, cache: KVCache, anchor: torch.Tensor, n_context: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Capturable :meth:`draft_logits`: anchor ``[1]`` and the context length ``n_context [1]``
        are device tensors; the block sits at positions ``n_context ..`` and sees every position
        ``< n_context + block_size``. Returns logits ``[block_size - 1, V]``."""
        positions = n_context + torch.arange(block_size, device=anchor.device)
        cols = torch.arange(cache.max_len, device=anchor.device)
        mask = (cols < n_context + block_size)[None, :]  # [1, max_len]: no causal mask in a block
        x = self.embed_block(anchor.view(1, 1), block_size)
        rope = self.rotary.at(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward_static(x, rope, cache, i, positions, mask)
        return self.logits(x[0, 1:])

    def forward_train(
        self, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, block_sizes: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:  # fmt: skip
        """Training forward: many blocks per sequence in one pass (chen2026dflash, training).

        features ``[b, T, k*d]`` target hidden states of ``ids [b, T]``; anchors ``[b, m]`` anchor
        positions; block_sizes ``[b, m]`` the length (<= block_size) of each block. Returns logits
        ``[b, m, block_size, V]`` (position 0 of a block is the anchor; its logits are unused).

        Query j of block i sees the context positions ``< anchors[i]`` and the positions of block i
        that are ``< block_sizes[i]``: no block sees another block or any token after its anchor.
        """
        b, T, _ = features.shape
        m = anchors.shape[1]
        B = block_size
        c = self.fuse_features(features)
        x = self.embed_block(ids.gather(1, anchors), B)  # [b, m*B, d]
        offs = torch.arange(B, device=ids.device)
        pos = (anchors[:, :, None] + offs).reshape(b, m * B).clamp_max(self.target.cfg.max_len - 1)
        mask = training_mask(anchors, block_sizes, T, B)[:, None]  # [b, 1, m*B, T + m*B]
        ctx_rope = self.rotary.at(torch.arange(T, device=ids.device), c.dtype)
        blk_rope = self.rotary.at(pos, x.dtype)
        x_ctx = c  # input injection: the context stream, causal, through the same layers
        for layer in self.layers:
            if self.cfg.injection == "kv":
                k_ctx, v_ctx = layer.context_kv(c, ctx_rope)
            else:
                q, k_ctx, v_ctx = layer.context_qkv(x_ctx, ctx_rope)
                x_ctx = layer.finish(x_ctx, F.scaled_dot_product_attention(q, k_ctx, v_ctx, is_causal=True))
            x = layer(x, blk_rope, k_ctx, v_ctx, attn_mask=mask)
        return self.logits(x).view(b, m, B, -1)


def training_mask(anchors: torch.Tensor, block_sizes: torch.Tensor, T: int, B: int) -> torch.Tensor:
    """Boolean attention mask ``[b, m*B, T + m*B]`` for :meth:`DFlashDrafter.forward_train`.

    Row ``(i, j)`` is query j of block i; columns are the T context positions, then the m blocks.
    True where attention is allowed: context ``t < anchors[i]``, and block i's own positions
    ``j' < block_sizes[i]``.
    """
    b, m = anchors.shape
    dev = anchors.device
    ctx = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]  # [b, m, T]
    ctx = ctx[:, :, None, :].expand(b, m, B, T)
    same = torch.eye(m, dtype=torch.bool, device=dev)[None, :, None, :, None]  # [1, m, 1, m, 1]
    inside = torch.arange(B, device=dev)[None, None, :] < block_sizes[:, :, None]  # [b, m, B] key valid
    blk = same & inside[:, None, None, :, :]  # [b, m, 1, m, B]
    blk = blk.expand(b, m, B, m, B).reshape(b, m, B, m * B)
    return torch.cat([ctx, blk], dim=-1).reshape(b, m * B, T + m * B)
