"""The checks every NSA bench row and lab tool runs against the PyTorch reference, at the row's shape:
sampled query rows (:func:`sample_rows`), Eq. 5 on them (:func:`eq5_rows`), a selection against
Eq. 11's top-n (:func:`check_selection`), the cmp+slc rows of fla's setting (:func:`cmp_slc_reference`),
and fla's own block picks (:func:`fla_picks`), so that fla's output is checked on what it selected.
"""

import torch

from repro.nsa import reference as ref

TOL = 2e-2  # bf16 output against an fp32 reference: a few bf16 roundings (2^-8 each)
GRAD_TOL = 3e-2  # bf16 gradients of two backwards: dK, dV sum bf16-rounded products over many queries
# A selection (block indices) against Eq. 11's top-n under the reference's float64 scores: the k-th
# best picked block may score at most this much (relative) below the k-th best block. Two correct
# kernels with tf32 or bf16 scores pick differently among near-ties only (the bench's random inputs
# put the n-th and (n+1)-th block within about 1e-3 of each other in half of the rows).
SEL_TOL = 1e-2


def sample_rows(t: int, gen: torch.Generator, device: str, n: int = 24) -> torch.Tensor:
    """A sample of query positions (the last always among them) that the checks compare."""
    return torch.cat([torch.randint(0, t, (n,), generator=gen), torch.tensor([t - 1])]).unique().to(device)


def check_selection(picks, q, k_cmp, lse, cfg: ref.NSAConfig, t: int, pos, what: str) -> None:
    """Raise unless ``picks`` [B, P, H, n] (the sampled rows ``pos`` of a length-``t`` sequence) are
    Eq. 11's top-n up to SEL_TOL under the reference's float64 scores for those rows (q [B, P, HQ, D]
    and lse [B, P, HQ] of the rows, k_cmp [B, Nc, H, D])."""
    ns = -(-t // cfg.select_len)
    scores = ref.selection_scores(
        q.double(), k_cmp.double(), lse.double(), ns, cfg.block_len, cfg.stride, cfg.select_len, q_pos=pos
    )
    short = ref.selection_shortfall(
        picks, scores, cfg.n_select, cfg.select_len, cfg.n_initial, cfg.n_local, q_pos=pos
    )
    worst = short.max().item()
    if not worst <= SEL_TOL:
        raise AssertionError(
            f"{what}: the selected blocks fall {worst:.2e} (relative score) short of Eq. 11's top-n "
            f"on the sampled rows (allowed {SEL_TOL:.0e}; inf: a forced block missing or a future block)"
        )


def eq5_rows(q, kc, vc, ks, vs, kw, vw, gates, idx, pos, cfg: ref.NSAConfig):
    """Eq. 5 from the reference on the rows ``pos``, on the given selection ``idx`` [B, T, H, n]."""
    return eq5_at(q[:, pos], kc, vc, ks, vs, kw, vw, gates[:, pos], idx[:, pos], pos, cfg)


def eq5_at(q_rows, kc, vc, ks, vs, kw, vw, gate_rows, idx_rows, pos, cfg: ref.NSAConfig):
    """Eq. 5 from the reference for queries ``q_rows`` at the positions ``pos`` (their gates and
    selected blocks given)."""
    o_c, _ = ref.compressed_attention(q_rows, kc, vc, cfg.block_len, cfg.stride, q_pos=pos)
    o_s = ref.selected_attention(q_rows, ks, vs, idx_rows, cfg.select_len, q_pos=pos)
    o_w = ref.sliding_window_attention(q_rows, kw, vw, cfg.window, q_pos=pos)
    g = gate_rows.float()
    return g[..., 0:1] * o_c + g[..., 1:2] * o_s + g[..., 2:3] * o_w


def cmp_slc_reference(fs: ref.NSAConfig, t: int, pos, cs):
    """``want(idx, what)``: the reference's cmp+slc rows ``pos`` on the selection ``idx``, after
    checking that selection (:func:`check_selection`); ``cs`` the leaves q, k, v and the two gates."""
    ql, kl, vl, g_cmp, g_slc = cs

    def want(idx, what):
        qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
        kc = ref.compress(kd, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vd, ref.mean_pool, fs.block_len, fs.stride)
        o_c, lse_c = ref.compressed_attention(qd[:, pos], kc, vc, fs.block_len, fs.stride, q_pos=pos)
        check_selection(idx[:, pos], qd[:, pos], kc, lse_c, fs, t, pos, f"{what} cmp+slc selection")
        o_s = ref.selected_attention(qd[:, pos], kd, vd, idx[:, pos], fs.select_len, q_pos=pos)
        return g_cmp[:, pos, :, None].float() * o_c + g_slc[:, pos, :, None].float() * o_s

    return want


def fla_picks(fs: ref.NSAConfig, t: int, ql, kl, vl):
    """fla's block indices for these inputs, from the same internal steps parallel_nsa takes (mean
    pooling, its compression kernel for the lse, its top-n kernel)."""
    from fla.ops.nsa.compression import parallel_nsa_compression
    from fla.ops.nsa.parallel import parallel_nsa_topk
    from fla.ops.utils.pooling import mean_pooling

    # parallel_nsa fills in scale = D^-1/2 before these calls; its kernels do not take None
    # (the first run with scale=None ended in a CompilationError of fla's top-n kernel)
    scale = ql.shape[-1] ** -0.5
    bs = fs.select_len
    with torch.no_grad():
        qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
        kc, vc = mean_pooling(kd, bs, None), mean_pooling(vd, bs, None)
        _, lse = parallel_nsa_compression(q=qd, k=kc, v=vc, TK=t, block_size=bs, scale=scale, cu_seqlens=None)
        return parallel_nsa_topk(
            q=qd, k=kc, lse=lse, TK=t, block_counts=fs.n_select, block_size=bs, scale=scale, cu_seqlens=None
        )
