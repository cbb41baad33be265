"""The policy: a small GPT with a per-slot KV cache, and its pre-training on the task format.

Two ways to run the same weights:

* :meth:`Policy.forward` ``tokens [B, T] -> logits [B, T, V]``: the whole sequence at once, causal
  (the trainer's pass, and the no-cache reference generation).
* :meth:`Policy.decode` ``tokens [S], pos [S], cache -> logits [S, V]``: one token per slot of an
  inference batch, each slot at its own position, reading and writing the slot's KV cache. This is
  the actor's engine step. The cache is only data: after an in-flight weight update
  (piche2025pipelinerl, "in-flight weight updates") it keeps the keys and values the older weights computed, and the next
  step runs with the new weights on top of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.pipelinerl.task import VOCAB, TaskConfig, sft_batch


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    max_len: int = 32

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


#: The policy of the CPU tests and the lab, sized for ``task.TINY_TASK`` (its sequences fit in 12 positions).
TINY_MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_len=12)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.dh = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))

    def decode(self, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """x ``[S, D]`` one token per slot at positions ``pos [S]``; caches ``[S, H, T_max, dh]``."""
        S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(S, 3, self.h, self.dh).unbind(1)
        slots = torch.arange(S, device=x.device)
        k_cache[slots, :, pos] = k
        v_cache[slots, :, pos] = v
        scores = torch.einsum("shd,shtd->sht", q, k_cache) / math.sqrt(self.dh)
        visible = torch.arange(k_cache.shape[2], device=x.device)[None, :] <= pos[:, None]  # [S, T_max]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        a = torch.einsum("sht,shtd->shd", scores.softmax(-1), v_cache)
        x = x + self.proj(a.reshape(S, D))
        return x + self.mlp(self.ln2(x))


class Policy(nn.Module):
    """A pre-LN GPT over the task's 14-token vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` (T <= max_len) -> logits ``[B, T, VOCAB]``."""
        if tokens.dim() != 2 or tokens.shape[1] > self.cfg.max_len:
            raise ValueError(
                f"Policy.forward: tokens must be [B, T<={self.cfg.max_len}], got {tuple(tokens.shape)}"
            )
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    def new_cache(
        self, slots: int, device=None, dtype=torch.float32
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One ``(k, v)`` pair per layer, each ``[slots, H, max_len, dh]``, zeros."""
        shape = (slots, self.cfg.n_heads, self.cfg.max_len, self.cfg.d_model // self.cfg.n_heads)
        return [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in self.blocks
        ]

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """One engine step: tokens ``[S]`` at positions ``pos [S]`` -> logits ``[S, VOCAB]``.

        Writes each slot's key and value at its position; attends to positions ``<= pos`` of the
        slot's own cache (whatever weights computed them)."""
        x = self.tok(tokens) + self.pos(pos)
        for blk, (kc, vc) in zip(self.blocks, cache, strict=True):
            x = blk.decode(x, pos, kc, vc)
        return self.head(self.ln(x))


def flat_weights(model: nn.Module) -> torch.Tensor:
    """All parameters in one fp32 vector ``[N]`` (the payload of a weight broadcast).

    Layout: ``model.parameters()`` in order, each flattened; :func:`flatten_parameters_` lays its
    buffer out the same way."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().float()


def flatten_parameters_(model: nn.Module) -> torch.Tensor:
    """Make every parameter of ``model`` a view into one contiguous buffer ``[N]``; return the buffer.

    The buffer has :func:`flat_weights`'s layout, so a weight vector is loaded with one
    ``buffer.copy_`` (:func:`load_flat_weights`): on a GPU one host-to-device copy instead of one per
    parameter. The ``Parameter`` objects stay (an optimizer holding them keeps working), with their
    dtype, shape and ``requires_grad``; only their storage moves, once, here. Call it before capturing
    a CUDA graph: captured kernels read the parameters' addresses, and in-place loads keep them.
    Calling it again returns the same buffer. Needs one dtype and one device for all parameters."""
    buf = flat_buffer(model)
    if buf is not None:
        return buf
    params = list(model.parameters())
    if not params:
        raise ValueError("flatten_parameters_: the model has no parameters")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(
            f"flatten_parameters_: all parameters must share one dtype and device, got {sorted(map(str, kinds))}"
        )
    buf = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        offset = 0
        for p in params:
            view = buf[offset : offset + p.numel()].view(p.shape)
            view.copy_(p)
            p.data = view  # same Parameter, new storage: a view of the buffer
            offset += p.numel()
    model._flat_buffer = buf  # a plain attribute: not in state_dict, not moved by .to()
    return buf


def flat_buffer(model: nn.Module) -> torch.Tensor | None:
    """The buffer of :func:`flatten_parameters_` if every parameter still views it in order, else None.

    (``model.to(...)``, ``model.double()`` or a deep copy give the parameters new storage; then the
    model is no longer flat and loads go parameter by parameter.)"""
    buf = model.__dict__.get("_flat_buffer")
    if buf is None:
        return None
    base, size, offset = buf.data_ptr(), buf.element_size(), 0
    for p in model.parameters():
        if p.dtype != buf.dtype or p.data_ptr() != base + offset * size or not p.is_contiguous():
            return None
        offset += p.numel()
    return buf if offset == buf.numel() else None


def load_flat_weights(model: nn.Module, flat: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Copy a vector from :func:`flat_weights` into ``model``'s parameters in place.

    The parameters keep their storage (CUDA graphs keep working). A flattened model
    (:func:`flatten_parameters_`) takes one copy into its buffer; ``non_blocking`` makes that copy
    asynchronous on the current stream when it crosses host and GPU (the caller then must not change
    ``flat`` until the stream has run the copy). Any other model takes one copy per parameter."""
    buf = flat_buffer(model)
    n = buf.numel() if buf is not None else sum(p.numel() for p in model.parameters())
    if flat.numel() != n:
        raise ValueError(f"load_flat_weights: the model has {n} parameters, the vector {flat.numel()}")
    with torch.no_grad():
        if buf is not None:
            buf.copy_(flat.reshape(-1), non_blocking=non_blocking)
            return
        flat = flat.to(next(model.parameters()).device)
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def pretrain(
    model: Policy,
    task: TaskConfig,
    *,
    steps: int,
    batch: int = 64,
    lr: float = 3e-3,
    noise: float = 0.1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    time_budget_s: float | None = None,
    stop_after: int | None = None,
) -> dict:
    """Supervised pre-training on noisy demonstrations (see :func:`task.sft_batch`).

    Returns ``{"steps", "loss", "seconds"}``. Stops early when ``time_budget_s`` runs out or after
    ``stop_after`` steps; the learning-rate schedule is that of ``steps`` either way."""
    if task.max_seq_len > model.cfg.max_len:
        raise ValueError(
            f"pretrain: the task needs sequences of {task.max_seq_len} tokens, "
            f"the model's max_len is {model.cfg.max_len}"
        )
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"pretrain: stop_after must be at least 1 step, got {stop_after}")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    done = 0
    last = steps if stop_after is None else min(steps, stop_after)
    while done < last:
        done += 1
        tokens, mask = sft_batch(task, batch, g, noise)
        tokens, mask = tokens.to(device), mask.to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits[mask[:, 1:]], tokens[:, 1:][mask[:, 1:]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
    model.eval()
    return {"steps": done, "loss": float(loss.detach()), "seconds": time.perf_counter() - t0}
