"""Parallelism for training (and serving) large models, checked on CPU process groups: the papers of the
archive's sessions 3-12, one module each.

* :mod:`~repro.parallelism.zero`: ZeRO-DP stages 1-3 (rajbhandari2019zero) with nanoparallel's
  reduce-scatter and all-gather, and the paper's per-rank model-state formulas.
* :mod:`~repro.parallelism.megatron`: Megatron-LM's tensor-parallel MLP and attention
  (shoeybi2019megatron), two all-reduces per layer and pass.
* :mod:`~repro.parallelism.sequence_parallel`: sequence parallelism and the activation-memory count of
  korthikanti2022reducing, measured byte for byte (:class:`~repro.parallelism.sequence_parallel.SavedActivations`).
* :mod:`~repro.parallelism.async_tp`: the all-gather + matmul and matmul + reduce-scatter decompositions
  of wang2023overlap (PyTorch's async tensor parallelism); ``bench.py`` times them on GPUs.
* :mod:`~repro.parallelism.rsa`: Ring Self-Attention (li2021sequence); Ring Attention itself
  (liu2023ring) is :mod:`repro.usp.ring`, checked here under that paper's claims.
* :mod:`~repro.parallelism.pipeline_schedule` and :mod:`~repro.parallelism.pipeline`: GPipe, 1F1B and the
  zero-bubble schedules (huang2018gpipe, harlap2018pipedream, qi2024zero), a simulator that counts their
  bubbles and a runner that executes them over gloo.

Everything runs on torch.distributed process groups (gloo on CPU, NCCL on GPUs); group ``None`` is
one rank. The layer layout is Megatron's [s, b, h].

``pytest repro/parallelism`` checks the claims on one world of 4 CPU worker processes (about a minute
on 2 cores); ``claims.yaml`` registers every claim of the eleven papers of those sessions, each with its
paper, the ones no CPU test can check (cluster-scale throughput, serving, quantized LLMs, MoE kernels)
as not reproducible with the reason. On GPUs, ``python -m repro.parallelism.bench`` (one rank per
visible GPU, at least 2) times the async-TP decomposition against the plain pair and PyTorch's
symmetric-memory ops, and ``tests/test_gpu.py`` checks it on NCCL: both are written and smoke-tested on
CPU but have not run on a GPU yet, so nothing here is reproduced on a GPU.
"""
