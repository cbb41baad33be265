"""DFlash (chen2026dflash): block-diffusion drafting for lossless speculative decoding, at toy scale.

Public API:

* :func:`speculative_generate` (target, drafter, prompt_ids ``[P]``, max_new_tokens, *, block_size,
  temperature=0.0, generator=None) -> :class:`SpecOutput` (tokens ``[max_new_tokens]``, accepted
  draft tokens per verification, forwards of each model, ``tau``). The drafter is a
  :class:`DFlashDrafter`, an :class:`EagleDrafter` (the EAGLE-3-style baseline: fused target
  features, one causal layer, training-time test; ``eagle.py``), a :class:`Target` used as a
  classic autoregressive drafter, or a :class:`FunctionDrafter` (any function of the emitted
  tokens, for tests and adversaries).
* :func:`generate` (target, prompt_ids ``[P]``, max_new_tokens, temperature=0.0) -> tokens
  ``[max_new_tokens]``: plain target decoding.
* ``mode="graphs"`` (both functions): the capturable static steps of ``static.py`` replayed as CUDA
  graphs on a CUDA target (eagerly elsewhere; ``"static"``: eagerly everywhere); the default
  ``"auto"`` is graphs on a CUDA target and ``"eager"`` (the plain loop) elsewhere.
* :func:`accept_tokens` (``verify.py``): the greedy and rejection-sampling acceptance rule, batched
  on the device; every drafter goes through it.
* Models (``model.py``): :class:`Target`, :class:`DFlashDrafter`, their configs; training in
  ``train.py`` (``python -m repro.dflash.train``); the corpus (the Python standard library's
  source, byte tokens) in ``data.py``; the from-scratch reference loop in ``reference.py``.
"""

from __future__ import annotations

from repro.dflash.eagle import EagleConfig, EagleDrafter
from repro.dflash.model import DFlashDrafter, DrafterConfig, KVCache, Target, TargetConfig
from repro.dflash.reference import generate_reference, speculative_generate_reference
from repro.dflash.speculative import (
    FunctionDrafter,
    SpecOutput,
    accept_tokens,
    generate,
    speculative_generate,
)

__all__ = [
    "DFlashDrafter",
    "DrafterConfig",
    "EagleConfig",
    "EagleDrafter",
    "FunctionDrafter",
    "KVCache",
    "SpecOutput",
    "Target",
    "TargetConfig",
    "accept_tokens",
    "generate",
    "generate_reference",
    "speculative_generate",
    "speculative_generate_reference",
]
