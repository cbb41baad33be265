"""The EAGLE-3-style drafter (li2025eagle3), the baseline DFlash is measured against.

What EAGLE-3 builds (§3.1, "Inference Pipeline"): the target's low-, middle- and high-level hidden
states of a position are concatenated and reduced by a fully connected layer to one vector
``g = W_fuse [l; m; h]`` of the target's width; the drafter's input at that position is ``g``
concatenated with the embedding of the *next* token (the one sampled there), reduced again by a
fully connected layer and fed to one causal decoder layer, whose output ``a`` goes through the
target's LM head. The drafter is autoregressive: for the second draft token there is no target
feature of the first one yet (it has not been verified), so its own output ``a`` stands in for
``g`` (§3.1: "we use the output a_I from the draft model in the previous step to replace g_I").

Indexing used throughout (byte tokens ``x_0 x_1 ...``): the *pair* at position j is
``(h_j, e(x_{j+1}))`` with ``h_j = g_j`` (target feature of position j) or, for positions the target
has not verified, the drafter's output at position j - 1; the pair at position j predicts
``x_{j+2}``. After a verification whose anchor sat at position ``n - 1``, the pairs of the anchor and
of the accepted drafts are known (their features come from that verification), so drafting a block
is one forward over those ``a + 1`` pairs (whose last output gives ``d_1``) and then ``gamma - 1``
one-position forwards on the drafter's own outputs: gamma sequential forwards per round, as for any
autoregressive drafter (chen2026dflash §3.2, Eq. 2), with a KV cache that is cropped after each
verification.

Training-time test (li2025eagle3 §3.2, Figure 6): training unrolls ``ttt_steps`` drafting steps.
Step 0 is ordinary causal training on the pairs ``(g_j, e(x_{j+1}))``. At step s >= 1 the pair at
position j is ``(a^{s-1}_{j-1}, e(x_{j+1}))``: the previous step's output one position back, with the
true next token (the case that matters for acceptance: all earlier drafts right). Its query sees
what it would see at inference: the target-feature pairs at positions ``<= j - s`` (step 0's keys)
and one key of each step s' in 1..s, at position ``j - s + s'`` (its own chain of drafter outputs):
the diagonal masks of EAGLE-3's Figure 6 (:func:`ttt_mask`). Every step is trained on the label of
its position, ``x_{j+2}`` (or the target's distribution of it), so the drafter learns to stay right
on its own outputs.

Choices of ours: the embedding and the LM head are the target's, shared and frozen, as in our DFlash
drafter (EAGLE-3's released heads train their own LM head over a reduced vocabulary; ours is 256
bytes); the feature layers are chosen by :func:`repro.dflash.model.spread_layers`, the same as the
DFlash drafter's, so both drafters read the same target states; the fusion layer has no norm (EAGLE-3
§3.1 names only a fully connected layer). Drafting is a **chain** of ``block_size - 1`` tokens
verified by the same verify step as DFlash (EAGLE-3 drafts a dynamic tree, EAGLE-2's; chen2026dflash
§5.1 compares against trees of 16 and 60 tokens; a tree needs tree attention in the target, which we
do not build).

Shapes: features ``[b, T, k*d]``; pair states ``h [b, n, d]``; tokens ``[b, n]``; keys/values
``[b, H, n, d/H]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from repro.dflash.model import (
    Block,
    KVCache,
    RMSNorm,
    Rotary,
    Target,
    _init,
    causal_offset_mask,
    spread_layers,
)


@dataclass(frozen=True)
class EagleConfig:
    """Size of an :class:`EagleDrafter`; width and heads are the target's.

    ``n_layers``: causal decoder layers (EAGLE-3: one). ``feature_layers``: which target layers are
    fused (None: ``n_features`` spread over the target's depth, EAGLE-3's low, middle and high).
    ``ttt_steps``: drafting steps simulated in training (EAGLE-3 §4, Implementation: 5).
    """

    n_layers: int = 1
    n_features: int = 3
    feature_layers: tuple[int, ...] | None = None
    ttt_steps: int = 5


class EagleDrafter(nn.Module):
    """An EAGLE-3-style autoregressive drafter conditioned on a :class:`Target`'s fused features.

    As with :class:`repro.dflash.model.DFlashDrafter`, the target's embedding and LM head are used
    but not owned: ``parameters()`` holds the fusion, the input layer, the decoder layers and the
    final norm only.
    """

    def __init__(self, target: Target, cfg: EagleConfig = EagleConfig()):
        super().__init__()
        tc = target.cfg
        layers = cfg.feature_layers or spread_layers(tc.n_layers, cfg.n_features)
        if any(not 0 <= i < tc.n_layers for i in layers):
            raise ValueError(f"EagleDrafter: feature_layers {layers} must lie in [0, {tc.n_layers})")
        if cfg.n_layers < 1 or cfg.ttt_steps < 1:
            raise ValueError(
                f"EagleDrafter: n_layers and ttt_steps must be >= 1, got {cfg.n_layers}, {cfg.ttt_steps}"
            )
        self.cfg = cfg
        self.feature_layers = tuple(layers)
        d = tc.d_model
        self.fuse = nn.Linear(len(layers) * d, d, bias=False)  # g = W_fuse [l; m; h]
        self.inp = nn.Linear(2 * d, d, bias=False)  # [e(x_{j+1}); h_j] -> the decoder's input
        self.layers = nn.ModuleList(Block(tc) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(d)
        self.rotary = Rotary(d // tc.n_heads, tc.max_len)
        self.apply(_init)
        self._target = (target,)  # not a submodule: not trained, not saved

    @property
    def target(self) -> Target:
        return self._target[0]

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target hidden states ``[b, n, k*d]`` -> fused features g ``[b, n, d]``."""
        return self.fuse(features)

    def pair_inputs(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Pair states h ``[b, n, d]`` (fused features or the drafter's outputs) and the next tokens
        ``[b, n]`` -> the first decoder layer's input ``[b, n, d]``."""
        e = self.target.embed(tokens).to(h.dtype)
        return self.inp(torch.cat([e, h], dim=-1))

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """Drafter outputs a ``[..., d]`` -> logits ``[..., V]`` (its norm, the target's LM head)."""
        return self.target.head(self.norm(a))

    def new_cache(self, batch: int = 1) -> KVCache:
        tc = self.target.cfg
        return KVCache(
            self.cfg.n_layers, batch, tc.n_heads, tc.max_len, tc.d_model // tc.n_heads, self.target.device,
            self.target.dtype,
        )  # fmt: skip

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Causal forward over pairs ``(h [b, n, d], tokens [b, n])`` -> outputs a ``[b, n, d]``.

        Without a cache the pairs sit at positions ``0 .. n-1``; with one they continue it at
        ``cache.length ..`` and are appended to it (``cache.length`` grows by n)."""
        b, n, _ = h.shape
        start = 0 if cache is None else cache.length
        if cache is not None:
            cache.check_room(n)
        x = self.pair_inputs(h, tokens)
        rope = self.rotary.at(torch.arange(start, start + n, device=x.device), x.dtype)
        mask = None if cache is None else causal_offset_mask(start, n, x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, layer=i, cache=cache, attn_mask=mask)
        if cache is not None:
            cache.length += n
        return x

    def forward_static(
        self, h: torch.Tensor, tokens: torch.Tensor, cache: KVCache, start: torch.Tensor
    ) -> torch.Tensor:
        """The capturable form of ``forward(h, tokens, cache)``: the pairs sit at positions ``start ..``
        (``start`` a device tensor ``[1]``), are written there by ``index_copy_`` and attend to every
        cached position ``<=`` their own; ``cache.length`` is neither read nor changed."""
        n = h.shape[1]
        positions = start + torch.arange(n, device=h.device)
        cols = torch.arange(cache.max_len, device=h.device)
        mask = cols[None, :] <= positions[:, None]  # [n, max_len]
        x = self.pair_inputs(h, tokens)
        rope = self.rotary.at(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward_static(x, rope, i, cache, positions, mask)
        return x

    def forward_train(
        self, features: torch.Tensor, ids: torch.Tensor, steps: int | None = None
    ) -> torch.Tensor:
        """Training-time test over windows ``ids [b, T]`` with target features ``[b, T, k*d]``.

        Returns logits ``[S, b, T - 1, V]`` (S = ``steps``, default ``cfg.ttt_steps``): entry
        ``[s, :, j]`` is step s's prediction at pair position j, i.e. of ``x_{j+2}``. Rows ``j < s``
        (no chain of s outputs behind them) and ``j = T - 2`` (no label) are the caller's to drop.
        """
        S = steps or self.cfg.ttt_steps
        b, T, _ = features.shape
        N = T - 1
        g = self.fuse_features(features[:, :N])
        nxt = ids[:, 1:]  # pair j carries e(x_{j+1})
        rope = self.rotary.at(torch.arange(N, device=ids.device), g.dtype)
        keys = [[] for _ in self.layers]
        values = [[] for _ in self.layers]
        h, out = g, []
        for s in range(S):
            mask = ttt_mask(N, s, ids.device)
            x = self.pair_inputs(h, nxt)
            for i, layer in enumerate(self.layers):
                x = _layer_with_past(layer, x, rope, keys[i], values[i], mask)
            out.append(self.logits(x))
            # step s + 1's pair at j takes this step's output at j - 1 (position 0 has none: zeros)
            h = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return torch.stack(out)


def _layer_with_past(block: Block, x, rope, keys: list, values: list, mask) -> torch.Tensor:
    """One decoder layer whose queries attend to the keys and values of every earlier training-time
    test step (``keys``/``values``: lists of ``[b, H, N, Dh]``, appended with this step's) under
    ``mask [N, (s + 1) N]``."""
    b, t, d = x.shape
    h = block.n_heads
    qkv = block.qkv(block.attn_norm(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
    q, k = rope(qkv[:2]).unbind(0)
    keys.append(k)
    values.append(qkv[2])
    a = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
    x = x + block.out(a.transpose(1, 2).reshape(b, t, d))
    return x + block.mlp(block.mlp_norm(x))


def ttt_mask(n: int, step: int, device=None) -> torch.Tensor:
    """Boolean mask ``[n, (step + 1) n]`` of training-time test step ``step`` (li2025eagle3 Figure 6).

    Row j is the step's query at pair position j; the columns are the n positions of step 0 (the
    target-feature pairs), then those of steps 1 .. step. True where allowed: step 0's positions
    ``<= j - step``, and for step s' >= 1 only position ``j - step + s'``, the drafter output the
    query's chain went through (for s' = step: the query's own position).
    """
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(n, device=device)[None, :]
    blocks = [cols <= rows - step]
    blocks += [cols == rows - step + s for s in range(1, step + 1)]
    return torch.cat(blocks, dim=1)
