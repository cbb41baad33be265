"""The sections the claims cite (claims.yaml), once: the markers must repeat them exactly.

The USP report's sections are cited by subject (the arXiv versions renumber them), with the version
we read: v5 (arXiv 2405.07719v5). DeepSpeed-Ulysses by number (arXiv 2309.14509v2).
"""

ULYSSES_SECTION = "SP approaches: DeepSpeed-Ulysses (arXiv v5)"
RING_SECTION = "SP approaches: Ring-Attention (arXiv v5)"
HYBRID_SECTION = "Unified SP: Ulysses-Ring hybrid (arXiv v5)"
BALANCE_SECTION = "Unified SP: load balance for causal attention (arXiv v5)"
COMM_SECTION = "Communication and memory analysis: the cost table (arXiv v5)"
GQA_SECTION = "Communication and memory analysis: GQA and MQA (arXiv v5)"
DEEPSPEED_SECTION = "§3.2 Communication analysis (arXiv 2309.14509v2)"
PRACTICE_SECTION = "Communication and memory analysis: best practices for 4D parallelism (arXiv v5)"
