"""Communication per rank, as exact byte counts of our code (derived here; checked against what the
code sends, an independent counter and NCCL's own log).

What the papers give: the USP report's cost table (fang2024usp, "Communication and memory analysis",
arXiv v5) names SP-Ulysses' all-to-alls of the activations and SP-Ring's point-to-point K/V
transfers, with the all-to-all's cost written without a 1/P and no volume for the ring;
DeepSpeed-Ulysses (jacobs2023deepspeed, §3.2) gives 4Nh/P per link per layer for its two
all-to-alls. The formulas below are ours; they reduce to those statements where they overlap.

Notation: full sequence S, batch B, H query heads, H_kv key/value heads, head dim D, element size e
bytes (e_acc for gradient accumulators: fp32, or fp64 for fp64 inputs), P = P_u P_r ranks, and
H_kv' = H_kv if P_u | H_kv else lcm(H_kv, P_u) (K/V heads replicated for the Ulysses split).

Ulysses (all-to-all in a group of P_u): a rank's buffer of B (S/P) heads D elements keeps 1/P_u
of itself and sends the rest. Forward moves Q, K, V and O; backward dO, dQ, dK, dV:

    ulysses_fwd = ulysses_bwd = (P_u - 1)/P_u * B (S/P) D (2H + 2H_kv') e

With P_u = P and H_kv = H that is (P-1)/P of 4 B S H D e / P: DeepSpeed-Ulysses' 4Nh/P per link
(its own chunk stays on the rank), falling as 1/P.

Ring (P2P in a group of P_r): each K/V block of B (S/P_r) (H_kv'/P_u) D elements is forwarded
P_r - 1 times; in the backward K/V travel again, and the dK/dV accumulators P_r times (the last hop
brings each home):

    ring_fwd = 2 (P_r - 1) B (S/P_r) (H_kv'/P_u) D e
    ring_bwd = 2 (P_r - 1) B (S/P_r) (H_kv'/P_u) D e + 2 P_r B (S/P_r) (H_kv'/P_u) D e_acc  (P_r > 1)

With P_u = 1 that is 2 (P-1)/P B S H_kv D e: nearly constant in P (our derivation; neither paper
states a ring volume).
"""

from __future__ import annotations

from repro.usp.usp import kv_heads_after_replication

__all__ = ["bytes_per_rank", "ring_pairs"]


def bytes_per_rank(
    *, B: int, S: int, H: int, H_kv: int, D: int, ulysses_degree: int, ring_degree: int, elem: int, acc: int
) -> dict[str, int]:
    """Bytes one rank sends per attention call, by ``"ulysses/fwd"``, ``"ulysses/bwd"``, ``"ring/fwd"``,
    ``"ring/bwd"`` (the keys :func:`repro.usp.comm.count_bytes` uses). ``elem``/``acc``: element sizes of
    the inputs and of the gradient accumulators."""
    pu, pr = ulysses_degree, ring_degree
    p = pu * pr
    h_kv = kv_heads_after_replication(H_kv, pu)
    ulysses = (pu - 1) * B * (S // p) * D * (2 * H + 2 * h_kv) * elem // pu
    block = B * (S // pr) * (h_kv // pu) * D
    ring_fwd = 2 * (pr - 1) * block * elem
    ring_bwd = 2 * (pr - 1) * block * elem + (2 * pr * block * acc if pr > 1 else 0)
    return {"ulysses/fwd": ulysses, "ulysses/bwd": ulysses, "ring/fwd": ring_fwd, "ring/bwd": ring_bwd}


def ring_pairs(layout: str, causal: bool, n: int, length: int) -> list[int]:
    """Unmasked (query, key) pairs each ring rank computes over the n steps, per batch and head, for a
    ring-local length ``length`` (from :func:`repro.usp.ring.step_plan`): the work the layout balances."""
    from repro.usp.ring import step_plan

    out = []
    for r in range(n):
        total = 0
        for t in range(n):
            for qs, ks, c in step_plan(layout, causal, n, r, (r - t) % n, length):
                sq, sk = qs.stop - qs.start, ks.stop - ks.start
                total += sq * (sq + 1) // 2 if c else sq * sk
        out.append(total)
    return out
