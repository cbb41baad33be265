"""NSA on one GPU at the paper's shape, against full attention and flash-linear-attention.

``python -m repro.nsa.bench --out DIR --budget-s N [--heads 192,128 | --heads 128] [--quick] [--only STEP]
[--set SWITCH=VALUE]``.

The paper's attention shape (yuan2025nsa §4.1 and §5.1: 64 query heads in 4 GQA groups, query and key
head size 192, value head size 128; bf16), B = 1, T = 8k .. 64k; ``--heads 128`` runs one head size of
128 for queries, keys and values (our earlier runs' shape, kept for comparison). The file is tagged
with the shape (``dk192-dv128``, ``d128``) unless ``--tag`` names it. Rows (``section``):

* ``train``: forward (``fwd``), backward alone (``bwd``: the backward of one forward kept for every
  timed call, with a fixed cotangent, as the paper's Figure 6 reports it) and forward + backward of
  - ``sdpa-flash`` (FlashAttention-2, the paper's kind of baseline) and ``sdpa-cudnn``: full causal
    attention through SDPA's backends, both at every length. The flash backend takes one head size:
    with Dv < Dk, v is zero-padded to Dk (a leaf of its own, made once) and the output sliced, as the
    notes say; so is cuDNN's if it refuses Dv != Dk. ``fa4``: repro.fa4's attention (up to 16k,
    Dk = Dv in {64, 128} only);
  - ``nsa``: our three branches at the paper's l = 32, d = 16, l' = 64, n = 16, w = 512 (compressed
    keys given: the compression MLP is a small GEMM, left out of both);
  - ``ours-cmp+slc`` and ``fla-cmp+slc``: flash-linear-attention's setting, compression by mean
    pooling with l = d = l' = 64, n = 16, compressed + selected branches with gates, no window (fla's
    window calls flash-attn, absent here), both computing their own top-n;
  - ``ours-slc`` and ``fla-slc``: the selected branch alone on the same block indices;
  - ``nsa-fa4win``: ``nsa`` with the window through repro.fa4 (``Switches.window_kernel = "fa4"``),
    where repro.fa4 has a sliding window (off by default until it has run on a GPU): in "extra" steps
    after every other step, so that a fault in code that has not run on a GPU cannot end the others.
* ``decode``: one token against caches of T tokens, B = 16: ``nsa-decode`` (our two kernels around one
  ``torch.topk``, no host synchronisation) against ``sdpa-decode`` (full attention, GQA; v zero-padded
  to Dk where Dv < Dk, the output sliced, so that SDPA's fused kernels take it); ``tokens`` is
  what the decode kernels counted per group, ``paper_tokens`` Table 4's number.

``tflops`` is the row's matmul FLOP count (:func:`train_flops`) over its time. Every step checks each
candidate at the step's shape (against the PyTorch reference on a sample of query rows; fla against
our output on the same indices; every timed selection against Eq. 11's top-n), then times them in
interleaved rounds (``paperclub.bench.measure``) and writes the report, so a run that is killed keeps
what it measured (``bwd`` and ``fwd+bwd`` rows are checked on the forward; the gradients are the GPU
tests'). The steps run most important first while the budget allows (``paperclub.bench.Plan``): at the
first length ``nsa`` against SDPA forward ("core"), then the peers forward ("peers"), then both for
the backward alone and for forward + backward, then each longer length, then decode.
``--set`` changes a field of ``repro.nsa.config.Switches`` for every NSA row; ``--only`` picks steps
by name (``'train fwd*'``). The checks against the reference are ``repro.nsa.checks``; the loop over
the plan is ``paperclub.bench.run_plan``. The forward's stage breakdown and the selected backward's
launch shapes are timed by ``repro.nsa.lab.breakdown`` and ``repro.nsa.lab.slc_backward``.
"""

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from paperclub.bench import (
    Budget,
    Candidate,
    Plan,
    Report,
    Step,
    apply_settings,
    bench_parser,
    error_text,
    failed_candidate,
    logger,
    measure_logged,
    only_steps,
    parse_bench_args,
    ratio,
    run_plan,
    sdpa_causal,
    time_ms,
    timed_pass,
)
from paperclub.testing import assert_rel_close
from repro.nsa import reference as ref
from repro.nsa.checks import TOL, check_selection, cmp_slc_reference, eq5_at, eq5_rows, fla_picks, sample_rows
from repro.nsa.compression import compressed_attention
from repro.nsa.config import Switches
from repro.nsa.decode import nsa_decode
from repro.nsa.layer import nsa_attention
from repro.nsa.selected import selected_attention
from repro.nsa.selection import masked_selection_scores, topk_blocks

PAPER = ref.NSAConfig()
FLA_SETUP = ref.NSAConfig(block_len=64, stride=64, select_len=64, n_select=16, n_initial=1, n_local=2)
TABLE4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}
COLUMNS = ["section", "impl", "pass", "B", "T", "ms", "ms_min", "ms_max", "check", "speedup_vs_full"]
COLUMNS += ["vs_cudnn", "vs_fa2", "tokens", "paper_tokens", "tflops"]
WARMUP, REP = 5, 20  # per time_ms call (ms for triton's do_bench)
# The predicted cost of a step whose kind has not run yet, as a multiple of the first step (the forward
# core step, which includes compiling the forward kernels): fwd+bwd compiles about twice as many
# kernels (dQ and dK/dV per branch), peers compile fa4 and fla (whose parallel_nsa autotunes 12-16
# launch configurations per kernel), decode two kernels and SDPA's decode.
FIRST_COST = {("fwd", "peers"): 2.0, ("fwd+bwd", "core"): 3.0, ("fwd+bwd", "peers"): 6.0}
FIRST_COST |= {("bwd", "core"): 3.0, ("bwd", "peers"): 6.0, ("decode", "core"): 0.5}
FIRST_COST |= {("fwd", "extra"): 1.0, ("bwd", "extra"): 2.0, ("fwd+bwd", "extra"): 2.0}
PASSES = ("fwd", "bwd", "fwd+bwd")
PEER = {  # the reports' peer and the packages whose versions they record
    "peer": "flash-linear-attention (fla-core) 0.6.0, parallel_nsa",
    "packages": ["fla-core", "flash-linear-attention"],
}
NOTES = (
    "nsa: paper configuration l=32, d=16, l'=64, n=16 (1 initial + 2 local), w=512, compressed keys "
    "given (mean-pooled here; the compression MLP is outside the timing). cmp+slc rows: fla's setting "
    "(mean pooling, l=d=l'=64, n=16, no window). slc rows: the selected branch alone on one set of "
    "indices. Each step checks every candidate's forward output at the row's shape (sampled query rows "
    "against the PyTorch reference; fla against ours) before timing; bwd and fwd+bwd rows are checked "
    "on the forward (the gradients are the tests' business). bwd: the backward of one kept forward "
    "(retain_graph, a fixed cotangent). Rows of one step (a length, a pass, and 'core' = nsa and SDPA "
    "or 'peers' = fa4, cmp+slc, slc) are timed interleaved (paperclub.bench.measure). "
    "speedup_vs_full: the fastest full-attention (SDPA) time over this row's, same pass and length; "
    "vs_cudnn, vs_fa2: SDPA's cuDNN and FlashAttention-2 backends' times over this row's. tflops: the "
    "row's matmul FLOPs (repro.nsa.bench.train_flops) over its time."
)


def load_fla():
    """fla's parallel_nsa, or (None, why) when it cannot be imported."""
    try:
        from fla.ops.nsa.parallel import parallel_nsa

        return parallel_nsa, ""
    except Exception as exc:  # optional peer
        return None, f"import fla.ops.nsa failed: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Setup:
    """What a run measures and with what: the head shape, device and dtype, the NSA configurations,
    the kernels' switches, the SDPA backends, the peer, the timer. The defaults are the paper's shape
    on a GPU (§4.1: 64 query heads, 4 KV heads, Dk = 192, Dv = 128); the CPU tests build a toy one.
    ``d`` is the query and key head size, ``dv`` the value head size (None: ``d``). ``extra_nsa``:
    more ``nsa`` rows, each (name, Switches fields changed), where its ``available`` says it can run."""

    hq: int = 64
    h: int = 4
    d: int = 192
    dv: int | None = 128
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    paper: ref.NSAConfig = PAPER
    fla_setting: ref.NSAConfig = FLA_SETUP
    switches: Switches = field(default_factory=Switches)
    sdpa_backends: tuple[tuple[str, str], ...] = (
        ("sdpa-flash", "FLASH_ATTENTION"),
        ("sdpa-cudnn", "CUDNN_ATTENTION"),
    )
    fa4_max_t: int = 16384  # fa4 rows up to this length (its backward at 32k+ takes longer than the rest)
    rounds: Callable[[int], int] = lambda t: 3 if t <= 16384 else 2  # interleaved rounds at length t
    timer: Callable[..., float] = time_ms
    fla: Callable[[], tuple] = load_fla
    extra_nsa: tuple[tuple[str, dict], ...] = (("nsa-fa4win", {"window_kernel": "fa4"}),)

    @property
    def d_v(self) -> int:
        return self.d if self.dv is None else self.dv

    def heads(self) -> str:
        """The head sizes as a report tag: ``dk192-dv128``, ``d128``."""
        return f"d{self.d}" if self.d_v == self.d else f"dk{self.d}-dv{self.d_v}"


def extra_available(changes: dict) -> tuple[bool, str]:
    """Whether an ``extra_nsa`` row can run here, and why not: the fa4 window needs repro.fa4 with a
    sliding window (``window.fa4_window_available``)."""
    if changes.get("window_kernel") == "fa4":
        from repro.nsa.window import fa4_window_available

        return fa4_window_available()
    return True, ""


log = logger("nsa bench")


# ----------------------------------------------------------------------------------------------
# FLOP counts: the matmuls, 2 FLOP per multiply-add; QK^T and PV per visible key


def keys_per_query(t: int, cfg: ref.NSAConfig) -> dict[str, int]:
    """Keys the queries 0..t-1 read in all, per branch (``reference.tokens_read`` summed)."""
    pos = torch.arange(t, dtype=torch.float64)
    n_cmp = torch.where(pos + 1 >= cfg.block_len, (pos + 1 - cfg.block_len) // cfg.stride + 1, 0)
    own = pos // cfg.select_len
    n_slc = (
        (torch.minimum(own + 1, torch.tensor(float(cfg.n_select))) - 1) * cfg.select_len
        + pos % cfg.select_len
        + 1
    )
    n_win = torch.clamp(pos + 1, max=cfg.window)
    return {"cmp": int(n_cmp.sum()), "slc": int(n_slc.sum()), "win": int(n_win.sum())}


def train_flops(impl: str, pass_: str, t: int, setup: Setup) -> float | None:
    """Matmul FLOPs of one train row at length t (B = 1), 2 per multiply-add, per (query, key) and
    query head: forward QK^T and PV, 2 (Dk + Dv); backward QK^T again, dP = dO V^T, dV = P^T dO,
    dQ = dS K, dK = dS^T Q, 2 (3 Dk + 2 Dv) (2.5 forwards at Dk = Dv). Full attention (padded v or
    not: the useful work): t (t + 1) / 2 keys. NSA: the compressed branch, its keys once more for
    the block scores (QK^T only, forward only), the selected blocks and the window; cmp+slc in fla's
    setting; slc alone. The ``bwd`` pass is the backward's share alone."""
    dk, dv = setup.d, setup.d_v
    unit = {"fwd": 2 * (dk + dv), "bwd": 2 * (3 * dk + 2 * dv)}
    unit["fwd+bwd"] = unit["fwd"] + unit["bwd"]
    per_key = setup.hq * unit[pass_]
    scores = setup.hq * 2 * dk if pass_ != "bwd" else 0  # QK^T per compressed key, forward only
    if impl.startswith("sdpa") or impl == "fa4":
        return per_key * t * (t + 1) / 2
    cfg = setup.fla_setting if "cmp+slc" in impl else setup.paper
    n = keys_per_query(t, cfg)
    if impl.startswith("nsa"):
        return per_key * (n["cmp"] + n["slc"] + n["win"]) + scores * n["cmp"]
    if impl.endswith("cmp+slc"):
        return per_key * (n["cmp"] + n["slc"]) + scores * n["cmp"]
    if impl.endswith("slc"):
        return per_key * n["slc"]
    return None


# ----------------------------------------------------------------------------------------------
# Inputs and checks


def train_inputs(setup: Setup, t: int, seed: int = 0, b: int = 1, queries: int | None = None):
    """q [B, T, HQ, Dk] (``queries`` rows instead of T where given: the decode step's one), the six raw
    key / value tensors (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win: keys [B, T, H, Dk], values
    [B, T, H, Dv]) and gates [B, T, HQ, 3] (or ``queries`` rows)."""
    g = torch.Generator(device=setup.device).manual_seed(seed)
    tq = t if queries is None else queries

    def rn(*s):
        return torch.randn(*s, device=setup.device, dtype=setup.dtype, generator=g)

    q = rn(b, tq, setup.hq, setup.d)
    kv = [rn(b, t, setup.h, setup.d if i % 2 == 0 else setup.d_v) for i in range(6)]
    gates = torch.rand(b, tq, setup.hq, 3, device=setup.device, generator=g).to(setup.dtype)
    return q, kv, gates


def failed(why: str) -> Candidate:
    """A row that cannot run here (a peer or kernel missing): its check raises ``why`` as a RuntimeError
    (the row's check says so), it is not timed."""
    return failed_candidate(RuntimeError(why))


# ----------------------------------------------------------------------------------------------
# Candidates


def train_candidates(setup: Setup, t: int, fla, gen, pass_: str, group: str, sdpa=None, notes=None):
    """{impl: Candidate} of pass ``pass_`` (``PASSES``) at one length: ``group`` "core" (SDPA's
    backends ``sdpa`` {name: SDPBackend}, and nsa), "peers" (fa4, cmp+slc, slc, fla) or "extra"
    (``setup.extra_nsa``: kernels not yet run on a GPU, in steps of their own after every other, so
    that a fault there cannot end the run's other rows). ``notes`` gets a line for each SDPA backend
    that ran with v zero-padded."""
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(setup, t)
    pos = sample_rows(t, gen, setup.device)
    notes = [] if notes is None else notes
    # the reference rows of full attention, computed once, when a check needs them
    ref_full = functools.cache(lambda: ref.full_causal_attention(q[:, pos], ks, vs, q_pos=pos))
    cands = {}
    if group == "core":
        cands |= _sdpa_candidates(setup, pass_, q, ks, vs, sdpa or {}, ref_full, pos, notes)
    fa4_heads = setup.d == setup.d_v and setup.d in (64, 128)
    if group == "peers" and t <= setup.fa4_max_t and fa4_heads:
        cands |= _fa4_candidate(pass_, q, ks, vs, ref_full, pos)
    cfg = setup.paper
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)]
    cands |= _nsa_candidates(setup, t, pass_, group, leaves, pos)
    if group == "peers":
        cands |= _peer_candidates(setup, t, fla, q, ks, vs, gates, leaves, pos, pass_)
    return cands


def _sdpa_candidates(setup: Setup, pass_: str, q, ks, vs, sdpa: dict, ref_full, pos, notes: list):
    """Full causal attention through each SDPA backend: [B, HQ, T, D] with the KV heads repeated."""
    g = setup.hq // setup.h
    qt = q.transpose(1, 2).contiguous().requires_grad_()
    kt = ks.repeat_interleave(g, 2).transpose(1, 2).contiguous().requires_grad_()
    vt = vs.repeat_interleave(g, 2).transpose(1, 2).contiguous().requires_grad_()
    cands = {}
    for name, backend in sdpa.items():
        f, leaves = sdpa_causal(name, backend, qt, kt, vt, notes)

        def check(f=f):
            assert_rel_close(f().transpose(1, 2)[:, pos].float(), ref_full(), TOL, "sdpa rows")

        cands[name] = Candidate(fn=timed_pass(pass_, f, leaves), check=check)
    return cands


def _fa4_candidate(pass_: str, q, ks, vs, ref_full, pos) -> dict[str, Candidate]:
    """repro.fa4's causal attention (a failed check where it cannot be imported)."""
    try:
        from repro.fa4 import attention
    except Exception as exc:
        return {"fa4": failed(error_text(exc))}
    ql4, kl4, vl4 = (x.detach().clone().requires_grad_() for x in (q, ks, vs))

    def f4():
        return attention(ql4, kl4, vl4, causal=True)

    def check4():
        assert_rel_close(f4()[:, pos].float(), ref_full(), TOL, "fa4 rows")

    return {"fa4": Candidate(fn=timed_pass(pass_, f4, (ql4, kl4, vl4)), check=check4)}


def _nsa_candidates(setup: Setup, t: int, pass_: str, group: str, leaves, pos) -> dict[str, Candidate]:
    """NSA at the paper's configuration: ``nsa`` with the run's switches ("core"), or each extra row
    with its own ("extra"; a failed check where it cannot run here)."""
    cfg = setup.paper
    rows = [("nsa", setup.switches)] if group == "core" else []
    if group == "extra":
        rows += [(name, replace(setup.switches, **changes)) for name, changes in setup.extra_nsa]
    cands = {}
    for name, sw in rows:
        ok, why = extra_available(dict(setup.extra_nsa).get(name, {}))
        if not ok:
            cands[name] = failed(why)
            continue

        def nsa(sw=sw):
            return nsa_attention(*leaves, cfg, switches=sw)[0]

        def check_nsa(sw=sw, name=name):
            o, idx = nsa_attention(*leaves, cfg, switches=sw)
            ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = (x.detach() for x in leaves)
            _, lse_c = ref.compressed_attention(ql[:, pos], kcl, vcl, cfg.block_len, cfg.stride, q_pos=pos)
            check_selection(idx[:, pos], ql[:, pos], kcl, lse_c, cfg, t, pos, f"{name} selection")
            want = eq5_rows(ql, kcl, vcl, ksl, vsl, kwl, vwl, gl, idx, pos, cfg)
            assert_rel_close(o[:, pos].float(), want, TOL, f"{name} rows")

        cands[name] = Candidate(fn=timed_pass(pass_, nsa, leaves), check=check_nsa)
    return cands


def _peer_candidates(setup: Setup, t, fla, q, ks, vs, gates, leaves, pos, pass_) -> dict[str, Candidate]:
    """The cmp+slc rows (flash-linear-attention's setting: mean-pooled compression, l = d = l' = 64,
    no window) and the slc rows (the selected branch alone, on the indices the paper configuration
    selects for these inputs), ours and fla's."""
    cfg, sw = setup.paper, setup.switches
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, ks, vs))
    g_cmp = gates[..., 0].detach().clone().requires_grad_()
    g_slc = gates[..., 1].detach().clone().requires_grad_()
    cs = (ql, kl, vl, g_cmp, g_slc)
    cs_want = cmp_slc_reference(setup.fla_setting, t, pos, cs)
    ours_cs, check_ours_cs = _ours_cmp_slc(setup, cs, cs_want, pos)

    @functools.cache  # on first use, so that a failing kernel fails this row's check, not the run
    def indices():
        with torch.no_grad():
            return nsa_attention(*[x.detach() for x in leaves], cfg, switches=sw)[1]

    def ours_slc():
        return selected_attention(ql, kl, vl, indices(), cfg.select_len, check_indices=False, switches=sw)

    def check_ours_slc():
        qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
        want = ref.selected_attention(qd[:, pos], kd, vd, indices()[:, pos], cfg.select_len, q_pos=pos)
        assert_rel_close(ours_slc()[:, pos].detach().float(), want, TOL, "ours slc rows")

    cands = {
        "ours-cmp+slc": Candidate(fn=timed_pass(pass_, ours_cs, cs), check=check_ours_cs),
        "ours-slc": Candidate(fn=timed_pass(pass_, ours_slc, (ql, kl, vl)), check=check_ours_slc),
    }
    return cands | _fla_candidates(setup, t, fla, pass_, cs, cs_want, indices, ours_slc, pos)


def _ours_cmp_slc(setup: Setup, cs, cs_want, pos):
    """(f, check) of our compressed + selected branches with gates in fla's setting, computing their
    own top-n."""
    fs, sw = setup.fla_setting, setup.switches
    ql, kl, vl, g_cmp, g_slc = cs
    state = {}

    def f():
        kc = ref.compress(kl, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vl, ref.mean_pool, fs.block_len, fs.stride)
        o_c, lse = compressed_attention(ql, kc, vc, fs.block_len, fs.stride, switches=sw)
        with torch.no_grad():
            idx = topk_blocks(masked_selection_scores(ql, kc, lse, fs, switches=sw), fs.n_select, sw)
        state["idx"] = idx
        o_s = selected_attention(ql, kl, vl, idx, fs.select_len, check_indices=False, switches=sw)
        return g_cmp[..., None] * o_c + g_slc[..., None] * o_s

    def check():
        o = f()
        assert_rel_close(o[:, pos].detach().float(), cs_want(state["idx"], "ours"), TOL, "ours cmp+slc rows")

    return f, check


def _fla_candidates(setup: Setup, t, fla, pass_, cs, cs_want, indices, ours_slc, pos):
    """fla's parallel_nsa in the cmp+slc setting (its own top-n) and on our slc indices (failed
    checks where fla cannot be imported)."""
    parallel_nsa, why = fla
    if parallel_nsa is None:
        return {"fla-cmp+slc": failed(why), "fla-slc": failed(why)}
    cfg, fs = setup.paper, setup.fla_setting
    ql, kl, vl, g_cmp, g_slc = cs
    # n blocks of l' keys, no window (fla's window calls flash-attn, absent here)
    cs_blocks = {"block_counts": fs.n_select, "block_size": fs.select_len, "window_size": 0}
    slc_blocks = {"block_counts": cfg.n_select, "block_size": cfg.select_len, "window_size": 0}

    def fla_cs():
        return parallel_nsa(ql, kl, vl, g_cmp=g_cmp, g_slc=g_slc, **cs_blocks)

    def check_fla_cs():
        # fla picks its own blocks from its own bf16 scores: its picks must be a top-n up to SEL_TOL
        # (as ours), and its output must equal the reference computed on its own picks
        a = fla_cs().float()
        assert torch.isfinite(a).all(), "fla cmp+slc: non-finite output"
        want = cs_want(fla_picks(fs, t, ql, kl, vl), "fla")
        assert_rel_close(a[:, pos], want, TOL, "fla cmp+slc rows (on fla's own picks)")

    def fla_slc():
        return parallel_nsa(ql, kl, vl, block_indices=indices(), **slc_blocks)

    def check_fla_slc():
        assert_rel_close(fla_slc().float(), ours_slc().float(), TOL, "fla slc vs ours")

    return {
        "fla-cmp+slc": Candidate(fn=timed_pass(pass_, fla_cs, cs), check=check_fla_cs),
        "fla-slc": Candidate(fn=timed_pass(pass_, fla_slc, (ql, kl, vl)), check=check_fla_slc),
    }


def decode_candidates(setup: Setup, t: int, b: int) -> tuple[dict[str, Candidate], dict]:
    """The decode step at a cache of ``t`` tokens and batch ``b``, ours and SDPA's; the dict gets the
    tokens our kernels counted once the check has run."""
    cfg, dev = setup.paper, setup.device
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(setup, t, seed=t, b=b, queries=1)
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    del kc_raw, vc_raw
    args = (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)
    counted = {}
    last = torch.tensor([t - 1], device=dev)

    def ours():
        return nsa_decode(*args, cfg)[0]

    def check_ours():
        o, idx, counts = nsa_decode(*args, cfg)
        counted["tokens"] = int(counts[0, 0].sum())
        q1, kc1, vc1, ks1, vs1, kw1, vw1, g1 = (x[:1] for x in args)
        want = eq5_at(q1, kc1, vc1, ks1, vs1, kw1, vw1, g1, idx[:1], last, cfg)
        assert_rel_close(o[:1].float(), want, TOL, "decode row")

    qt, kt, vt = q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    dv = vt.shape[-1]
    if dv != qt.shape[-1]:  # one head size for SDPA's fused GQA kernels: v zero-padded, output sliced
        vt = torch.nn.functional.pad(vt, (0, qt.shape[-1] - dv))

    def full():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)[..., :dv]

    def check_full():
        want = ref.full_causal_attention(q[:1], ks[:1], vs[:1], q_pos=last)
        assert_rel_close(full()[:1].transpose(1, 2).float(), want, TOL, "sdpa decode row")

    return {
        "nsa-decode": Candidate(fn=ours, check=check_ours),
        "sdpa-decode": Candidate(fn=full, check=check_full),
    }, counted


# ----------------------------------------------------------------------------------------------
# The plan and the run


def plan_steps(lengths: list[int], decode_batch: int, extra: bool = False) -> list[Step]:
    """The steps, most important first: each length's forward, backward alone, then forward +
    backward (ours against SDPA, then the peers), shortest length first, then decode at every length,
    then (``extra``) the extra nsa rows at every length and pass. A step's cost scales
    from the last of its kind as T^2 (train; pessimistic where launch overheads dominate) or T
    (decode); the first of a kind costs ``FIRST_COST`` times the first step."""

    # Step(name, kind, size, exponent, first_cost, data)
    def train(p: str, g: str, t: int) -> Step:
        data = ("train", p, g, t, 1)
        return Step(f"train {p} T={t} {g}", f"train {p} {g}", t, 2, FIRST_COST.get((p, g)), data)

    def decode(t: int) -> Step:
        data = ("decode", "decode", "core", t, decode_batch)
        return Step(f"decode T={t} B={decode_batch}", "decode", t, 1, FIRST_COST[("decode", "core")], data)

    steps = [train(p, g, t) for t in lengths for p in PASSES for g in ("core", "peers")]
    steps += [decode(t) for t in lengths]
    return steps + [train(p, "extra", t) for t in (lengths if extra else []) for p in PASSES]


def new_report(setup: Setup) -> Report:
    """The run's report: its title (the shape), columns, peer and plots."""
    heads = f"D = {setup.d}" if setup.d == setup.d_v else f"Dk = {setup.d}, Dv = {setup.d_v}"
    dtype = str(setup.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    title = f"NSA forward, backward and decode ({setup.hq} query heads, {setup.h} KV heads, {heads}, {dtype})"
    report = Report(package="nsa", title=title, columns=COLUMNS, measure_ceilings=False, **PEER)
    for p in PASSES:
        where = {"section": "train", "pass": p}
        report.plot(title=f"{p} time", x="T", y="ms", series="impl", where=where, logx=True, logy=True)
    where = {"section": "decode"}
    report.plot(title="decode step time", x="T", y="ms", series="impl", where=where, logx=True)
    return report


def measure_step(setup: Setup, step: Step, fla, gen: torch.Generator, sdpa: dict, sdpa_notes: list):
    """Build one step's candidates, check them and time them in interleaved rounds: (results, what the
    decode kernels counted, seconds of building and checking)."""
    section, pass_, group, t, b = step.data
    t_start = time.perf_counter()
    if section == "train":
        sdpa = sdpa if group == "core" else {}
        cands, counted = train_candidates(setup, t, fla, gen, pass_, group, sdpa, sdpa_notes), {}
    else:
        cands, counted = decode_candidates(setup, t, b)
    build_s = time.perf_counter() - t_start
    log(f"{step.name}: {len(cands)} candidates ({', '.join(cands)}) built in {build_s:.1f} s")
    kw = {"rounds": setup.rounds(t), "warmup": WARMUP, "rep": REP, "timer": setup.timer}
    res, check_s = measure_logged(cands, step.name, log, **kw)
    return res, counted, build_s + check_s


def add_train_rows(report: Report, setup: Setup, step: Step, res: dict, full_ms: dict) -> None:
    """A row per candidate of a train step, with its ratios to full attention's times (this step's or
    the core step's before it, kept in ``full_ms``) and its TFLOP/s."""
    _, pass_, _, t, _ = step.data
    for impl, m in res.items():
        if impl.startswith("sdpa") and m.median_ms is not None:
            full_ms[(t, pass_)] = min(full_ms.get((t, pass_), math.inf), m.median_ms)
            full_ms[(t, pass_, impl)] = m.median_ms
    bases = {"speedup_vs_full": (t, pass_), "vs_cudnn": (t, pass_, "sdpa-cudnn")}
    bases["vs_fa2"] = (t, pass_, "sdpa-flash")
    for impl, m in res.items():
        ratios = {col: ratio(full_ms.get(base), m.median_ms) for col, base in bases.items()}
        fl = train_flops(impl, pass_, t, setup)
        tf = fl / (m.median_ms * 1e9) if fl and m.median_ms else None
        report.add(section="train", impl=impl, B=1, T=t, tflops=tf, **ratios, **{"pass": pass_}, **m.row())


def add_decode_rows(report: Report, step: Step, res: dict, counted: dict) -> None:
    """A row per candidate of a decode step: its speedup over SDPA's and the tokens it read."""
    _, _, _, t, b = step.data
    full = res["sdpa-decode"].median_ms
    for impl, m in res.items():
        ours = impl == "nsa-decode"
        tokens, paper = (counted.get("tokens"), TABLE4.get(t)) if ours else (t, t)
        row = {"section": "decode", "impl": impl, "pass": "decode", "B": b, "T": t, "tokens": tokens}
        report.add(**row, paper_tokens=paper, speedup_vs_full=ratio(full, m.median_ms), **m.row())


def run(
    setup: Setup, out, budget: Budget, lengths, decode_batch: int, *, quick=False, only=(), tag=""
) -> Path:
    """Run the plan (:func:`plan_steps`) within ``budget``, writing the report after every step."""
    from torch.nn.attention import SDPBackend

    steps = only_steps(plan_steps(lengths, decode_batch, extra=bool(setup.extra_nsa)), only)
    plan = Plan(steps, budget, log=log)
    names = ", ".join(s.name for s in steps)
    log(f"device {setup.device}; budget {budget.describe()}; {len(steps)} steps: {names}")
    gen = torch.Generator().manual_seed(0)
    fla = setup.fla()
    log("fla: " + ("imported" if fla[0] is not None else fla[1]))
    report = new_report(setup)
    notes = [] if fla[0] is not None else [fla[1]]
    if setup.switches != Switches():
        notes.append(f"Switches changed from the defaults: {setup.switches}.")
    sdpa = {n: getattr(SDPBackend, b) for n, b in setup.sdpa_backends}
    full_ms, sdpa_notes = {}, []

    def run_step(step: Step) -> float:
        res, counted, check_s = measure_step(setup, step, fla, gen, sdpa, sdpa_notes)
        if step.data[0] == "decode":
            add_decode_rows(report, step, res, counted)
        else:
            add_train_rows(report, setup, step, res, full_ms)
            notes.extend([line for line in dict.fromkeys(sdpa_notes) if line not in notes])
        return check_s

    def failed_row(step: Step, check: str) -> dict:
        section, pass_, _, t, b = step.data
        return {"section": section, "impl": "all", "B": b, "T": t, "check": check, "pass": pass_}

    free = torch.cuda.empty_cache if setup.device == "cuda" else lambda: None
    return run_plan(
        plan, run_step, report, failed_row=failed_row, notes=notes, trailer=NOTES, out_dir=out, tag=tag,
        ceilings=lambda: not quick and budget.left() > 0, after_step=free, log=log,
    )  # fmt: skip


def add_heads_arg(ap) -> None:
    """``--heads Dk,Dv`` (the paper's 192,128, the default) or ``--heads D``: the head sizes a GPU run
    of the bench or the lab takes."""
    ap.add_argument("--heads", default="192,128", help="query/key and value head sizes: Dk,Dv or one D")


def parse_heads(ap, text: str) -> tuple[int, int | None]:
    """(d, dv) for :class:`Setup` from ``--heads``: (192, 128), or (128, None) for one size."""
    try:
        heads = [int(x) for x in text.split(",")]
    except ValueError:
        heads = []
    if len(heads) not in (1, 2) or min(heads) < 1:
        ap.error(f"--heads takes Dk,Dv or one D (positive ints), got {text!r}")
    return heads[0], (heads[1] if len(heads) == 2 and heads[1] != heads[0] else None)


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], rounds=None, quick_help="T = 8k only")
    ap.add_argument("--lengths", default="", help="comma-separated T values (default 8k,16k,32k,64k)")
    ap.add_argument("--decode-batch", type=int, default=16)
    add_heads_arg(ap)
    args = parse_bench_args(ap, argv)
    log(f"starting (torch {torch.__version__} imported)")
    try:
        switches = apply_settings(Switches(), args.settings)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    d, dv = parse_heads(ap, args.heads)
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.bench needs a CUDA GPU")
    lengths = [int(x) for x in args.lengths.split(",") if x] or ([8192] if args.quick else sorted(TABLE4))
    setup = Setup(switches=switches, d=d, dv=dv)
    kw = {"quick": args.quick, "only": args.only, "tag": args.tag or setup.heads()}
    run(setup, args.out, args.budget, sorted(lengths), args.decode_batch, **kw)


if __name__ == "__main__":
    main()
