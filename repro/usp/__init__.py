"""USP: Unified Sequence Parallelism (fang2024usp), Ulysses x Ring attention on torch.distributed.

Public API::

    from repro.usp import usp_attention, shard, unshard, make_groups
    ulysses_group, ring_group = make_groups(ulysses_degree=2, ring_degree=2)   # collective
    q_l = shard(q, world_size=4, rank=rank, layout="zigzag")                  # [B, S/4, H, D]
    o_l = usp_attention(q_l, k_l, v_l, causal=True, ulysses_group=ulysses_group,
                        ring_group=ring_group, layout="zigzag")               # [B, S/4, H, D]
    o = unshard([o_0, o_1, o_2, o_3], layout="zigzag")                         # [B, S, H, D]

Shards are heads-last, [B, S_local, H, D]; K/V may have fewer heads (GQA). The local attention is
pluggable (``backend="auto" | "sdpa" | "sdpa_cudnn" | "math" | "fa4" | "fa4_gluon"``,
:mod:`repro.usp.local`; ``"auto"`` is cuDNN on CUDA). ``head_groups`` pipelines Ulysses' all-to-alls
behind the attention of other head groups (ring degree 1).
Files: reference.py (single-device attention and the LSE merge), layout.py (contiguous/zigzag),
comm.py (every transfer, with byte counting), ulysses.py (all-to-all, packed and pipelined), ring.py
(ring attention forward/backward), usp.py (the 2-D mesh), cost.py (the communication formulas),
bench.py (one GPU), dist_bench.py (several GPUs: scaling, splits, peers, timeline, traffic; its world,
inputs, references and timed blocks in dist_harness.py),
timeline.py (profiler timeline), ingest.py (summaries for the page), gpu_plan.sh (the GPU run).
"""

from repro.usp.comm import count_bytes
from repro.usp.layout import LAYOUTS, positions, shard, unshard
from repro.usp.usp import make_groups, usp_attention

__all__ = ["LAYOUTS", "count_bytes", "make_groups", "positions", "shard", "unshard", "usp_attention"]
