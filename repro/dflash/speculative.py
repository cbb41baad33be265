"""Speculative decoding with KV caches: DFlash's single-pass drafting, the EAGLE-3-style and the
plain autoregressive baselines, and plain target decoding.

One round (chen2026dflash §3.1 and Figure 2; leviathan2022fast §2.3):

1. the drafter proposes ``gamma = block_size - 1`` tokens after the anchor (the last emitted token):
   DFlash in **one** forward over ``[anchor, MASK x gamma]``; the EAGLE-3-style drafter
   (``eagle.py``) and the autoregressive one in gamma forwards (a chain, no tree);
2. the target runs **one** forward over ``[anchor, d_1 .. d_gamma]`` on top of its KV cache, which
   gives ``p_1 .. p_{gamma+1}`` and, for the feature-conditioned drafters, the hidden states of the
   new positions;
3. :func:`accept_tokens` keeps ``a`` draft tokens and adds one target token (greedy or by
   rejection sampling), so every round emits ``a + 1 >= 1`` tokens: the same verify step for
   every drafter;
4. the caches roll back: the target's to the accepted prefix (``KVCache.crop``); DFlash's context
   cache holds the block's keys and values only during the draft (written behind ``length``, which
   does not advance: append-then-crop) and then receives the features of the accepted positions;
   the EAGLE-style drafter's cache is cropped to the pairs with target features, and the accepted
   positions' features wait for its next draft; the autoregressive drafter's cache is cropped to
   the accepted prefix.

Invariant between rounds: the target cache holds every emitted token but the last (the anchor).

Random numbers at temperature > 0 (same order in ``reference.py`` and ``static.py``): one uniform
for the token that follows the prompt; then per round the drafter's (DFlash, EAGLE-style and
:class:`FunctionDrafter`: gamma at once; autoregressive: one per step), then gamma for the
acceptance tests and one for the emitted target token. All are float64 from ``generator`` (on the
target's device).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from repro.dflash.eagle import EagleDrafter
from repro.dflash.model import DFlashDrafter, KVCache, Target
from repro.dflash.reference import probabilities, sample_inverse_cdf
from repro.dflash.static import decoder_for
from repro.dflash.verify import accept_tokens


@dataclass
class SpecOutput:
    """Result of :func:`speculative_generate`.

    tokens ``[max_new_tokens]`` int64 (CPU); ``accepted[r]``: draft tokens accepted in verification
    r; ``target_forwards`` (prefill included) and ``drafter_forwards``: forward passes of each model.
    """

    tokens: torch.Tensor
    accepted: list[int] = field(default_factory=list)
    target_forwards: int = 0
    drafter_forwards: int = 0
    block_size: int = 0

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens emitted per verification (accepted + the target's one)."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)


class FunctionDrafter:
    """A drafter given by a function ``fn(committed_ids [n], gamma) -> probs [gamma, V]``.

    Greedy decoding drafts the argmax of each row, sampling draws from the rows. Any function is
    allowed (random, adversarial, an oracle): the output of speculative decoding must not depend on it.
    """

    def __init__(self, fn: Callable[[torch.Tensor, int], torch.Tensor]):
        self.fn = fn


class _Session:
    """Per-generation drafter state: propose a block, then learn which prefix was accepted."""

    feature_layers: tuple[int, ...] = ()
    forwards = 0

    def start(self, prompt_len: int, features: torch.Tensor | None) -> None:
        pass

    def commit(self, n_valid: int, features: torch.Tensor | None) -> None:
        pass


class _DFlashSession(_Session):
    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.feature_layers = drafter.feature_layers
        self.cache: KVCache | None = None

    def start(self, prompt_len, features):
        self.cache = self.drafter.new_cache()
        self.drafter.extend_context(self.cache, features)

    def propose(self, committed, gamma, temperature, generator):
        logits = self.drafter.draft_logits(self.cache, committed[-1], gamma + 1)  # one pass per block
        self.forwards += 1
        if temperature == 0:
            return logits.argmax(-1), None
        q = probabilities(logits, temperature)
        u = torch.rand(gamma, generator=generator, device=q.device, dtype=torch.float64)
        return sample_inverse_cdf(q, u), q

    def commit(self, n_valid, features):
        # features of the anchor and the accepted drafts: exactly the positions the target verified
        if self.cache.length + features.shape[1] != n_valid:
            raise RuntimeError("DFlash context cache out of step with the target cache")
        self.drafter.extend_context(self.cache, features)


class _EagleSession(_Session):
    """The EAGLE-3-style drafter (``eagle.py``): the pairs verified last round, then its own outputs.

    ``pending`` holds the target features of the positions the last verification accepted (the
    anchor's and the accepted drafts'; after the prefill: every prompt position), whose pairs the
    next draft processes first; the cache holds the pairs before them."""

    def __init__(self, drafter: EagleDrafter):
        self.drafter = drafter
        self.feature_layers = drafter.feature_layers
        self.cache = drafter.new_cache()
        self.pending: torch.Tensor | None = None

    def start(self, prompt_len, features):
        self.pending = (
            features  # g_0 .. g_{P-1}: pairs (g_j, e(x_{j+1})), the last one's x is the first token
        )

    def propose(self, committed, gamma, temperature, generator):
        m = self.pending.shape[1]
        h = self.drafter.fuse_features(self.pending)
        u = None
        if temperature > 0:  # the draft's uniforms at once, as DFlash's (same order in reference.py)
            u = torch.rand(gamma, generator=generator, device=h.device, dtype=torch.float64)
        a = self.drafter(h, committed[-m:][None], self.cache)[:, -1:]  # forward 1: the verified pairs
        tokens, rows = [], []
        for i in range(gamma):
            if i > 0:  # forward i + 1: the previous output stands in for the unverified feature
                a = self.drafter(a, tokens[-1][None], self.cache)
            logits = self.drafter.logits(a[0])  # [1, V]
            if temperature == 0:
                tokens.append(logits.argmax(-1))
            else:
                q = probabilities(logits, temperature)
                tokens.append(sample_inverse_cdf(q, u[i : i + 1]))
                rows.append(q[0])
        self.forwards += gamma
        return torch.cat(tokens), (torch.stack(rows) if rows else None)

    def commit(self, n_valid, features):
        # pairs before the anchor's stay (real features); the drafted ones go; the accepted
        # positions' features wait for the next draft
        m = features.shape[1]
        self.cache.crop(n_valid - m)
        self.pending = features


class _ARSession(_Session):
    """Classic speculative decoding with a small autoregressive LM (same tokenizer) and its own cache."""

    def __init__(self, drafter: Target):
        self.drafter = drafter
        self.cache = drafter.new_cache()

    def propose(self, committed, gamma, temperature, generator):
        tokens, rows = [], []
        step = committed[self.cache.length :]  # tokens the drafter has not seen yet (ends with the anchor)
        for _ in range(gamma):
            logits, _ = self.drafter(step[None], self.cache)
            self.forwards += 1
            last = logits[0, -1]
            if temperature == 0:
                tok = last.argmax(-1, keepdim=True)
            else:
                q = probabilities(last, temperature)
                u = torch.rand(1, generator=generator, device=q.device, dtype=torch.float64)
                tok = sample_inverse_cdf(q, u)
                rows.append(q)
            tokens.append(tok)
            step = tok
        return torch.cat(tokens), (torch.stack(rows) if rows else None)

    def commit(self, n_valid, features):
        # the cache holds the old tokens and d_1 .. d_{gamma-1}; keep what agrees with the accepted text
        self.cache.crop(min(self.cache.length, n_valid))


class _FunctionSession(_Session):
    def __init__(self, drafter: FunctionDrafter, vocab_size: int):
        self.fn = drafter.fn
        self.vocab_size = vocab_size

    def propose(self, committed, gamma, temperature, generator):
        q = self.fn(committed, gamma)
        self.forwards += 1
        if q.dim() != 2 or q.shape[0] != gamma or q.shape[1] != self.vocab_size:
            raise ValueError(
                f"FunctionDrafter: fn must return [gamma={gamma}, vocab_size={self.vocab_size}] "
                f"probabilities, got {tuple(q.shape)}"
            )
        if temperature == 0:
            return q.argmax(-1), None
        u = torch.rand(gamma, generator=generator, device=q.device, dtype=torch.float64)
        return sample_inverse_cdf(q, u), q


DRAFTERS = "a DFlashDrafter, an EagleDrafter, a Target (autoregressive drafter) or a FunctionDrafter"


def _session(drafter, vocab_size: int) -> _Session:
    if isinstance(drafter, DFlashDrafter):
        return _DFlashSession(drafter)
    if isinstance(drafter, EagleDrafter):
        return _EagleSession(drafter)
    if isinstance(drafter, Target):
        return _ARSession(drafter)
    if isinstance(drafter, FunctionDrafter):
        return _FunctionSession(drafter, vocab_size)
    raise TypeError(f"drafter must be {DRAFTERS}, got {type(drafter).__name__}")


def _check_drafter(target: Target, drafter, block_size) -> None:
    """block_size, and that the drafter fits the target (same model, vocabulary, length)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an int >= 2 (anchor + at least one draft), got {block_size!r}")
    if not isinstance(drafter, (DFlashDrafter, EagleDrafter, Target, FunctionDrafter)):
        raise TypeError(f"drafter must be {DRAFTERS}, got {type(drafter).__name__}")
    if isinstance(drafter, (DFlashDrafter, EagleDrafter)) and drafter.target is not target:
        raise ValueError(f"drafter: this {type(drafter).__name__} was built for another target model")
    if isinstance(drafter, DFlashDrafter) and block_size > drafter.cfg.max_block:
        raise ValueError(f"block_size={block_size} exceeds the drafter's max_block={drafter.cfg.max_block}")
    if isinstance(drafter, Target):
        if drafter.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"drafter: the autoregressive drafter's vocab_size={drafter.cfg.vocab_size} differs from "
                f"the target's vocab_size={target.cfg.vocab_size}; both must share one tokenizer"
            )
        if drafter.cfg.max_len < target.cfg.max_len:
            raise ValueError(
                f"drafter: the autoregressive drafter's max_len={drafter.cfg.max_len} is below the "
                f"target's max_len={target.cfg.max_len}"
            )


def _check_args(target, prompt_ids, max_new_tokens, temperature, extra: int) -> None:
    if not isinstance(target, Target):
        raise TypeError(f"target must be a repro.dflash.Target, got {type(target).__name__}")
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        shape = tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor of token ids, got {shape}")
    if prompt_ids.dtype not in (torch.int64, torch.int32, torch.uint8):
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
    if int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= target.cfg.vocab_size:
        raise ValueError(f"prompt_ids must lie in [0, vocab_size={target.cfg.vocab_size})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    need = prompt_ids.numel() + max_new_tokens + extra
    if need > target.cfg.max_len:
        raise ValueError(
            f"prompt ({prompt_ids.numel()}) + max_new_tokens ({max_new_tokens}) + block ({extra}) = {need} "
            f"exceeds the target's max_len={target.cfg.max_len}"
        )


@torch.inference_mode()
def speculative_generate(
    target: Target,
    drafter: DFlashDrafter | EagleDrafter | Target | FunctionDrafter,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    mode: str = "auto",
) -> SpecOutput:
    """Generate ``max_new_tokens`` tokens after ``prompt_ids [P]`` with speculative decoding.

    block_size: tokens per verified block, the anchor and ``block_size - 1`` drafted tokens (>= 2).
    temperature 0: greedy (the output equals :func:`generate`'s); > 0: speculative sampling (the
    output is distributed as the target's). mode: ``"eager"`` (this loop), ``"static"`` (the
    capturable steps of ``static.py``, run eagerly), ``"graphs"`` (those steps as CUDA graphs on a
    CUDA target, eagerly elsewhere) or ``"auto"`` (the default: graphs on a CUDA target, 2.5-3.5x
    eager's tokens/s at temperature 0 on an H100 in ``bench``; eager elsewhere); all give the same
    tokens from the same random numbers. In the static modes DFlash and EAGLE-style drafters draft
    in a static step too; autoregressive and function drafters draft eagerly.
    Raises ValueError (TypeError for a wrong kind of model) naming the argument, before any forward.
    Returns a :class:`SpecOutput`.
    """
    if not isinstance(target, Target):
        raise TypeError(f"target must be a repro.dflash.Target, got {type(target).__name__}")
    _check_drafter(target, drafter, block_size)
    _check_args(target, prompt_ids, max_new_tokens, temperature, block_size)
    mode = _resolve_mode(mode, target)
    if mode != "eager":
        return _speculative_static(
            target, drafter, prompt_ids, max_new_tokens, block_size, temperature, generator, mode == "graphs"
        )
    session = _session(drafter, target.cfg.vocab_size)
    dev = target.device
    gamma = block_size - 1
    p_len = prompt_ids.numel()
    buf = torch.zeros(p_len + max_new_tokens + block_size + 1, dtype=torch.long, device=dev)
    buf[:p_len] = prompt_ids.to(dev)
    cache = target.new_cache()
    logits, feats = target(buf[None, :p_len], cache, session.feature_layers)  # prefill
    buf[p_len] = _pick(logits[0, -1:], temperature, generator)[0]
    session.start(p_len, feats)
    out = SpecOutput(tokens=torch.empty(0, dtype=torch.long), target_forwards=1, block_size=block_size)
    n = p_len + 1  # emitted so far (prompt included); the target cache holds n - 1
    while n - p_len < max_new_tokens:
        draft, q = session.propose(buf[:n], gamma, temperature, generator)
        block = torch.cat([buf[n - 1 : n], draft])
        logits, feats = target(block[None], cache, session.feature_layers)  # verify: one forward
        out.target_forwards += 1
        if temperature == 0:
            a, nxt = accept_tokens(draft[None], logits, None, 0.0)
        else:
            u = torch.rand(gamma, generator=generator, device=dev, dtype=torch.float64)
            u_final = torch.rand(1, generator=generator, device=dev, dtype=torch.float64)
            a, nxt = accept_tokens(draft[None], logits, q[None], temperature, u[None], u_final)
        buf[n : n + gamma] = draft  # the rejected tail is overwritten below or ignored
        a_host = int(a[0])  # the one host sync of the round
        buf[n + a_host] = nxt[0]
        cache.crop(n + a_host)  # KV-cache rollback: anchor and accepted drafts stay
        session.commit(n + a_host, None if feats is None else feats[:, : a_host + 1])
        n += a_host + 1
        out.accepted.append(a_host)
    out.tokens = buf[p_len : p_len + max_new_tokens].cpu()
    out.drafter_forwards = session.forwards
    return out


def _resolve_mode(mode, target: Target) -> str:
    """The mode a call runs: ``mode`` itself, or for "auto" graphs on a CUDA target and eager elsewhere."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "graphs" if target.device.type == "cuda" else "eager"
    return mode


MODES = ("auto", "eager", "static", "graphs")


def _speculative_static(target, drafter, prompt_ids, max_new_tokens, block_size, temperature, generator,
                        graphs) -> SpecOutput:  # fmt: skip
    """speculative_generate with the static steps (``static.py``). A DFlash round is two steps, draft
    and verify, with no host read inside either; another drafter proposes eagerly into the draft
    buffer. The host reads the accepted length once per round, to know when to stop."""
    dec = decoder_for(target, drafter, block_size, temperature, graphs)
    dec.prefill(prompt_ids, generator)
    session = None if dec.static_draft else _session(drafter, target.cfg.vocab_size)
    p_len, gamma = prompt_ids.numel(), block_size - 1
    out = SpecOutput(tokens=torch.empty(0, dtype=torch.long), target_forwards=1, block_size=block_size)
    n = p_len + 1  # host copy of dec.n, kept from the accepted lengths read below
    while n - p_len < max_new_tokens:
        if session is None:
            dec.draw_uniforms(generator)
            dec.steps["draft"]()
        else:
            draft, q = session.propose(dec.tokens[:n], gamma, temperature, generator)
            dec.draft.copy_(draft)
            if q is not None:
                dec.draft_probs.copy_(q)
            dec.draw_uniforms(generator)
        dec.steps["verify"]()
        a = int(dec.accepted.item())  # the one host read of the round
        if session is not None:
            session.commit(n + a, None)
        n += a + 1
        out.accepted.append(a)
        out.target_forwards += 1
    out.tokens = dec.tokens[p_len : p_len + max_new_tokens].cpu()
    out.drafter_forwards = dec.draft_forwards * len(out.accepted) if session is None else session.forwards
    return out


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """logits ``[1, V]`` -> next token ``[1]``: argmax, or one inverse-CDF draw."""
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(1, generator=generator, device=logits.device, dtype=torch.float64)
    return sample_inverse_cdf(probabilities(logits, temperature), u)


@torch.inference_mode()
def generate(
    target: Target,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    mode: str = "auto",
) -> torch.Tensor:
    """Plain autoregressive decoding with a KV cache: ``max_new_tokens`` tokens ``[max_new_tokens]``
    (CPU int64) after ``prompt_ids [P]``; one target forward per token, no host syncs. mode: as in
    :func:`speculative_generate` (``"graphs"``: one CUDA graph replay per token)."""
    _check_args(target, prompt_ids, max_new_tokens, temperature, 0)
    mode = _resolve_mode(mode, target)
    if mode != "eager":
        dec = decoder_for(target, None, 1, temperature, mode == "graphs")
        dec.prefill(prompt_ids, generator)
        for _ in range(max_new_tokens - 1):
            if temperature > 0:
                torch.rand(1, generator=generator, out=dec.u_final)
            dec.steps["step"]()
        p_len = prompt_ids.numel()
        return dec.tokens[p_len : p_len + max_new_tokens].cpu()
    dev = target.device
    cache = target.new_cache()
    out = torch.empty(max_new_tokens, dtype=torch.long, device=dev)
    logits, _ = target(prompt_ids.to(dev).long()[None], cache)
    tok = _pick(logits[0, -1:], temperature, generator)
    out[0] = tok[0]
    for i in range(1, max_new_tokens):
        logits, _ = target(tok[None], cache)
        tok = _pick(logits[0, -1:], temperature, generator)
        out[i] = tok[0]
    return out.cpu()
