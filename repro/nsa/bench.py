"""``python -m repro.nsa.bench --out DIR --budget-s N [--quick] [--breakdown after|only]``: NSA on one GPU at the paper's shape.

The paper's attention shape (yuan2025nsa §5: 64 query heads in 4 GQA groups, head dim 128, bf16),
B = 1, T = 8k .. 64k. Rows (``section``):

* ``train``: forward and forward + backward of
  - ``sdpa-*``: full causal attention, SDPA's backends (flash, cuDNN) at the first length, then the
    faster one; ``fa4``: repro.fa4's Triton attention (up to 16k);
  - ``nsa``: our three branches at the paper's l = 32, d = 16, l' = 64, n = 16, w = 512 (compressed
    keys given: the compression MLP is a small GEMM, left out of both);
  - ``ours-cmp+slc`` and ``fla-cmp+slc``: flash-linear-attention's setting, compression by mean
    pooling with l = d = l' = 64, n = 16, compressed + selected branches with gates, no window (fla's
    window calls flash-attn, absent here), both computing their own top-n;
  - ``ours-slc`` and ``fla-slc``: the selected branch alone on the same block indices.
* ``decode``: one token against caches of T tokens, B = 16: ``nsa-decode`` (our two kernels around one
  ``torch.topk``, no host synchronisation) against ``sdpa-decode`` (full attention, GQA); ``tokens`` is what the decode kernels
  counted per group, ``paper_tokens`` Table 4's number.

The work is a plan of steps, most important first (:func:`plan`): at the first length, ``nsa`` against
SDPA forward ("core"), then the peers forward ("peers": fa4, the cmp+slc and slc rows, fla), then the
same two for forward + backward, then each longer length, then decode. Every step checks each of its
candidates at the step's shape (``Candidate.check``: against the PyTorch reference on a sample of
query rows, fla against our output on the same indices; the first call of a candidate also compiles
its kernels, fla's autotunes), then times them interleaved (``paperclub.bench.measure``), and writes
the report, so a run that is killed keeps what it measured. A step is not started when the time
spent (from the process's start) plus its predicted cost, compile included, passes ``--budget-s``;
the notes list the steps not reached. Progress goes to stdout, flushed, line by line.

``--slc-bwd T,T,...`` times only the selected branch's backwards (:func:`run_slc_backward`): the
query-major one, the block-major one (``ops.TILED_SLC_BWD``) at a few launch shapes and fla's, each
checked against the query-major gradients, in ``results/<device>-slc-bwd.json``.

``--breakdown after`` (or ``only``) then times the forward's stages one by one at ``--breakdown-t``
(default 64k; :func:`run_breakdown`): compressed attention, block scores, block selection, selected
branch, window, gated sum and the whole, checked and interleaved like the rest, in
``results/<device>-breakdown.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from paperclub.bench import Candidate, Report, measure
from paperclub.testing import assert_rel_close, rel_error
from repro.nsa import ops
from repro.nsa import reference as ref

HQ, H, D = 64, 4, 128
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU smoke run changes these (and HQ, H, D)
PAPER = ref.NSAConfig()
FLA_SETUP = ref.NSAConfig(block_len=64, stride=64, select_len=64, n_select=16, n_initial=1, n_local=2)
TABLE4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}
TOL = 2e-2  # bf16 output against an fp32 reference: a few bf16 roundings (2^-8 each)
GRAD_TOL = 3e-2  # bf16 gradients of two backwards: dK, dV sum bf16-rounded products over many queries
# A selection (block indices) against Eq. 11's top-n under the reference's float64 scores: the k-th
# best picked block may score at most this much (relative) below the k-th best block. Two correct
# kernels with tf32 or bf16 scores pick differently among near-ties only (the bench's random inputs
# put the n-th and (n+1)-th block within about 1e-3 of each other in half of the rows).
SEL_TOL = 1e-2
COLUMNS = ["section", "impl", "pass", "B", "T", "ms", "ms_min", "ms_max", "check", "speedup_vs_full"]
COLUMNS += ["tokens", "paper_tokens"]
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}  # SDPBackend names
FA4_MAX_T = 16384  # fa4 rows up to this length (its backward at 32k+ takes longer than the rest)
WARMUP, REP = 5, 20  # per time_ms call (ms for triton's do_bench)
TIMER = None  # measure's default timer (paperclub.bench.time_ms); a test puts a fast one here


def _measure_logged(cands: dict, label: str, rounds: int) -> dict:
    """``measure`` over ``cands`` ({name: Candidate}) with each timing logged as ``label: timed NAME``.
    Each candidate's fn is wrapped in a closure of its own so that the timer can name it by id."""
    from paperclub.bench import time_ms

    names, named = {}, {}
    for name, c in cands.items():
        fn = lambda f=c.fn: f()  # noqa: E731
        names[id(fn)] = name
        named[name] = Candidate(fn=fn, check=c.check)

    def timer(fn, warmup, rep):
        ms = (TIMER or time_ms)(fn, warmup=warmup, rep=rep)
        log(f"{label}: timed {names[id(fn)]}: {ms:.3f} ms")
        return ms

    return measure(named, rounds=rounds, warmup=WARMUP, rep=REP, timer=timer)


# The predicted cost of a step whose pass has not run yet, as a multiple of the first forward core
# step (which includes compiling the forward kernels): fwd+bwd compiles about twice as many kernels
# (dQ and dK/dV per branch), peers compile fa4 and fla (whose parallel_nsa autotunes 12-16 launch
# configurations per kernel), decode two kernels and SDPA's decode.
FIRST_COST = {("fwd", "core"): 1.0, ("fwd", "peers"): 2.0, ("fwd+bwd", "core"): 3.0}
FIRST_COST |= {("fwd+bwd", "peers"): 6.0, ("decode", "core"): 0.5}
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[nsa bench {elapsed():6.1f} s] {msg}", flush=True)


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so that the budget counts Python's and
    torch's start-up as the job that kills the run does; 0 where that cannot be read."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


_AGE0 = process_age()


def elapsed() -> float:
    """Seconds since the process started."""
    return _AGE0 + time.perf_counter() - _T0


def load_fla():
    """fla's parallel_nsa, or (None, why) when it cannot be imported."""
    try:
        from fla.ops.nsa.parallel import parallel_nsa

        return parallel_nsa, ""
    except Exception as exc:  # optional peer
        return None, f"import fla.ops.nsa failed: {type(exc).__name__}: {exc}"


def sample_rows(t: int, gen: torch.Generator, n: int = 24) -> torch.Tensor:
    return torch.cat([torch.randint(0, t, (n,), generator=gen), torch.tensor([t - 1])]).unique().to(DEVICE)


def full_rows(q, k, v, pos):
    return ref.full_causal_attention(q[:, pos], k, v, q_pos=pos)


def train_inputs(t: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, device=DEVICE, dtype=DTYPE, generator=g)

    q = rn(1, t, HQ, D)
    kv = [rn(1, t, H, D) for _ in range(6)]
    gates = torch.rand(1, t, HQ, 3, device=DEVICE, generator=g).to(DTYPE)
    return q, kv, gates


def fwd_bwd(f, leaves):
    """A closure running f's forward and the backward of a random cotangent (drawn on the first call)."""
    state = {}

    def run():
        o = f()
        if "do" not in state:
            state["do"] = torch.randn_like(o)
        torch.autograd.grad(o, leaves, state["do"], allow_unused=True)

    return run


def sdpa_fn(q, k, v, backend):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o

    return run


def _failing(err: str):
    def fail():
        raise RuntimeError(err)

    return fail


def check_selection(picks, q, k_cmp, lse, cfg: ref.NSAConfig, t: int, pos, what: str) -> None:
    """Raise unless ``picks`` [B, P, H, n] (the sampled rows ``pos`` of a length-``t`` sequence) are
    Eq. 11's top-n up to SEL_TOL under the reference's float64 scores for those rows (q [B, P, HQ, D]
    and lse [B, P, HQ] of the rows, k_cmp [B, Nc, H, D])."""
    ns = -(-t // cfg.select_len)
    scores = ref.selection_scores(q.double(), k_cmp.double(), lse.double(), ns, cfg.block_len, cfg.stride,
                                  cfg.select_len, q_pos=pos)  # fmt: skip
    short = ref.selection_shortfall(picks, scores, cfg.n_select, cfg.select_len, cfg.n_initial, cfg.n_local,
                                    q_pos=pos)  # fmt: skip
    worst = short.max().item()
    if not worst <= SEL_TOL:
        raise AssertionError(
            f"{what}: the selected blocks fall {worst:.2e} (relative score) short of Eq. 11's top-n "
            f"on the sampled rows (allowed {SEL_TOL:.0e}; inf: a forced block missing or a future block)"
        )


def train_candidates(t: int, fla, sdpa_backends: dict, with_fa4: bool, gen: torch.Generator,
                     passes=("fwd", "fwd+bwd"), group: str = "all"):  # fmt: skip
    """{(impl, pass): Candidate} for one length: ``group`` "core" (SDPA and nsa), "peers" (fa4,
    cmp+slc, slc, fla) or "all"; only the ``passes`` asked for."""
    core, peers = group in ("core", "all"), group in ("peers", "all")
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(t)
    pos = sample_rows(t, gen)
    cands = {}
    cache = {}

    def ref_full():  # the reference rows of full attention, computed once, when a check needs them
        if "full" not in cache:
            cache["full"] = full_rows(q, ks, vs, pos)
        return cache["full"]

    if core:  # full attention: [B, HQ, T, D] with the KV heads repeated for SDPA's kernels
        qt = q.transpose(1, 2).contiguous().requires_grad_()
        kt = ks.repeat_interleave(HQ // H, 2).transpose(1, 2).contiguous().requires_grad_()
        vt = vs.repeat_interleave(HQ // H, 2).transpose(1, 2).contiguous().requires_grad_()
        for name, backend in sdpa_backends.items():
            f = sdpa_fn(qt, kt, vt, backend)

            def check(f=f):
                assert_rel_close(f().transpose(1, 2)[:, pos].float(), ref_full(), TOL, "sdpa rows")

            cands[(name, "fwd")] = Candidate(fn=f, check=check)
            cands[(name, "fwd+bwd")] = Candidate(fn=fwd_bwd(f, (qt, kt, vt)), check=check)
    if peers and with_fa4:
        try:
            from repro.fa4 import attention

            ql4, kl4, vl4 = (x.detach().clone().requires_grad_() for x in (q, ks, vs))

            def f4():
                return attention(ql4, kl4, vl4, causal=True)

            def check4():
                assert_rel_close(f4()[:, pos].float(), ref_full(), TOL, "fa4 rows")

            cands[("fa4", "fwd")] = Candidate(fn=f4, check=check4)
            cands[("fa4", "fwd+bwd")] = Candidate(fn=fwd_bwd(f4, (ql4, kl4, vl4)), check=check4)
        except Exception as exc:
            fail = _failing(f"{type(exc).__name__}: {exc}")
            for p in ("fwd", "fwd+bwd"):
                cands[("fa4", p)] = Candidate(fn=fail, check=fail)

    # NSA at the paper's configuration
    cfg = PAPER
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)]

    def nsa():
        return ops.nsa_attention(*leaves, cfg)[0]

    def check_nsa():
        o, idx = ops.nsa_attention(*leaves, cfg)
        ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = (x.detach() for x in leaves)
        o_c, lse_c = ref.compressed_attention(ql[:, pos], kcl, vcl, cfg.block_len, cfg.stride, q_pos=pos)
        check_selection(idx[:, pos], ql[:, pos], kcl, lse_c, cfg, t, pos, "nsa selection")
        o_s = ref.selected_attention(ql[:, pos], ksl, vsl, idx[:, pos], cfg.select_len, q_pos=pos)
        o_w = ref.sliding_window_attention(ql[:, pos], kwl, vwl, cfg.window, q_pos=pos)
        g = gl[:, pos].float()
        want = g[..., 0:1] * o_c + g[..., 1:2] * o_s + g[..., 2:3] * o_w
        assert_rel_close(o[:, pos].float(), want, TOL, "nsa rows")

    if core:
        cands[("nsa", "fwd")] = Candidate(fn=nsa, check=check_nsa)
        cands[("nsa", "fwd+bwd")] = Candidate(fn=fwd_bwd(nsa, leaves), check=check_nsa)
    if peers:
        cands |= _peer_candidates(t, fla, q, ks, vs, gates, leaves, pos)
    return {k: c for k, c in cands.items() if k[1] in passes}


def _peer_candidates(t, fla, q, ks, vs, gates, leaves, pos):
    """The cmp+slc and slc rows, ours and fla's."""
    cfg, fs = PAPER, FLA_SETUP
    cands = {}
    # flash-linear-attention's setting: mean-pooled compression, l = d = l' = 64, no window
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, ks, vs))
    g_cmp = gates[..., 0].detach().clone().requires_grad_()
    g_slc = gates[..., 1].detach().clone().requires_grad_()
    state = {}

    def ours_cs():
        kc = ref.compress(kl, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vl, ref.mean_pool, fs.block_len, fs.stride)
        o_c, lse = ops.compressed_attention(ql, kc, vc, fs.block_len, fs.stride)
        with torch.no_grad():
            idx = ops.topk_blocks(ops.masked_selection_scores(ql, kc, lse, fs), fs.n_select)
        state["idx"] = idx
        o_s = ops.selected_attention(ql, kl, vl, idx, fs.select_len, check_indices=False)
        return g_cmp[..., None] * o_c + g_slc[..., None] * o_s

    def check_ours_cs():
        o = ours_cs()
        qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
        kc = ref.compress(kd, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vd, ref.mean_pool, fs.block_len, fs.stride)
        o_c, lse_c = ref.compressed_attention(qd[:, pos], kc, vc, fs.block_len, fs.stride, q_pos=pos)
        check_selection(state["idx"][:, pos], qd[:, pos], kc, lse_c, fs, t, pos, "ours cmp+slc selection")
        o_s = ref.selected_attention(qd[:, pos], kd, vd, state["idx"][:, pos], fs.select_len, q_pos=pos)
        want = g_cmp[:, pos, :, None].float() * o_c + g_slc[:, pos, :, None].float() * o_s
        assert_rel_close(o[:, pos].detach().float(), want, TOL, "ours cmp+slc rows")

    cs_leaves = (ql, kl, vl, g_cmp, g_slc)
    cands[("ours-cmp+slc", "fwd")] = Candidate(fn=ours_cs, check=check_ours_cs)
    cands[("ours-cmp+slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(ours_cs, cs_leaves), check=check_ours_cs)

    # the selected branch alone, on the indices the paper configuration selects for these inputs
    # (computed on first use, so that a failing kernel fails this row's check, not the whole run)
    sl = (ql, kl, vl)

    def indices():
        if "slc_idx" not in state:
            with torch.no_grad():
                state["slc_idx"] = ops.nsa_attention(*[x.detach() for x in leaves], cfg)[1]
        return state["slc_idx"]

    def ours_slc():
        return ops.selected_attention(ql, kl, vl, indices(), cfg.select_len, check_indices=False)

    def check_ours_slc():
        want = ref.selected_attention(
            ql.detach()[:, pos], kl.detach(), vl.detach(), indices()[:, pos], cfg.select_len, q_pos=pos
        )
        assert_rel_close(ours_slc()[:, pos].detach().float(), want, TOL, "ours slc rows")

    cands[("ours-slc", "fwd")] = Candidate(fn=ours_slc, check=check_ours_slc)
    cands[("ours-slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(ours_slc, sl), check=check_ours_slc)

    parallel_nsa, why = fla
    if parallel_nsa is None:
        for name in ("fla-cmp+slc", "fla-slc"):
            for p in ("fwd", "fwd+bwd"):
                missing = _failing(why)
                cands[(name, p)] = Candidate(fn=missing, check=missing)
        return cands

    def fla_cs():
        return parallel_nsa(ql, kl, vl, g_cmp=g_cmp, g_slc=g_slc, block_counts=fs.n_select,
                            block_size=fs.select_len, window_size=0)  # fmt: skip

    def check_fla_cs():
        # fla picks its own blocks from its own bf16 scores: its picks must be a top-n up to SEL_TOL
        # (as ours), and its output must equal the reference computed on its own picks
        a = fla_cs().float()
        assert torch.isfinite(a).all(), "fla cmp+slc: non-finite output"
        picks = fla_picks()
        qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
        kc = ref.compress(kd, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vd, ref.mean_pool, fs.block_len, fs.stride)
        o_c, lse_c = ref.compressed_attention(qd[:, pos], kc, vc, fs.block_len, fs.stride, q_pos=pos)
        check_selection(picks[:, pos], qd[:, pos], kc, lse_c, fs, t, pos, "fla cmp+slc selection")
        o_s = ref.selected_attention(qd[:, pos], kd, vd, picks[:, pos], fs.select_len, q_pos=pos)
        want = g_cmp[:, pos, :, None].float() * o_c + g_slc[:, pos, :, None].float() * o_s
        assert_rel_close(a[:, pos], want, TOL, "fla cmp+slc rows (on fla's own picks)")

    def fla_picks():
        """fla's block indices for these inputs, from the same internal steps parallel_nsa takes
        (mean pooling, its compression kernel for the lse, its top-n kernel)."""
        from fla.ops.nsa.compression import parallel_nsa_compression
        from fla.ops.nsa.parallel import parallel_nsa_topk
        from fla.ops.utils.pooling import mean_pooling

        # parallel_nsa fills in scale = D^-1/2 before these calls; its kernels do not take None
        # (the first run with scale=None ended in a CompilationError of fla's top-n kernel)
        scale = ql.shape[-1] ** -0.5
        with torch.no_grad():
            qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
            kc, vc = mean_pooling(kd, fs.select_len, None), mean_pooling(vd, fs.select_len, None)
            _, lse = parallel_nsa_compression(q=qd, k=kc, v=vc, TK=t, block_size=fs.select_len, scale=scale,
                                              cu_seqlens=None)  # fmt: skip
            return parallel_nsa_topk(q=qd, k=kc, lse=lse, TK=t, block_counts=fs.n_select,
                                     block_size=fs.select_len, scale=scale, cu_seqlens=None)  # fmt: skip

    def fla_slc():
        return parallel_nsa(ql, kl, vl, block_indices=indices(), block_counts=cfg.n_select,
                            block_size=cfg.select_len, window_size=0)  # fmt: skip

    def check_fla_slc():
        assert_rel_close(fla_slc().float(), ours_slc().float(), TOL, "fla slc vs ours")

    cands[("fla-cmp+slc", "fwd")] = Candidate(fn=fla_cs, check=check_fla_cs)
    cands[("fla-cmp+slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(fla_cs, cs_leaves), check=check_fla_cs)
    cands[("fla-slc", "fwd")] = Candidate(fn=fla_slc, check=check_fla_slc)
    cands[("fla-slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(fla_slc, sl), check=check_fla_slc)
    return cands


def decode_candidates(t: int, b: int, gen: torch.Generator):
    cfg = PAPER
    g = torch.Generator(device=DEVICE).manual_seed(t)

    def rn(*s):
        return torch.randn(*s, device=DEVICE, dtype=DTYPE, generator=g)

    q = rn(b, 1, HQ, D)
    kc_raw, vc_raw, ks, vs, kw, vw = (rn(b, t, H, D) for _ in range(6))
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    del kc_raw, vc_raw
    gates = torch.rand(b, 1, HQ, 3, device=DEVICE, generator=g).to(DTYPE)
    args = (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)
    counted = {}

    def ours():
        return ops.nsa_decode(*args, cfg)[0]

    def check_ours():
        o, idx, counts = ops.nsa_decode(*args, cfg)
        counted["tokens"] = int(counts[0, 0].sum())
        pos = torch.tensor([t - 1], device=DEVICE)
        a1 = [x[:1] for x in args]
        o_c, _ = ref.compressed_attention(a1[0], a1[1], a1[2], cfg.block_len, cfg.stride, q_pos=pos)
        o_s = ref.selected_attention(a1[0], a1[3], a1[4], idx[:1], cfg.select_len, q_pos=pos)
        o_w = ref.sliding_window_attention(a1[0], a1[5], a1[6], cfg.window, q_pos=pos)
        gg = a1[7].float()
        want = gg[..., 0:1] * o_c + gg[..., 1:2] * o_s + gg[..., 2:3] * o_w
        assert_rel_close(o[:1].float(), want, TOL, "decode row")

    qt, kt, vt = q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)

    def full():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    def check_full():
        want = ref.full_causal_attention(q[:1], ks[:1], vs[:1], q_pos=torch.tensor([t - 1], device=DEVICE))
        assert_rel_close(full()[:1].transpose(1, 2).float(), want, TOL, "sdpa decode row")

    return {
        "nsa-decode": Candidate(fn=ours, check=check_ours),
        "sdpa-decode": Candidate(fn=full, check=check_full),
    }, counted


STAGES = ("cmp", "scores", "select", "slc", "win", "gate")
#: timed beside the stages, not added into their sum: Eq. 11's top-n and sort as one Triton kernel
#: (ops.topk_blocks_fused; the ``select`` stage is whichever ops.FUSED_TOPK makes topk_blocks run), and
#: Eq. 5 as one Triton kernel (ops.gated_sum_fused) and as the five PyTorch ops; the ``gate`` stage is
#: whichever ops.FUSED_GATE makes nsa_attention run
ALTERNATIVES = ("select-fused", "gate-fused", "gate-torch")
BREAKDOWN_COLUMNS = ["stage", "T", "ms", "ms_min", "ms_max", "check", "share_of_whole"]


def breakdown_candidates(t: int, gen: torch.Generator) -> dict[str, Candidate]:
    """The stages of ``ops.nsa_attention``'s forward at the paper's configuration, each alone on the
    inputs the stage before it produced (computed once here), and the whole forward: ``cmp``
    (compressed attention and its lse), ``scores`` (Eqs. 8-10 with Eq. 11's masks, one kernel),
    ``select`` (ops.topk_blocks: torch.topk and the sort kernel unless ops.FUSED_TOPK), ``slc`` (selected branch), ``win`` (sliding
    window), ``gate`` (Eq. 5's gated sum), ``whole``, and beside them the ALTERNATIVES. Leaves require grad as in the ``nsa`` rows, so
    each stage saves what its backward needs, as it does there."""
    cfg = PAPER
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(t)
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    del kc_raw, vc_raw
    leaves = [x.detach().clone().requires_grad_() for x in (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)]
    ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = leaves
    qd, kcd, vcd, ksd, vsd, kwd, vwd = (x.detach() for x in leaves[:7])
    pos = sample_rows(t, gen)
    o_cmp, lse = ops.compressed_attention(ql, kcl, vcl, cfg.block_len, cfg.stride)
    with torch.no_grad():
        scores = ops.masked_selection_scores(ql, kcl, lse, cfg)
        bi = ops.topk_blocks(scores, cfg.n_select)
    o_slc = ops.selected_attention(ql, ksl, vsl, bi, cfg.select_len, check_indices=False)
    o_win = ops.sliding_window_attention(ql, kwl, vwl, cfg.window)

    def cmp():
        return ops.compressed_attention(ql, kcl, vcl, cfg.block_len, cfg.stride)

    def check_cmp():
        o_c, _ = ref.compressed_attention(qd[:, pos], kcd, vcd, cfg.block_len, cfg.stride, q_pos=pos)
        assert_rel_close(cmp()[0][:, pos].float(), o_c, TOL, "compressed rows")

    def sc():
        with torch.no_grad():
            return ops.masked_selection_scores(ql, kcl, lse, cfg)

    def check_sc():  # finite entries against Eqs. 8-10 (on our lse); the masks exactly as Eq. 11's
        got = sc()[:, pos].float()
        want = ref.selection_scores(qd[:, pos], kcd, lse[:, pos], scores.shape[-1], cfg.block_len,
                                    cfg.stride, cfg.select_len, q_pos=pos).float()  # fmt: skip
        own = (pos // cfg.select_len)[:, None]
        j = torch.arange(scores.shape[-1], device=pos.device)[None, :]
        forced = (j < cfg.n_initial) | ((j <= own) & (j > own - cfg.n_local))
        future = (j > own)[None, :, None, :].expand_as(got)
        forced = (forced & ~(j > own))[None, :, None, :].expand_as(got)
        assert torch.isposinf(got[forced]).all() and torch.isneginf(got[future]).all(), "score masks"
        rest = ~forced & ~future
        assert_rel_close(got[rest], want[rest], TOL, "block scores rows")

    def select():
        return ops.topk_blocks(scores, cfg.n_select)

    def check_select():  # the reference's Eq. 11 on the same scores, masks undone (they are its own)
        sub = scores[:, pos].clone()
        want = ref.select_blocks(sub.nan_to_num(posinf=0.0, neginf=0.0), cfg.n_select, cfg.select_len,
                                 cfg.n_initial, cfg.n_local, q_pos=pos)  # fmt: skip
        if not torch.equal(select()[:, pos], want):
            raise AssertionError("topk_blocks differs from reference.select_blocks on the sampled rows")

    def select_fused():
        return ops.topk_blocks_fused(scores, cfg.n_select)

    def check_select_fused():  # a top-n of the same scores, masks undone (ties may pick other blocks)
        sub = scores[:, pos].nan_to_num(posinf=0.0, neginf=0.0)
        short = ref.selection_shortfall(select_fused()[:, pos], sub, cfg.n_select, cfg.select_len,
                                        cfg.n_initial, cfg.n_local, q_pos=pos)  # fmt: skip
        if not (short == 0).all():
            raise AssertionError("topk_blocks_fused is not a top-n on the sampled rows")

    def slc():
        return ops.selected_attention(ql, ksl, vsl, bi, cfg.select_len, check_indices=False)

    def check_slc():
        want = ref.selected_attention(qd[:, pos], ksd, vsd, bi[:, pos], cfg.select_len, q_pos=pos)
        assert_rel_close(slc()[:, pos].float(), want, TOL, "selected rows")

    def win():
        return ops.sliding_window_attention(ql, kwl, vwl, cfg.window)

    def check_win():
        want = ref.sliding_window_attention(qd[:, pos], kwd, vwd, cfg.window, q_pos=pos)
        assert_rel_close(win()[:, pos].float(), want, TOL, "window rows")

    def gate():  # as ops.nsa_attention does it
        return ops.gated_sum(gl, o_cmp, o_slc, o_win)

    def gate_fused():
        return ops.gated_sum_fused(gl, o_cmp, o_slc, o_win)

    def gate_torch():
        g = gl.to(o_cmp.dtype)
        return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win

    def eq5_fp32():  # the check of both gated sums: Eq. 5 in fp32 on the same branch outputs
        g = gl.detach().float()
        return (
            g[..., 0:1] * o_cmp.float() + g[..., 1:2] * o_slc.float() + g[..., 2:3] * o_win.float()
        ).detach()

    def check_gate_fused():
        assert_rel_close(gate_fused().float(), eq5_fp32(), TOL, "fused gated sum")

    def check_gate_torch():
        assert_rel_close(gate_torch().float(), eq5_fp32(), TOL, "PyTorch gated sum")

    def check_gate():
        assert_rel_close(gate().float(), eq5_fp32(), TOL, "gated sum")

    def whole():
        return ops.nsa_attention(*leaves, cfg)[0]

    def check_whole():
        o, idx = ops.nsa_attention(*leaves, cfg)
        if not torch.equal(idx, bi):
            raise AssertionError("nsa_attention's block indices differ from the staged selection")
        assert_rel_close(o.float(), gate().float(), TOL, "whole vs staged")

    fns = dict(cmp=(cmp, check_cmp), scores=(sc, check_sc), select=(select, check_select),
               slc=(slc, check_slc), win=(win, check_win), gate=(gate, check_gate),
               **{"select-fused": (select_fused, check_select_fused), "gate-fused": (gate_fused, check_gate_fused), "gate-torch": (gate_torch, check_gate_torch)}, whole=(whole, check_whole))  # fmt: skip
    return {name: Candidate(fn=f, check=c) for name, (f, c) in fns.items()}


def run_breakdown(out: str | None, t: int, gen: torch.Generator) -> Path:
    """Time each stage of the forward (:func:`breakdown_candidates`) interleaved at one length and write
    ``<device>-breakdown.json``: a row per stage and ``whole``, with its share of ``whole``'s time, and
    a ``sum-of-stages`` row (the stages' medians added, not timed)."""
    log(f"breakdown T={t}: building inputs and the stages")
    res = _measure_logged(breakdown_candidates(t, gen), f"breakdown T={t}", _rounds(t))
    report = Report(
        package="nsa",
        title=f"NSA forward by stage at T = {t} (64 query heads, 4 KV heads, D = 128, bf16)",
        columns=BREAKDOWN_COLUMNS,
        measure_ceilings=False,
    )
    whole = res["whole"].median_ms
    for stage, m in res.items():
        share = m.median_ms / whole if whole and m.median_ms is not None else None
        report.add(stage=stage, T=t, share_of_whole=share, **m.row())
        log(
            f"breakdown T={t}: {stage}: "
            + (f"{m.median_ms:.3f} ms" if m.median_ms is not None else m.row()["check"])
        )
    parts = [res[s].median_ms for s in STAGES]
    total = sum(parts) if all(p is not None for p in parts) else None
    report.add(stage="sum-of-stages", T=t, ms=total, check="not timed: the stages' medians added",
               share_of_whole=total / whole if total is not None and whole else None)  # fmt: skip
    report.notes = (
        "Each stage of ops.nsa_attention's forward alone, on the previous stages' outputs computed once "
        "(paper configuration: l=32, d=16, l'=64, n=16 with 1 initial + 2 local blocks, w=512; compressed "
        "keys given). cmp: compressed attention + lse; scores: Eqs. 8-10 with Eq. 11's masks in one kernel; "
        f"select: topk_blocks (ops.FUSED_TOPK = {ops.FUSED_TOPK}: torch.topk + the sort kernel when False); "
        "select-fused: ops.topk_blocks_fused, the top-n and sort in one kernel, beside the stages; slc: selected branch; win: sliding window; gate: Eq. 5's "
        f"sum as nsa_attention runs it (ops.FUSED_GATE = {ops.FUSED_GATE}); gate-fused / gate-torch: the one "
        "Triton kernel / the five PyTorch ops, beside the stages (not in their sum); whole: nsa_attention. Every stage is checked at this shape first (sampled rows against "
        "the reference; select exactly), then all are timed interleaved (paperclub.bench.measure). "
        "sum-of-stages is the medians added (not timed); whole minus it is launch gaps and checks."
    )
    return report.write(tag="breakdown", out_dir=Path(out) if out else None)


SLC_BWD_COLUMNS = ["impl", "pass", "T", "ms", "ms_min", "ms_max", "check", "vs_fla"]
#: the selected branch's backward, timed by ``--slc-bwd``: impl -> (ops.TILED_SLC_BWD, SLC_TILED_ROWS,
#: SLC_TILED_STAGES); None keeps ops' value. ``ours-slc`` is the query-major backward (the default),
#: ``ours-slc-tiled`` the block-major one at ops' launch shape, the others its alternatives in sm90_check
SLC_BWD_IMPLS = {
    "ours-slc": (False, None, None),
    "ours-slc-tiled": (True, None, None),
    "ours-slc-tiled-r64s1": (True, 64, 1),
    "ours-slc-tiled-r32s1": (True, 32, 1),
}


class _backward_settings:
    """Within the block, ops' selected-branch backward flags set to ``setting`` (SLC_BWD_IMPLS' form);
    restored afterwards."""

    def __init__(self, setting):
        self.values = dict(zip(("TILED_SLC_BWD", "SLC_TILED_ROWS", "SLC_TILED_STAGES"), setting, strict=True))

    def __enter__(self):
        self.saved = {name: getattr(ops, name) for name in self.values}
        for name, value in self.values.items():
            if value is not None:
                setattr(ops, name, value)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(ops, name, value)


def slc_backward_candidates(t: int, fla, gen: torch.Generator) -> dict[tuple[str, str], Candidate]:
    """{(impl, pass): Candidate} for the selected branch alone at length ``t`` on the indices the paper
    configuration selects for the bench's inputs: each of SLC_BWD_IMPLS and fla's ``parallel_nsa``,
    ``bwd`` (the backward of one retained forward, with a fixed cotangent) and ``fwd+bwd``. The checks:
    our query-major backward's forward rows against the reference (as the ``ours-slc`` rows), every
    other of ours its dQ, dK, dV against the query-major backward's within GRAD_TOL, fla its output
    against ours (its gradients' errors against ours are logged)."""
    cfg = PAPER
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(t)
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    with torch.no_grad():
        idx = ops.nsa_attention(q, k_cmp, v_cmp, ks, vs, kw, vw, gates, cfg)[1]
    del kc_raw, vc_raw, kw, vw, gates, k_cmp, v_cmp
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, ks, vs))
    do = torch.randn(q.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(t)).to(
        DTYPE
    )
    pos = sample_rows(t, gen)
    parallel_nsa, why = fla
    forwards = {
        impl: (lambda: ops.selected_attention(*leaves, idx, cfg.select_len, check_indices=False), setting)
        for impl, setting in SLC_BWD_IMPLS.items()
    }
    if parallel_nsa is not None:
        forwards["fla-slc"] = (
            lambda: parallel_nsa(
                *leaves,
                block_indices=idx,
                block_counts=cfg.n_select,
                block_size=cfg.select_len,
                window_size=0,
            ),  # fmt: skip
            (None, None, None),
        )
    cache: dict = {}

    def grads_of(impl):
        f, setting = forwards[impl]
        with _backward_settings(setting):
            return torch.autograd.grad(f(), leaves, do)

    def check(impl):
        def run():
            if impl == "ours-slc":
                f, _ = forwards[impl]
                want = ref.selected_attention(leaves[0].detach()[:, pos], leaves[1].detach(), leaves[2].detach(),
                                              idx[:, pos], cfg.select_len, q_pos=pos)  # fmt: skip
                assert_rel_close(f()[:, pos].detach().float(), want, TOL, "ours slc rows")
                return
            if "base" not in cache:
                cache["base"] = grads_of("ours-slc")
            got = grads_of(impl)
            if impl == "fla-slc":  # fla's forward must agree; its gradients are logged, not required
                with torch.no_grad():
                    a, r = forwards[impl][0](), forwards["ours-slc"][0]()
                assert_rel_close(a.float(), r.float(), TOL, "fla slc vs ours")
                errs = [rel_error(x.float(), y.float()) for x, y in zip(got, cache["base"], strict=True)]
                log(f"slc-bwd T={t}: fla's dq, dk, dv against ours: " + ", ".join(f"{e:.2e}" for e in errs))
                return
            for name, a, r in zip("qkv", got, cache["base"], strict=True):
                assert_rel_close(
                    a.float(), r.float(), GRAD_TOL, f"{impl} d{name} vs the query-major backward"
                )

        return run

    cands = {}
    for impl, (f, setting) in forwards.items():

        def both(f=f, setting=setting):
            with _backward_settings(setting):
                torch.autograd.grad(f(), leaves, do)

        def bwd(f=f, setting=setting, impl=impl):
            with _backward_settings(setting):
                if impl not in cache:
                    cache[impl] = f()  # the forward, once; its graph is kept for every timed backward
                torch.autograd.grad(cache[impl], leaves, do, retain_graph=True)

        cands[(impl, "bwd")] = Candidate(fn=bwd, check=check(impl))
        cands[(impl, "fwd+bwd")] = Candidate(fn=both, check=check(impl))
    if parallel_nsa is None:
        missing = _failing(why)
        for p in ("bwd", "fwd+bwd"):
            cands[("fla-slc", p)] = Candidate(fn=missing, check=missing)
    return cands


def _fla_report(what: str, columns: list[str]) -> Report:
    """A Report of this bench at the paper's shape, fla's parallel_nsa the peer."""
    return Report(
        package="nsa",
        title=f"{what} (64 query heads, 4 KV heads, D = 128, bf16)",
        columns=columns,
        peer="flash-linear-attention (fla-core) 0.6.0, parallel_nsa",
        packages=["fla-core", "flash-linear-attention"],
        measure_ceilings=False,
    )


def run_slc_backward(out: str | None, lengths: list[int], fla, gen: torch.Generator) -> Path:
    """Time the selected branch's backwards (:func:`slc_backward_candidates`) at each length, every
    candidate of one (length, pass) checked and then timed interleaved, and write
    ``<device>-slc-bwd.json`` after each length: the rows the next GPU session reads to decide
    ``ops.TILED_SLC_BWD``'s default (and the tiled kernel's launch shape)."""
    report = _fla_report("NSA selected branch backward", SLC_BWD_COLUMNS)
    report.notes = (
        "The selected branch alone on the paper configuration's block indices for the bench's inputs "
        "(l'=64, n=16). bwd: the backward of one retained forward; fwd+bwd: both. ours-slc: the "
        "query-major backward (dK/dV one (block, query) pair at a time); ours-slc-tiled*: the block-major "
        "backward (ops.TILED_SLC_BWD) at ops' launch shape and the alternatives named (rows of the query "
        "tile, pipelining stages); fla-slc: parallel_nsa. Checked first: ours-slc's forward rows against "
        "the reference, our other candidates' dQ, dK, dV against ours-slc's (GRAD_TOL), fla's output "
        "against ours (its gradients' relative errors against ours are in the log); then each "
        "(T, pass) timed interleaved. vs_fla: fla's time over the row's (above 1: faster than fla)."
    )
    path = None
    for t in lengths:
        log(f"slc-bwd T={t}: building inputs and candidates")
        cands = slc_backward_candidates(t, fla, gen)
        for p in ("bwd", "fwd+bwd"):
            of_pass = {impl: c for (impl, pp), c in cands.items() if pp == p}
            res = _measure_logged(of_pass, f"slc-bwd T={t} {p}", _rounds(t))
            fla_ms = res["fla-slc"].median_ms if "fla-slc" in res else None
            for impl, m in res.items():
                vs = fla_ms / m.median_ms if fla_ms and m.median_ms else None
                report.add(impl=impl, T=t, vs_fla=vs, **{"pass": p}, **m.row())
                log(
                    f"slc-bwd T={t} {p}: {impl}: "
                    + (f"{m.median_ms:.3f} ms" if m.median_ms else m.row()["check"])
                )
        del cands
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        path = report.write(tag="slc-bwd", out_dir=Path(out) if out else None)
    return path


@dataclass(frozen=True)
class Step:
    """One unit of the plan: candidates built, checked, timed and written together."""

    section: str  # "train" or "decode"
    pass_: str  # "fwd", "fwd+bwd" or "decode"
    t: int
    group: str = "core"  # train: "core" (nsa, SDPA) or "peers" (fa4, cmp+slc, slc, fla)
    b: int = 1

    @property
    def name(self) -> str:
        if self.section == "decode":
            return f"decode T={self.t} B={self.b}"
        return f"train {self.pass_} T={self.t} {self.group}"

    @property
    def key(self) -> tuple[str, str, str]:
        return self.section, self.pass_, self.group


def plan(lengths: list[int], decode_batch: int) -> list[Step]:
    """The steps, most important first: each length's forward then forward + backward (ours against
    SDPA, then the peers), shortest length first, then decode at every length."""
    steps = [Step("train", p, t, g) for t in lengths for p in ("fwd", "fwd+bwd") for g in ("core", "peers")]
    return steps + [Step("decode", "decode", t, "core", decode_batch) for t in lengths]


def predict(step: Step, done: dict) -> float | None:
    """Seconds the step should take, compile included; None when nothing has run yet to scale from.

    ``done[key]`` lists (T, build + check seconds, timing seconds) of the finished steps of one
    (section, pass, group), in order. From an earlier length of the same kind: its check part (the
    first one holds the kernels' compile, which does not recur) plus its timing part scaled by
    (T / T0)^2 for training (full attention is quadratic; pessimistic where launch overheads
    dominate) and T / T0 for decode (linear in the cache). Else a multiple (``FIRST_COST``) of the
    first forward core step, whose cost is mostly the forward kernels' compile."""
    runs = done.get(step.key)
    if runs:
        t0, check_s, time_s = runs[-1]
        r = step.t / t0
        check = check_s if len(runs) == 1 else check_s * r
        return check + time_s * (r if step.section == "decode" else r * r)
    base = done.get(("train", "fwd", "core"))
    if not base:
        return None
    return FIRST_COST.get((step.pass_, step.group), 3.0) * (base[0][1] + base[0][2])


def _rounds(t: int) -> int:
    return 3 if t <= 16384 else 2


def run_step(step: Step, fla, backends: dict, gen: torch.Generator) -> tuple[dict, dict, float, float]:
    """Build, check and time one step's candidates. Returns ({impl: Measured}, decode counts,
    build + check seconds, timing seconds)."""
    t_start = time.perf_counter()
    log(f"{step.name}: building inputs and candidates")
    counted: dict = {}
    if step.section == "train":
        cands = train_candidates(step.t, fla, backends, with_fa4=step.t <= FA4_MAX_T, gen=gen,
                                 passes=(step.pass_,), group=step.group)  # fmt: skip
        cands = {impl: c for (impl, _), c in cands.items()}
    else:
        cands, counted = decode_candidates(step.t, step.b, gen)
    spent = {"check": 0.0}

    def wrap_check(impl, check):
        def run():
            log(f"{step.name}: {impl}: checking (its first call compiles its kernels, autotunes fla's)")
            t0 = time.perf_counter()
            try:
                check()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
            except Exception as exc:
                log(f"{step.name}: {impl}: check FAILED after {time.perf_counter() - t0:.1f} s: "
                    f"{type(exc).__name__}: {str(exc)[:200]}")  # fmt: skip
                raise
            finally:
                spent["check"] += time.perf_counter() - t0
            log(f"{step.name}: {impl}: check ok ({time.perf_counter() - t0:.1f} s)")

        return run

    named = {
        impl: Candidate(fn=c.fn, check=wrap_check(impl, c.check) if c.check else None)
        for impl, c in cands.items()
    }
    rounds = _rounds(step.t)
    build_s = time.perf_counter() - t_start
    log(f"{step.name}: {len(named)} candidates ({', '.join(named)}) built in {build_s:.1f} s; checking, then "
        f"{rounds} interleaved timing rounds")  # fmt: skip
    res = _measure_logged(named, step.name, rounds)
    total = time.perf_counter() - t_start
    check_s = build_s + spent["check"]
    return res, counted, check_s, max(0.0, total - check_s)


def run(
    out: str | None, budget_s: float, quick: bool, lengths: list[int], decode_batch: int, tag: str = ""
) -> Path:
    from torch.nn.attention import SDPBackend

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    steps = plan(lengths, decode_batch)
    log(f"device {device}; budget {budget_s:g} s from the process's start; plan of {len(steps)} steps: "
        + ", ".join(s.name for s in steps))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    log("importing fla (the peer)")
    fla = load_fla()
    log("fla: " + ("imported" if fla[0] is not None else fla[1]))
    report = _fla_report("NSA forward, backward and decode", COLUMNS)
    for p in ("fwd", "fwd+bwd"):
        report.plot(title=f"{p} time", x="T", y="ms", series="impl", where={"section": "train", "pass": p},
                    logx=True, logy=True)  # fmt: skip
    report.plot(
        title="decode step time", x="T", y="ms", series="impl", where={"section": "decode"}, logx=True
    )
    notes = [] if fla[0] is not None else [fla[1]]
    backends = {n: getattr(SDPBackend, b) for n, b in SDPA_BACKENDS.items()}
    fixed = (
        "nsa: paper configuration l=32, d=16, l'=64, n=16 (1 initial + 2 local), w=512, compressed keys "
        "given (mean-pooled here; the compression MLP is outside the timing). cmp+slc rows: fla's setting "
        "(mean pooling, l=d=l'=64, n=16, no window). slc rows: the selected branch alone on one set of "
        "indices. Each step checks every candidate's forward output at the row's shape (sampled query rows "
        "against the PyTorch reference; fla against ours) before timing; fwd+bwd rows are checked on "
        "the forward (the gradients are the tests' business). Rows of one step (a length, a pass, and "
        "'core' = nsa and SDPA or 'peers' = fa4, cmp+slc, slc) are timed interleaved "
        "(paperclub.bench.measure). speedup_vs_full: the fastest full-attention (SDPA) time over this "
        "row's, same pass and length."
    )
    done: dict = {}
    full_ms: dict = {}
    skipped: list[Step] = []

    def write(final: bool) -> Path:
        pending = [s.name for s in steps if s not in finished and s not in skipped]
        parts = [*notes]
        if skipped:
            parts.append(
                f"Not measured (time budget of {budget_s:g} s): {', '.join(s.name for s in skipped)}."
            )
        if pending and not final:
            parts.append(
                f"Not reached (the run was still going when this file was written): {', '.join(pending)}."
            )
        report.notes = " ".join([*parts, fixed])
        if final:
            report.measure_ceilings = not quick and elapsed() < budget_s
        return report.write(tag=tag, out_dir=Path(out) if out else None)

    finished: list[Step] = []
    for i, step in enumerate(steps):
        pred = predict(step, done)
        now = elapsed()
        if pred is not None and now + pred > budget_s:
            log(f"step {i + 1}/{len(steps)} {step.name}: not started, {now:.0f} s spent + {pred:.0f} s "
                f"predicted > budget {budget_s:g} s")  # fmt: skip
            skipped.append(step)
            continue
        log(f"step {i + 1}/{len(steps)} {step.name}: starting (predicted "
            + (f"{pred:.0f} s" if pred is not None else "unknown: the first step") + ")")  # fmt: skip
        try:
            res, counted, check_s, time_s = run_step(step, fla, backends if step.group == "core" else {}, gen)
        except Exception as exc:  # e.g. out of memory while building the inputs: record it, go on
            log(f"{step.name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
            report.add(section=step.section, impl="all", B=step.b, T=step.t, check=f"failed: {type(exc).__name__}: {exc}"[:300],
                       **{"pass": step.pass_})  # fmt: skip
            finished.append(step)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            write(final=False)
            continue
        done.setdefault(step.key, []).append((step.t, check_s, time_s))
        if step.section == "decode":
            full = res["sdpa-decode"].median_ms
            for impl, m in res.items():
                sp = full / m.median_ms if full and m.median_ms else None
                tokens = counted.get("tokens") if impl == "nsa-decode" else step.t
                report.add(section="decode", impl=impl, B=step.b, T=step.t, speedup_vs_full=sp, tokens=tokens,
                           paper_tokens=TABLE4.get(step.t) if impl == "nsa-decode" else step.t,
                           **{"pass": "decode"}, **m.row())  # fmt: skip
        else:
            for impl, m in res.items():
                if impl.startswith("sdpa") and m.median_ms is not None:
                    key = (step.t, step.pass_)
                    full_ms[key] = min(full_ms.get(key, math.inf), m.median_ms)
            for impl, m in res.items():
                f = full_ms.get((step.t, step.pass_))
                sp = f / m.median_ms if f and m.median_ms else None
                report.add(section="train", impl=impl, B=1, T=step.t, speedup_vs_full=sp,
                           **{"pass": step.pass_}, **m.row())  # fmt: skip
            if step.pass_ == "fwd+bwd" and step.group == "core" and len(backends) > 1:
                fb = {n: res[n].median_ms for n in backends if n in res and res[n].median_ms}
                if fb:  # keep SDPA's faster backend for the longer lengths
                    best = min(fb, key=fb.get)
                    backends = {best: backends[best]}
                    notes.append(
                        f"SDPA backend kept after T={step.t}: {best} (fastest forward + backward there)."
                    )
        for impl, m in res.items():
            log(
                f"{step.name}: {impl}: "
                + (f"{m.median_ms:.3f} ms" if m.median_ms is not None else m.row()["check"])
            )
        log(
            f"{step.name}: done ({check_s:.1f} s building and checking, {time_s:.1f} s timing); writing the report"
        )
        finished.append(step)
        del res
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        write(final=False)
    path = write(final=True)
    log(f"finished; {len(finished)} of {len(steps)} steps run")
    return path


def main() -> None:
    log(f"starting (torch {torch.__version__} imported)")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for the result JSON (default repro/nsa/results)")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="do not start a step that would end after this many seconds (from the process's start)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="T = 8k only")
    ap.add_argument("--lengths", default="", help="comma-separated T values (default 8k,16k,32k,64k)")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--tag", default="",
                    help="suffix of the plan's result file, <device>-<tag>.json (a run at some lengths "
                    "beside the file of a run at every length)")  # fmt: skip
    ap.add_argument("--breakdown", choices=("no", "after", "only"), default="no",
                    help="time the forward's stages at --breakdown-t (own file, <device>-breakdown.json): "
                    "after the plan (if the budget is not spent) or instead of it")  # fmt: skip
    ap.add_argument("--breakdown-t", type=int, default=65536)
    ap.add_argument("--slc-bwd", default="", metavar="T,T,...",
                    help="instead of the plan: time the selected branch's backwards (ours query-major, "
                    "ours block-major with ops.TILED_SLC_BWD, fla) at these lengths, <device>-slc-bwd.json")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.bench needs a CUDA GPU")
    if args.slc_bwd:
        run_slc_backward(args.out, [int(x) for x in args.slc_bwd.split(",") if x], load_fla(),
                         torch.Generator().manual_seed(2))  # fmt: skip
        return
    lengths = [int(x) for x in args.lengths.split(",") if x] or ([8192] if args.quick else sorted(TABLE4))
    if args.breakdown != "only":
        run(args.out, args.budget_s, args.quick, sorted(lengths), args.decode_batch, args.tag)
    if args.breakdown != "no":
        if elapsed() >= args.budget_s:
            log(f"breakdown not started: {elapsed():.0f} s spent, budget {args.budget_s:g} s")
            return
        run_breakdown(args.out, args.breakdown_t, torch.Generator().manual_seed(1))


if __name__ == "__main__":
    main()
