"""Capturable speculative decoding: static-shape steps over preallocated device buffers, replayed
as CUDA graphs on the GPU.

Why: at this model size a decoding step costs its kernel launches and the Python around them (about
14 us of host time per operation on an H100, see the paper page), not its FLOPs. A CUDA graph
replays a whole step with one launch, but only a step whose shapes and addresses never change and
that never asks the host for a value. So every step here:

* reads and writes only buffers allocated once (token buffer, KV caches, draft, uniforms);
* takes positions and lengths from device tensors: the emitted count ``n [1]`` lives on the device
  and the steps advance it themselves;
* attends over the whole preallocated cache with a mask built from those device lengths, and writes
  keys and values with ``index_copy_`` at device positions (``Target.forward_static``);
* updates DFlash's context cache with all ``block_size`` verified positions (padded; the rejected
  ones are overwritten by the next draft or hidden by the mask), so its shape does not depend on
  the accepted length.

Steps: ``draft`` (DFlash: one drafter forward over ``[anchor, MASK x gamma]``, then argmax or an
inverse-CDF draw; the EAGLE-style drafter of ``eagle.py``: gamma forwards, the first over the last
verified block's pairs padded to ``gamma + 1`` positions, the others one position each on its own
outputs), ``verify`` (one target forward over ``[anchor, draft]``, the acceptance rule, the token
writes, DFlash's context update or a copy of the features for the EAGLE drafter's next draft, and
``n += a + 1``), and ``step`` (target-only decoding: one token). On CUDA, with ``graphs=True``,
each is captured once per decoder (one decoder per target, drafter, block size, temperature; batch
1) and replayed; elsewhere the same functions run eagerly.

What still runs on the host per round: drawing the round's uniforms (temperature > 0; three
``torch.rand(out=...)`` calls in the order of ``speculative.py``), a drafter that is neither DFlash
nor EAGLE-style (autoregressive or :class:`FunctionDrafter`: proposed eagerly, then copied into the
draft buffer),
and **one host read per round**: the accepted length, which decides when to stop (and fills
``SpecOutput.accepted``). Target-only decoding reads nothing until the end.
"""

from __future__ import annotations

import torch

from repro.dflash.eagle import EagleDrafter
from repro.dflash.model import DFlashDrafter, Target
from repro.dflash.reference import probabilities, sample_inverse_cdf
from repro.dflash.verify import accept_tokens


class GraphedStep:
    """``fn()`` (no arguments; it reads and writes fixed buffers), captured as a CUDA graph when
    ``capture`` is true and replayed by ``__call__``; otherwise called eagerly.

    Capturing runs ``fn`` twice on a side stream first (warm-up, as CUDA graphs require), which
    changes the buffers it writes: ``reset()`` runs before each warm-up call (so that positions stay
    inside the cache), and the caller resets the buffers again after building every step."""

    def __init__(self, fn, capture: bool, pool=None, reset=None):
        self.fn = fn
        self.graph = None
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    if reset is not None:
                        reset()
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class StaticDecoder:
    """Buffers and static steps for speculative (``block_size >= 2``) or target-only
    (``block_size == 1``, drafter None) decoding of one sequence with ``target``.

    Device state: ``tokens [max_len + block_size]`` (prompt and emitted tokens), ``n [1]`` (how many
    are valid; the target cache holds positions ``< n - 1``, and so does DFlash's context cache),
    ``draft [gamma]``, ``draft_probs [gamma, V]`` and the uniforms (temperature > 0), ``accepted [1]``.
    """

    def __init__(self, target: Target, drafter, block_size: int, temperature: float, graphs: bool):
        dev = target.device
        self.target, self.drafter = target, drafter
        self.block_size, self.temperature = block_size, float(temperature)
        self.dflash = isinstance(drafter, DFlashDrafter)
        self.eagle = isinstance(drafter, EagleDrafter)
        self.static_draft = self.dflash or self.eagle  # the draft is a static step too
        self.feature_layers = drafter.feature_layers if self.static_draft else ()
        self.capture = bool(graphs) and dev.type == "cuda"
        gamma = max(block_size - 1, 1)
        # drafter forwards per round: DFlash one, the EAGLE-style drafter one per drafted token
        self.draft_forwards = gamma if self.eagle else 1
        V = target.cfg.vocab_size
        f64 = dict(device=dev, dtype=torch.float64)
        self.tokens = torch.zeros(target.cfg.max_len + block_size, dtype=torch.long, device=dev)
        self.n = torch.ones(1, dtype=torch.long, device=dev)
        self.cache = target.new_cache()
        self.dcache = drafter.new_cache() if self.static_draft else None
        if self.eagle:  # the last verification's features (anchor and drafts), for the next draft
            width = len(self.feature_layers) * target.cfg.d_model
            self.features = torch.zeros(gamma + 1, width, device=dev, dtype=target.dtype)
        self.draft = torch.zeros(gamma, dtype=torch.long, device=dev)
        self.draft_probs = torch.full((gamma, V), 1.0 / V, **f64)
        self.u_draft, self.u, self.u_final = (
            torch.zeros(gamma, **f64),
            torch.zeros(gamma, **f64),
            torch.zeros(1, **f64),
        )
        self.accepted = torch.zeros(1, dtype=torch.long, device=dev)
        self.offsets = torch.arange(gamma, device=dev)
        self.pair_offsets = torch.arange(gamma + 1, device=dev)
        # one memory pool for the decoder's graphs: no tensor made inside a step outlives it (results
        # are copied into the buffers above), so the graphs may share it whatever the replay order
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        if self.eagle:  # the EAGLE draft reads position n - accepted - 2: keep it >= 0 in the warm-up
            reset = lambda: (self.n.fill_(2), self.accepted.zero_())  # noqa: E731
        else:
            reset = lambda: self.n.fill_(1)  # noqa: E731
        self.steps = {}
        if block_size == 1:
            self.steps["step"] = GraphedStep(self._step, self.capture, pool, reset)
        else:
            if self.static_draft:
                draft = self._draft_eagle if self.eagle else self._draft
                self.steps["draft"] = GraphedStep(draft, self.capture, pool, reset)
            self.steps["verify"] = GraphedStep(self._verify, self.capture, pool, reset)
        self.n.fill_(1)  # undo the warm-up's writes (the caches' contents past n are never read)

    # -- the static steps: device tensors in, device tensors out, no host reads -------------------

    def _draft(self) -> None:
        """DFlash's single-pass draft of ``gamma`` tokens after the anchor ``tokens[n - 1]``."""
        start = self.n - 1
        anchor = self.tokens.index_select(0, start)
        logits = self.drafter.draft_logits_static(self.dcache, anchor, start, self.block_size)
        if self.temperature == 0:
            self.draft.copy_(logits.argmax(-1))
        else:
            q = probabilities(logits, self.temperature)
            self.draft.copy_(sample_inverse_cdf(q, self.u_draft))
            self.draft_probs.copy_(q)

    def _draft_eagle(self) -> None:
        """The EAGLE-style drafter's ``gamma`` forwards (``eagle.py``): first the pairs of the last
        verified block, padded to all ``gamma + 1`` positions from the previous anchor's (the
        accepted ones carry real features; the rest are overwritten next round, never read before),
        whose output at the last accepted position gives ``d_1``; then one position per token on its
        own outputs."""
        gamma = self.block_size - 1
        prev = self.n - self.accepted - 2  # the previous anchor's position: its pair comes first
        h = self.drafter.fuse_features(self.features[None])  # [1, gamma + 1, d]
        tokens = self.tokens.index_select(0, prev + 1 + self.pair_offsets)[None]
        a = self.drafter.forward_static(h, tokens, self.dcache, prev).index_select(1, self.accepted)
        for i in range(gamma):
            if i > 0:  # pair (a, e(d_i)) at position n - 2 + i
                a = self.drafter.forward_static(a, self.draft[i - 1 : i][None], self.dcache, self.n - 2 + i)
            logits = self.drafter.logits(a[0])  # [1, V]
            if self.temperature == 0:
                self.draft[i : i + 1].copy_(logits.argmax(-1))
            else:
                q = probabilities(logits, self.temperature)
                self.draft[i : i + 1].copy_(sample_inverse_cdf(q, self.u_draft[i : i + 1]))
                self.draft_probs[i : i + 1].copy_(q)

    def _verify(self) -> None:
        """Verify ``[anchor, draft]``, emit the accepted prefix and the target's token, advance n."""
        start = self.n - 1
        block = torch.cat([self.tokens.index_select(0, start), self.draft])
        logits, feats = self.target.forward_static(block[None], self.cache, start, self.feature_layers)
        if self.temperature == 0:
            a, nxt = accept_tokens(self.draft[None], logits, None, 0.0)
        else:
            a, nxt = accept_tokens(
                self.draft[None], logits, self.draft_probs[None], self.temperature, self.u[None], self.u_final
            )
        self.tokens.index_copy_(0, self.n + self.offsets, self.draft)  # rejected tail: overwritten later
        self.tokens.index_copy_(0, self.n + a, nxt)
        if self.dflash:  # padded context update: all block positions, from the anchor's on
            self.drafter.extend_context_static(self.dcache, feats, start)
        if self.eagle:  # the EAGLE drafter reads them in its next draft
            self.features.copy_(feats[0])
        self.accepted.copy_(a)
        self.n.add_(a + 1)

    def _step(self) -> None:
        """Target-only decoding: one token after ``tokens[n - 1]``."""
        start = self.n - 1
        logits, _ = self.target.forward_static(self.tokens.index_select(0, start)[None], self.cache, start)
        if self.temperature == 0:
            tok = logits[0, -1:].argmax(-1)
        else:
            tok = sample_inverse_cdf(probabilities(logits[0, -1:], self.temperature), self.u_final)
        self.tokens.index_copy_(0, self.n, tok)
        self.n.add_(1)

    # -- per call ----------------------------------------------------------------------------------

    def prefill(self, prompt_ids: torch.Tensor, generator) -> None:
        """Eager (the prompt length varies): prompt into the buffers, its first token, the caches."""
        p_len = prompt_ids.numel()
        self.tokens[:p_len] = prompt_ids.to(self.tokens.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.tokens.device)
        logits, feats = self.target.forward_static(
            self.tokens[None, :p_len], self.cache, zero, self.feature_layers
        )
        last = logits[0, -1:]
        if self.temperature == 0:
            tok = last.argmax(-1)
        else:
            u = torch.rand(1, generator=generator, device=last.device, dtype=torch.float64)
            tok = sample_inverse_cdf(probabilities(last, self.temperature), u)
        self.tokens[p_len : p_len + 1] = tok
        self.n.fill_(p_len + 1)
        if self.dflash:
            self.drafter.extend_context_static(self.dcache, feats, zero)
        if self.eagle:  # pairs 0 .. P-2 now; the last prompt position's pair, as if just verified
            if p_len > 1:
                h = self.drafter.fuse_features(feats[:, : p_len - 1])
                self.drafter.forward_static(h, self.tokens[None, 1:p_len], self.dcache, zero)
            self.features[:1].copy_(feats[0, p_len - 1 :])
            self.accepted.zero_()

    def draw_uniforms(self, generator) -> None:
        """The round's uniforms, in the eager loop's order: the drafter's (DFlash only; a
        FunctionDrafter or AR drafter draws its own), the acceptance tests', the emitted token's."""
        if self.temperature == 0:
            return
        if self.static_draft:
            torch.rand(self.u_draft.shape, generator=generator, out=self.u_draft)
        torch.rand(self.u.shape, generator=generator, out=self.u)
        torch.rand(self.u_final.shape, generator=generator, out=self.u_final)


def _weights_at(model) -> tuple:
    """Where a model's weights live (pointer and dtype of each parameter); () for a function drafter."""
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    return tuple((p.data_ptr(), p.dtype) for p in params)


def graph_key(target: Target, drafter, block_size: int, temperature: float) -> tuple:
    """What a captured decoder depends on: the drafter, block size and temperature, and where both
    models' weights live, since a graph replays the addresses it captured: parameters replaced
    (``.to``, ``.float``, a new ``nn.Parameter``) on either model mean a new capture. In-place
    updates (``load_state_dict``, an optimizer step) keep the addresses and the graph sees them."""
    return (id(drafter), block_size, float(temperature), _weights_at(target), _weights_at(drafter))


def decoder_for(target: Target, drafter, block_size: int, temperature: float, graphs: bool) -> StaticDecoder:
    """A :class:`StaticDecoder`, kept on the target when its steps are CUDA graphs (capture once per
    drafter, block size and temperature, replay in every later call); built fresh otherwise."""
    capture = bool(graphs) and target.device.type == "cuda"
    if not capture:
        return StaticDecoder(target, drafter, block_size, temperature, graphs=False)
    store = target.__dict__.setdefault("_static_decoders", {})
    key = graph_key(target, drafter, block_size, temperature)
    dec = store.get(key)
    if dec is None or dec.drafter is not drafter:
        dec = store[key] = StaticDecoder(target, drafter, block_size, temperature, graphs=True)
    return dec
