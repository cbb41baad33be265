"""Decoding (yuan2025nsa §5.2, Table 4): one query token at position t (the last of the caches) against
the three branches, counting the KV tokens each branch loads.

One program per (batch, KV head) with the group's G query heads as the rows. The step is two launches
around one ``torch.topk``, with no host synchronisation: ``_decode_cmp_kernel`` runs the compressed
branch and turns its own logits into the block scores of Eqs. 8-10 with Eq. 11's forced and future
blocks already set to +inf and -inf; ``torch.topk`` ranks them; ``_decode_sparse_kernel`` sorts top-k's
picks itself, runs the selected branch and the window, and writes the gated sum of Eq. 5. The position
is a kernel argument, not a tensor, so nothing is read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.nsa import reference as ref
from repro.nsa.common import (
    LOG2E,
    check_block_size,
    check_gates,
    check_qkv,
    check_value_dims,
    group_rows,
    head_constexprs,
    interpreting,
    is_fp32,
    kernel_dims,
    load_cols,
    load_pair,
    normalise,
    online_softmax_step,
    pad_heads,
    softmax_scale,
    value_strides,
)


@triton.jit(do_not_specialize=["t"])
def _decode_cmp_kernel(
    Q, KC, VC, OC, LOGITS, SCORES, COUNTS,
    sqb, sqh, skb, skt, skh,
    t, NC, H, G, NCP, NS, scale_log2,
    STRIDE: tl.constexpr, BLOCK_LEN: tl.constexpr, SELECT_LEN: tl.constexpr,
    N_INITIAL: tl.constexpr, N_LOCAL: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr,
    IEEE: tl.constexpr, D2: tl.constexpr = 0, D_V: tl.constexpr = 0,
):  # fmt: skip
    # Head sizes (common.py): key rows of D (+ D2) columns, value rows of DVAL; v contiguous like k,
    # OC [B, HQ, DVAL].
    # Compressed branch for the decoded token, then the block scores of Eqs. 8-10 from its own logits
    # (stored to the program's scratch row LOGITS [B, HQ, NCP] during the pass, read back once the
    # log-sum-exp is known: no second pass over the compressed keys), with Eq. 11's forced and future
    # blocks set to +inf and -inf so that top-k needs nothing else.
    DVAL: tl.constexpr = D if D_V == 0 else D_V
    b, h, HQ, offs_d, g_ok, hq = group_rows(tl.program_id(0), H, G, BG, D)
    offs_dv, svb, svt, svh = offs_d, skb, skt, skh
    if D_V > 0:  # the split path (common.py)
        offs_dv = tl.arange(0, DVAL)
        svb, svt, svh = value_strides(skb, skt, skh, D + D2, DVAL)
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    q2 = q
    if D2 > 0:
        q2 = load_cols(Q, b * sqb, hq * sqh, g_ok, D, D2)
    n_vis = tl.where(t >= BLOCK_LEN - 1, (t - BLOCK_LEN + 1) // STRIDE + 1, 0)
    n_vis = tl.minimum(n_vis, NC)
    m_i = tl.full([BG], -1e30, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, DVAL], tl.float32)
    count = n_vis * 0
    logit_row = LOGITS + (b * HQ + hq[:, None]) * NCP
    for i0 in range(0, n_vis, BN):
        offs_n = i0 + tl.arange(0, BN)
        ok = offs_n < n_vis
        kv_off = b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :]
        v_off = kv_off
        if D_V > 0:
            v_off = b * svb + h * svh + offs_n[:, None] * svt + offs_dv[None, :]
        k = tl.load(KC + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(VC + v_off, mask=ok[:, None], other=0.0)
        k2 = k
        if D2 > 0:
            k2 = load_cols(KC, b * skb + h * skh, offs_n * skt, ok, D, D2)
        s, m_i, l_i, acc = online_softmax_step(
            q, k, v, ok[None, :], m_i, l_i, acc, scale_log2, IEEE, q2, k2, D2
        )
        tl.store(logit_row + offs_n[None, :], s, mask=g_ok[:, None] & ok[None, :])
        count += tl.sum(ok.to(tl.int32))
    o, _ = normalise(acc, m_i, l_i)
    tl.store(OC + (b * HQ + hq[:, None]) * DVAL + offs_dv[None, :], o, mask=g_ok[:, None])
    tl.store(COUNTS + (b * H + h) * 3, count)
    # Eqs. 8-10 on the stride pieces of d tokens: compression block i is pieces i .. i + C - 1 (C = l/d),
    # selection block j is pieces j R .. j R + R - 1 (R = l'/d). Piece sums P[pi] = sum_c p[pi - c] of
    # p_cmp = exp2(s - lse2) summed over the group's heads (Eq. 10), then R pieces per block: Eq. 9's
    # double sum over m < R, n < C as it is written, BC = BJ R pieces per tile.
    R: tl.constexpr = SELECT_LEN // STRIDE
    C: tl.constexpr = BLOCK_LEN // STRIDE
    tl.debug_barrier()  # the logits stored above are read back by other threads of this program
    lse2 = tl.where(l_i == 0.0, 0.0, m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    own = t // SELECT_LEN  # the decoded token's selection block: blocks after it do not exist yet
    for j0 in range(0, NS, BJ):
        offs_j = j0 + tl.arange(0, BJ)
        piece = j0 * R + tl.arange(0, BC)
        p = tl.zeros([BC], tl.float32)
        for c in tl.static_range(C):
            ic = piece - c
            ok = (ic >= 0) & (ic < n_vis)
            s = tl.load(logit_row + ic[None, :], mask=g_ok[:, None] & ok[None, :], other=float("-inf"))
            p += tl.sum(tl.exp2(s - lse2[:, None]), 0)  # masked logits give 0
        score = tl.sum(tl.reshape(p, [BJ, R]), 1)
        forced = (offs_j < N_INITIAL) | ((offs_j <= own) & (offs_j > own - N_LOCAL))
        score = tl.where(forced, float("inf"), score)
        score = tl.where(offs_j > own, float("-inf"), score)
        tl.store(SCORES + (b * H + h) * NS + offs_j, score, mask=offs_j < NS)


@triton.jit(do_not_specialize=["t"])
def _decode_sparse_kernel(
    Q, K, V, KW, VW, TOP_VAL, TOP_IDX, OC, GATES, O, BI, COUNTS,
    sqb, sqh, skb, skt, skh, swb, swt, swh,
    t, H, G, S, K_TOP, NS, WINDOW, scale_log2,
    D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr, BSEL: tl.constexpr,
    IEEE: tl.constexpr, D2: tl.constexpr = 0, D_V: tl.constexpr = 0,
):  # fmt: skip
    # Eq. 11's block indices from top-k's K_TOP picks (TOP_VAL, TOP_IDX [B, H, K_TOP]): a pick of
    # -inf (a block that does not exist yet) is none; the rest sorted ascending, none last as -1, padded
    # to S, and written to BI [B, H, S]. Then the selected branch (those blocks of BS tokens) and the
    # sliding window (the last WINDOW tokens), and the gated sum of Eq. 5 with the compressed output OC.
    # Head sizes as in _decode_cmp_kernel: q, K, KW rows of D (+ D2), V, VW, OC, O rows of DVAL.
    DVAL: tl.constexpr = D if D_V == 0 else D_V
    pid = tl.program_id(0)
    b, h, HQ, offs_d, g_ok, hq = group_rows(pid, H, G, BG, D)
    offs_dv, svb, svt, svh, swvb, swvt, swvh = offs_d, skb, skt, skh, swb, swt, swh
    if D_V > 0:  # the split path (common.py)
        offs_dv = tl.arange(0, DVAL)
        svb, svt, svh = value_strides(skb, skt, skh, D + D2, DVAL)
        swvb, swvt, swvh = value_strides(swb, swt, swh, D + D2, DVAL)
    slot = tl.arange(0, BSEL)
    picked = slot < K_TOP
    val = tl.load(TOP_VAL + (b * H + h) * K_TOP + slot, mask=picked, other=float("-inf"))
    key = tl.load(TOP_IDX + (b * H + h) * K_TOP + slot, mask=picked, other=0).to(tl.int32)
    key = tl.where(val == float("-inf"), NS, key)  # none sorts after every real block
    # the picks are distinct blocks: a pick's place in ascending order is how many picks are smaller
    rank = tl.sum((key[None, :] < key[:, None]).to(tl.int32), 1)
    blocks = tl.min(tl.where(rank[None, :] == slot[:, None], key[None, :], NS), 1)
    blocks = tl.where(blocks == NS, -1, blocks)
    tl.store(BI + (b * H + h) * S + slot, blocks, mask=slot < S)
    q = tl.load(Q + b * sqb + hq[:, None] * sqh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    q2 = q
    if D2 > 0:
        q2 = load_cols(Q, b * sqb, hq * sqh, g_ok, D, D2)
    m_s = tl.full([BG], -1e30, tl.float32)
    kv_base = b * skb + h * skh
    v_base = kv_base
    if D_V > 0:
        v_base = b * svb + h * svh
    l_s = tl.zeros([BG], tl.float32)
    acc_s = tl.zeros([BG, DVAL], tl.float32)
    n_slc = pid * 0  # a tensor even when t is specialised to the constant 1
    for si in range(S):
        idx = tl.sum(tl.where(slot == si, blocks, 0))
        kpos = idx * BS + tl.arange(0, BS)
        valid = (idx >= 0) & (kpos <= t)
        kv_off = kpos[:, None] * skt + offs_d[None, :]
        v_off = kv_off
        if D_V > 0:
            v_off = kpos[:, None] * svt + offs_dv[None, :]
        k, v = load_pair(K, V, kv_base, kv_off, valid, v_base, v_off)
        k2 = k
        if D2 > 0:
            k2 = load_cols(K, kv_base, kpos * skt, valid, D, D2)
        _, m_s, l_s, acc_s = online_softmax_step(q, k, v, valid[None, :], m_s, l_s, acc_s, scale_log2, IEEE,
                                                 q2, k2, D2)  # fmt: skip
        n_slc += tl.sum(valid.to(tl.int32))
    m_w = tl.full([BG], -1e30, tl.float32)
    l_w = tl.zeros([BG], tl.float32)
    acc_w = tl.zeros([BG, DVAL], tl.float32)
    n_win = pid * 0
    for i0 in range(tl.maximum(t - WINDOW + 1, 0), t + 1, BN):
        offs_n = i0 + tl.arange(0, BN)
        ok = offs_n <= t
        kv_off = b * swb + offs_n[:, None].to(tl.int64) * swt + h * swh + offs_d[None, :]
        v_off = kv_off
        if D_V > 0:
            v_off = b * swvb + offs_n[:, None].to(tl.int64) * swvt + h * swvh + offs_dv[None, :]
        k = tl.load(KW + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(VW + v_off, mask=ok[:, None], other=0.0)
        k2 = k
        if D2 > 0:
            k2 = load_cols(KW, b * swb + h * swh, offs_n * swt, ok, D, D2)
        _, m_w, l_w, acc_w = online_softmax_step(q, k, v, ok[None, :], m_w, l_w, acc_w, scale_log2, IEEE,
                                                 q2, k2, D2)  # fmt: skip
        n_win += tl.sum(ok.to(tl.int32))
    o_s = acc_s / tl.where(l_s == 0.0, 1.0, l_s)[:, None]
    o_w = acc_w / tl.where(l_w == 0.0, 1.0, l_w)[:, None]
    o_c = tl.load(OC + (b * HQ + hq[:, None]) * DVAL + offs_dv[None, :], mask=g_ok[:, None], other=0.0)
    g_c = tl.load(GATES + (b * HQ + hq) * 3 + 0, mask=g_ok, other=0.0).to(tl.float32)
    g_s = tl.load(GATES + (b * HQ + hq) * 3 + 1, mask=g_ok, other=0.0).to(tl.float32)
    g_w = tl.load(GATES + (b * HQ + hq) * 3 + 2, mask=g_ok, other=0.0).to(tl.float32)
    o = g_c[:, None] * o_c + g_s[:, None] * o_s + g_w[:, None] * o_w
    tl.store(
        O + (b * HQ + hq[:, None]) * DVAL + offs_dv[None, :], o.to(O.dtype.element_ty), mask=g_ok[:, None]
    )
    tl.store(COUNTS + (b * H + h) * 3 + 1, n_slc)
    tl.store(COUNTS + (b * H + h) * 3 + 2, n_win)


def nsa_decode(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_slc: torch.Tensor,
    v_slc: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    config: ref.NSAConfig | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step: the token at position t = T - 1 (already appended to the caches) against
    the three branches, with two Triton kernels that count the KV tokens they load (§5.2), around one
    ``torch.topk`` (Eq. 11); nothing synchronises with the host. The first kernel runs the compressed
    branch and the block scores of Eqs. 8-10, the second sorts top-k's picks and runs the selected
    branch, the window and the gated sum of Eq. 5.

    q [B, 1, HQ, Dk]; k_cmp [B, Nc, H, Dk], v_cmp [B, Nc, H, Dv]; k_slc, k_win [B, T, H, Dk], v_slc,
    v_win [B, T, H, Dv] (the caches); gates [B, 1, HQ, 3]. Returns (o [B, 1, HQ, Dv], block_indices
    [B, 1, H, n], tokens [B, H, 3] int32: compressed, selected and window tokens read per GQA group).
    Head sizes the kernels do not take are zero-padded (``common.kernel_dims``).
    """
    cfg = config or ref.NSAConfig()
    cfg.validate()
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"nsa_decode: q must be one token, [B, 1, HQ, Dk], got {tuple(q.shape)}")
    b, _, hq, h, dk, dv = check_qkv("nsa_decode", q, k_slc, v_slc)
    check_qkv("nsa_decode (window cache)", q, k_win, v_win, k_len=k_slc.shape[1])
    check_qkv("nsa_decode (compressed cache)", q, k_cmp, v_cmp)
    check_value_dims("nsa_decode", v_slc, v_cmp, v_win)
    check_gates("nsa_decode", gates, (b, 1, hq, 3), "[B, 1, HQ, 3]")
    check_block_size("nsa_decode", "select_len", cfg.select_len)
    t_cache = k_slc.shape[1]
    t = t_cache - 1
    nc = k_cmp.shape[1]
    if nc < ref.num_compressed(t_cache, cfg.block_len, cfg.stride):
        raise ValueError(
            f"nsa_decode: the compressed cache holds {nc} tokens, a cache of {t_cache} needs "
            f"{ref.num_compressed(t_cache, cfg.block_len, cfg.stride)}"
        )
    scale = softmax_scale(scale, dk)
    # Everything below is launches and allocations: no value goes to or comes from the host (the
    # position t is a kernel argument, not a tensor), so the host never waits for the stream.
    d, d_v = kernel_dims(dk, dv)
    q, k_cmp, k_slc, k_win = (pad_heads(x, d).contiguous() for x in (q, k_cmp, k_slc, k_win))
    v_cmp, v_slc, v_win = (pad_heads(x, d_v).contiguous() for x in (v_cmp, v_slc, v_win))
    heads = head_constexprs(d, d_v)
    g = hq // h
    bg = max(16, triton.next_power_of_2(g))
    bn = 16 if interpreting() else 64  # keys per step of the compressed and window loops
    ncp = max(nc, 1)
    ns = triton.cdiv(t_cache, cfg.select_len)
    # Score tiles of BC stride pieces = BC / R selection blocks (R = l'/d, a power of two as l' is):
    # [BG, BC] logits per load, 16 tiles at 64k with the paper's R = 4; 32 under the interpreter, so
    # that the tests' few hundred tokens span several tiles.
    r = cfg.select_len // cfg.stride
    bc = max(r, 32 if interpreting() else 256)
    dev, f32 = q.device, torch.float32
    o_cmp = torch.empty(b, hq, d_v, device=dev, dtype=f32)
    logits = torch.empty(b, hq, ncp, device=dev, dtype=f32)  # scratch: read only where written
    scores = torch.empty(b, h, ns, device=dev, dtype=f32)
    counts = torch.empty(b, h, 3, device=dev, dtype=torch.int32)  # every entry written by a kernel
    nw = 4 if max(d, d_v) <= 64 else 8  # [G, D] rows and [BN, D] keys: 8 warps for D = 128
    _decode_cmp_kernel[(b * h,)](
        q, k_cmp, v_cmp, o_cmp, logits, scores, counts,
        q.stride(0), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        t, nc, h, g, ncp, ns, scale * LOG2E,
        STRIDE=cfg.stride, BLOCK_LEN=cfg.block_len, SELECT_LEN=cfg.select_len, N_INITIAL=cfg.n_initial,
        N_LOCAL=cfg.n_local, BN=bn, BG=bg, BJ=bc // r, BC=bc,
        IEEE=is_fp32(q), **heads, num_warps=nw,
    )  # fmt: skip
    # Eq. 11: the same torch.topk as reference.select_blocks, on scores whose forced and future blocks
    # the kernel already set to +inf and -inf; the second kernel sorts and pads its picks.
    top_val, top_idx = scores.topk(min(cfg.n_select, ns), dim=-1)
    bi = torch.empty(b, 1, h, cfg.n_select, device=dev, dtype=torch.int32)
    o = torch.empty_like(q) if d_v == d else q.new_empty(b, 1, hq, d_v)
    _decode_sparse_kernel[(b * h,)](
        q, k_slc, v_slc, k_win, v_win, top_val, top_idx, o_cmp, gates.contiguous(), o, bi, counts,
        q.stride(0), q.stride(2), k_slc.stride(0), k_slc.stride(1), k_slc.stride(2),
        k_win.stride(0), k_win.stride(1), k_win.stride(2),
        t, h, g, cfg.n_select, top_idx.shape[-1], ns, cfg.window, scale * LOG2E,
        BS=cfg.select_len, BN=bn, BG=bg, BSEL=triton.next_power_of_2(cfg.n_select), IEEE=is_fp32(q),
        **heads, num_warps=nw,
    )  # fmt: skip
    return (o if d_v == dv else o[..., :dv]), bi, counts
