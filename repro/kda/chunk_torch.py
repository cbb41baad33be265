"""The chunkwise-parallel form of KDA in readable PyTorch (kimiteam2025kimilinear §3.1).

Split the sequence into chunks of ``C`` tokens. Inside a chunk, with ``S_0`` the state at its
start, ``G_r = g_1 + ... + g_r`` the cumulative log-decay (per channel) and
``gamma_r = exp(G_r)``:

1. **Delta-rule residual.** Unrolling the update as ``S_r = Diag(alpha_r) S_{r-1} + k_r u_r^T``
   with the "pseudo-value" ``u_r = beta_r (v_r - (Diag(alpha_r) S_{r-1})^T k_r)`` gives
   ``S_r = Diag(gamma_r) S_0 + sum_{i<=r} Diag(gamma_r / gamma_i) k_i u_i^T``.
2. **A triangular system for all u at once (WY representation).** Substituting step 1 into the
   definition of ``u_r`` gives ``(I + A) U = Diag(beta) (V - (K * Gamma) S_0)`` with the strictly
   lower-triangular ``A[r, i] = beta_r <k_r * gamma_r, k_i / gamma_i>`` (i < r). The product of
   the chunk's Householder-like transitions is thereby ``Diag(gamma_C) - (K*(gamma_C/Gamma))^T W``:
   a diagonal plus a rank-C correction, and ``U = U' - W S_0`` with
   ``W = T Diag(beta) (K * Gamma)``, ``U' = T Diag(beta) V``.
3. **UT transform.** ``T = (I + A)^{-1}`` is the inverse of a unit lower-triangular matrix; it is
   computed once per chunk by forward substitution (:func:`ut_transform`).
4. **State passing.** ``S_C = Diag(gamma_C) S_0 + (K * (gamma_C / Gamma))^T U`` carries the state
   to the next chunk: the only sequential step, one small matmul per chunk.
5. **Output.** ``O = scale ((Q * Gamma) S_0 + A_qk U)``, with
   ``A_qk[r, i] = <q_r * gamma_r, k_i / gamma_i>`` for i <= r.

``gamma_r / gamma_i = exp(G_r - G_i)`` is at most 1 for i <= r, but ``1 / gamma_i`` alone
overflows once the decay inside a chunk is strong. :func:`chunk_matrices` therefore factors each
16-row block against its own reference point in the middle of the block (see there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repro.kda.validate import check_kda_inputs

SUB_BLOCK = 16


def chunk_matrices(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two intra-chunk matrices of §3.1, computed with matmuls only.

    q, k, G ``[..., C, K]`` (G: cumulative log-decay inside the chunk); beta ``[..., C]``.
    Returns ``A_kk [..., C, C]`` (strictly lower, rows scaled by beta) and
    ``A_qk [..., C, C]`` (lower including the diagonal, times ``scale``), where

        A_kk[r, i] = beta_r sum_c k_rc k_ic exp(G_rc - G_ic)   (i < r)
        A_qk[r, i] = scale sum_c q_rc k_ic exp(G_rc - G_ic)    (i <= r)

    Why the blocks: ``exp(G_r - G_i) = exp(G_r - G_ref) exp(G_ref - G_i)`` turns the sum into a
    matmul; with ``ref`` in the middle of the row block both factors stay within
    ``exp(+-8 |g|_max)``, so fp32 represents them exactly for per-token log-decays ``g >= -10``.
    Columns left of the row block have ``G_ref - G_i <= 0`` and cannot overflow at all.
    """
    C = k.shape[-2]
    sub = min(SUB_BLOCK, C)
    if C % sub:
        raise ValueError(f"chunk_matrices: chunk size {C} must be a multiple of {sub}")
    kk_rows, qk_rows = [], []
    for a in range(C // sub):
        r0, r1 = a * sub, (a + 1) * sub
        ref = G[..., r0 + sub // 2, :].unsqueeze(-2)  # [..., 1, K], the block's reference point
        row_scale = torch.exp(G[..., r0:r1, :] - ref)
        col_scale = torch.exp(ref - G[..., :r1, :])
        k_cols = k[..., :r1, :] * col_scale
        kk = (k[..., r0:r1, :] * row_scale) @ k_cols.transpose(-1, -2)  # [..., sub, r1]
        qk = (q[..., r0:r1, :] * row_scale) @ k_cols.transpose(-1, -2)
        kk_rows.append(F.pad(kk, (0, C - r1)))
        qk_rows.append(F.pad(qk, (0, C - r1)))
    A_kk = torch.cat(kk_rows, dim=-2)
    A_qk = torch.cat(qk_rows, dim=-2)
    idx = torch.arange(C, device=k.device)
    strictly_lower = idx[:, None] > idx[None, :]
    lower = idx[:, None] >= idx[None, :]
    A_kk = torch.where(strictly_lower, A_kk, 0.0) * beta.unsqueeze(-1)
    A_qk = torch.where(lower, A_qk, 0.0) * scale
    return A_kk, A_qk


def ut_transform(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]`` by forward substitution.

    Row r of ``T = (I + A)^{-1}`` follows from ``T (I + A) = I`` read row-wise from the top, or
    equivalently from ``(I + A) T = I``: ``T_r = e_r - sum_{i<r} A[r, i] T_i``. Each row needs
    only the rows above it, so one pass down the chunk builds T (C steps of a vector-matrix
    product, no pivoting: the diagonal is all ones).
    """
    C = A.shape[-1]
    T = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    for r in range(1, C):
        T[..., r, :] = T[..., r, :] - (A[..., r, :r].unsqueeze(-2) @ T[..., :r, :]).squeeze(-2)
    return T


def ut_transform_blocked(A: torch.Tensor, block: int = SUB_BLOCK) -> torch.Tensor:
    """``(I + A)^{-1}`` the way the Triton kernel computes it: blocks, then a nilpotent series.

    Split ``A = A_d + A_o`` into its ``block x block`` diagonal blocks and the part below them.
    Then ``I + A = (I + A_d)(I + T_d A_o)`` with ``T_d = (I + A_d)^{-1}`` (check: the product is
    ``I + A_d + (I + A_d) T_d A_o = I + A_d + A_o``). ``T_d`` is C/block independent small
    forward substitutions, done together (step j fixes row j of every block); ``N = T_d A_o`` is
    strictly block-lower, so ``N^(C/block) = 0`` and ``(I + N)^{-1} = I - N + N^2 - ...``
    ends after C/block - 1 terms. Every step is a matmul: no loop over the C rows.
    """
    C = A.shape[-1]
    block = min(block, C)
    if C % block:
        raise ValueError(f"ut_transform_blocked: chunk size {C} must be a multiple of the block {block}")
    idx = torch.arange(C, device=A.device)
    same_block = (idx[:, None] // block) == (idx[None, :] // block)
    A_d = torch.where(same_block, A, 0.0)
    A_o = A - A_d
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    T_d = eye.expand(A.shape).clone()
    for j in range(1, block):
        row_j = (idx % block == j)[:, None]
        T_d = torch.where(row_j, T_d - torch.where(row_j, A_d, 0.0) @ T_d, T_d)
    N = T_d @ A_o
    series, power = eye.expand(A.shape).clone(), eye.expand(A.shape).clone()
    for _ in range(1, C // block):
        power = -(power @ N)
        series = series + power
    return series @ T_d


def ut_transform_doubling(A: torch.Tensor, block: int = SUB_BLOCK) -> torch.Tensor:
    """``(I + A)^{-1}`` the way the Triton forward kernel computes it: blocks and repeated squaring.

    As in :func:`ut_transform_blocked`, ``I + A = (I + A_d)(I + N)`` with ``N = T_d A_o``. Both
    ``A_d`` (``A_d^block = 0``) and ``N`` (``N^(C/block) = 0``) are nilpotent, and for a nilpotent
    ``X`` with ``X^(2^m) = 0`` the series ``I - X + X^2 - ...`` factors as
    ``(I - X)(I + X^2)(I + X^4) ... (I + X^(2^(m-1)))``. So ``T_d`` takes log2(block) factors
    (4 for 16) instead of block - 1 substitution steps, and ``(I + N)^{-1}`` log2(C/block).
    Needs power-of-two sizes.
    """
    C = A.shape[-1]
    block = min(block, C)
    if C % block or block & (block - 1) or (C // block) & (C // block - 1):
        raise ValueError(f"ut_transform_doubling: C={C} and block={block} must be powers of two, block | C")
    idx = torch.arange(C, device=A.device)
    same_block = (idx[:, None] // block) == (idx[None, :] // block)
    A_d = torch.where(same_block, A, 0.0)
    A_o = A - A_d
    eye = torch.eye(C, dtype=A.dtype, device=A.device)

    def inverse_of_identity_plus(X: torch.Tensor, nilpotency: int) -> torch.Tensor:
        out, power, reach = eye - X, X, 2
        while reach < nilpotency:  # out = I - X + ... + (-X)^(reach - 1)
            power = power @ power
            out = out + out @ power
            reach *= 2
        return out

    T_d = inverse_of_identity_plus(A_d, block)
    return inverse_of_identity_plus(T_d @ A_o, C // block) @ T_d


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA in PyTorch; same arguments and results as ``repro.kda.chunk_kda``.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
    initial_state ``[B, HV, K, V]``. Any T (the tail chunk is zero-padded: a padded token has
    ``k = 0`` and ``g = 0``, so it neither writes nor decays the state). Computes in fp32
    (fp64 for fp64 inputs); returns o ``[B, T, HV, V]`` in v's dtype and the final state.
    """
    dims = check_kda_inputs(q, k, v, g, beta, initial_state, "chunk_kda_torch", triton=False)
    if (
        not isinstance(chunk_size, int)
        or chunk_size < 1
        or (chunk_size > SUB_BLOCK and chunk_size % SUB_BLOCK)
    ):
        raise ValueError(
            f"chunk_kda_torch: chunk_size must be a positive int, a multiple of 16 above 16; got {chunk_size}"
        )
    B, T, H, K, HV, V = dims.B, dims.T, dims.H, dims.K, dims.HV, dims.V
    scale = K**-0.5 if scale is None else scale
    dt = torch.float64 if torch.float64 in (q.dtype, v.dtype, g.dtype, beta.dtype) else torch.float32
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    group = HV // H

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, HV, D] -> [B, HV, N, C, D], zero-padded at the end
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad))
        return x.transpose(1, 2).reshape(B, HV, N, C, x.shape[-1])

    qc = to_chunks(q.repeat_interleave(group, dim=2))
    kc = to_chunks(k.repeat_interleave(group, dim=2))
    vc = to_chunks(v)
    gc = to_chunks(g)
    bc = to_chunks(beta.unsqueeze(-1)).squeeze(-1)  # [B, HV, N, C]

    G = gc.cumsum(dim=-2)  # cumulative log-decay inside each chunk
    A_kk, A_qk = chunk_matrices(qc, kc, G, bc, scale)
    T_ut = ut_transform(A_kk)  # UT transform: (I + A_kk)^{-1}
    W = T_ut @ (bc.unsqueeze(-1) * kc * torch.exp(G))  # WY factors: U = U' - W S_0
    U_prime = T_ut @ (bc.unsqueeze(-1) * vc)
    q_decayed = qc * torch.exp(G) * scale

    S = torch.zeros(B, HV, K, V, dtype=dt, device=q.device)
    if initial_state is not None:
        S = S + initial_state.to(dt)
    outs = []
    for n in range(N):
        U = U_prime[:, :, n] - W[:, :, n] @ S  # pseudo-values given the incoming state
        outs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ U)
        G_last = G[:, :, n, -1:, :]  # [B, HV, 1, K]
        k_to_end = kc[:, :, n] * torch.exp(G_last - G[:, :, n])  # decay from token i to chunk end
        S = torch.exp(G_last).transpose(-1, -2) * S + k_to_end.transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, HV, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(v.dtype), (S if output_final_state else None)
