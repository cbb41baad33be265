"""The NSA layer timed stage by stage at one length, on one GPU (the paper's attention shape, bf16):
the forward (``--pass fwd``, the default) or the backward (``--pass bwd``).

``python -m repro.nsa.lab.breakdown --out DIR [--t 65536] [--pass fwd|bwd] [--heads 192,128]
[--set SWITCH=VALUE]``.

Forward stages (``STAGES``): ``cmp`` (compressed attention and its lse), ``scores`` (Eqs. 8-10 with
Eq. 11's masks), ``select`` (top-n, as the switches choose), ``slc``, ``win``, ``gate`` (Eq. 5's sum
as the switches choose); beside them, not in the sum, the ``ALTERNATIVES`` (the one-pass top-n, the
fused gate and the five PyTorch ops).

Backward stages (``BWD_STAGES``), each the backward of its autograd Function on the tensors one
forward saved, with the cotangent the layer's backward hands it: ``gate`` (Eq. 5's backward:
dO to the three branch outputs and the gates), ``win`` and ``cmp`` (``compression.strided_backward``:
delta, dQ, dK/dV with fp32 atomics, casts), ``slc`` (``selected.backward_block_major`` or the
query-major one as the switches choose: dQ with delta fused, the selection inverted by a sort, dK/dV
per block, casts), ``dq-sum`` (q's three gradients added, as the autograd engine accumulates them).
The scores and top-n have no backward (§3.3.2: top-n is not differentiated; the compressed lse is
marked non-differentiable), and the compression MLP is outside the layer (compressed keys given, as
in the bench).

Every stage is checked at the shape first (forward: sampled rows against the reference; backward:
dQ, dK, dV of the stage's kernels under a cotangent that is zero but on sampled rows, against the
reference's autograd on those rows, which then gives dK, dV exactly), then all are timed interleaved
with the ``whole`` (``layer.nsa_attention``; its backward from one kept forward, as the bench's
``bwd`` row) and full causal attention through SDPA's backends (``sdpa-cudnn``, ``sdpa-flash``, the
same pass, beside the stages). Rows: each stage's share of the whole, its matmul GFLOP
(:func:`stage_flops`) and rate per FLOP against cuDNN's in the same run; ``sum-of-stages`` (the
medians added) and ``glue`` (the whole minus that sum); on a GPU the whole pass's kernels by
torch.profiler (``kernel: ...``, for reading, not in the sum). Writes
``results/<device>-breakdown[-bwd]-<heads>-T<t>.json`` (the 64k forward file of 2026-11-27, D = 128,
is ``<device>-breakdown.json``). Diagnosis, not the benchmark: nothing in the fast path imports it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from paperclub.bench import (
    Candidate,
    Report,
    apply_settings,
    bench_parser,
    bwd_only,
    error_text,
    kernel_times,
    measure_logged,
    parse_bench_args,
)
from paperclub.testing import assert_rel_close
from repro.nsa import reference as ref
from repro.nsa.bench import (
    REP,
    WARMUP,
    Setup,
    _sdpa_candidates,
    add_heads_arg,
    keys_per_query,
    log,
    parse_heads,
    train_flops,
    train_inputs,
)
from repro.nsa.checks import GRAD_TOL, TOL, sample_rows
from repro.nsa.compression import compressed_attention
from repro.nsa.config import Switches
from repro.nsa.gate import gated_sum, gated_sum_fused
from repro.nsa.layer import nsa_attention
from repro.nsa.selected import selected_attention
from repro.nsa.selection import masked_selection_scores, topk_blocks, topk_blocks_fused
from repro.nsa.window import sliding_window_attention

PASSES = ("fwd", "bwd")
STAGES = ("cmp", "scores", "select", "slc", "win", "gate")
#: timed beside the stages, not added into their sum: Eq. 11's top-n and sort as one Triton kernel
#: (selection.topk_blocks_fused; the ``select`` stage is whichever Switches.fused_topk makes topk_blocks
#: run), and Eq. 5 as one Triton kernel (gate.gated_sum_fused) and as the five PyTorch ops; the ``gate``
#: stage is whichever Switches.fused_gate makes nsa_attention run
ALTERNATIVES = ("select-fused", "gate-fused", "gate-torch")
#: the backward's stages, in the order the layer's backward runs them
BWD_STAGES = ("gate", "win", "slc", "cmp", "dq-sum")
STAGES_OF = {"fwd": STAGES, "bwd": BWD_STAGES}
COLUMNS = ["stage", "pass", "T", "ms", "ms_min", "ms_max", "check", "share_of_whole"]
COLUMNS += ["gflop", "tflops", "rate_vs_cudnn"]


@dataclass
class Staged:
    """The layer's forward at one length, stage by stage, computed once: the leaves (q, k_cmp, v_cmp,
    k_slc, v_slc, k_win, v_win, gates; requiring grad, as in the bench's ``nsa`` rows, so that each
    stage saves what its backward needs), the sampled query rows ``pos`` the checks compare, and each
    stage's output (the branch outputs with their autograd graphs)."""

    cfg: ref.NSAConfig
    sw: Switches
    leaves: list
    pos: torch.Tensor
    o_cmp: torch.Tensor
    lse: torch.Tensor
    scores: torch.Tensor
    bi: torch.Tensor
    o_slc: torch.Tensor
    o_win: torch.Tensor

    @property
    def detached(self) -> list:
        return [x.detach() for x in self.leaves]


def staged_forward(setup: Setup, t: int, gen: torch.Generator) -> Staged:
    """The bench's inputs at length ``t`` (compressed keys mean-pooled, outside the layer) and the
    forward's stages run once on them, each on the previous stages' outputs."""
    cfg, sw = setup.paper, setup.switches
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(setup, t)
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    del kc_raw, vc_raw
    leaves = [x.detach().clone().requires_grad_() for x in (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)]
    ql, kcl, vcl, ksl, vsl, kwl, vwl, _ = leaves
    o_cmp, lse = compressed_attention(ql, kcl, vcl, cfg.block_len, cfg.stride, switches=sw)
    with torch.no_grad():
        scores = masked_selection_scores(ql, kcl, lse, cfg, switches=sw)
        bi = topk_blocks(scores, cfg.n_select, sw)
    o_slc = selected_attention(ql, ksl, vsl, bi, cfg.select_len, check_indices=False, switches=sw)
    o_win = sliding_window_attention(ql, kwl, vwl, cfg.window, switches=sw)
    pos = sample_rows(t, gen, setup.device)
    return Staged(cfg, sw, leaves, pos, o_cmp, lse, scores, bi, o_slc, o_win)


def candidates(setup: Setup, t: int, gen: torch.Generator, st: Staged | None = None) -> dict[str, Candidate]:
    """The stages of ``layer.nsa_attention``'s forward at the paper's configuration, each alone on the
    inputs the stage before it produced (:func:`staged_forward`): ``cmp`` (compressed attention and
    its lse), ``scores`` (Eqs. 8-10 with Eq. 11's masks, one kernel), ``select``
    (``selection.topk_blocks`` as ``setup.switches`` has it), ``slc`` (selected branch), ``win``
    (sliding window), ``gate`` (Eq. 5's gated sum as the switches have it), ``whole``, and beside them
    the ALTERNATIVES."""
    st = st or staged_forward(setup, t, gen)
    cfg, sw, pos, scores, bi = st.cfg, st.sw, st.pos, st.scores, st.bi
    ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = st.leaves
    qd, kcd, vcd, ksd, vsd, kwd, vwd, _ = st.detached
    o_cmp, lse, o_slc, o_win = st.o_cmp, st.lse, st.o_slc, st.o_win

    def cmp():
        return compressed_attention(ql, kcl, vcl, cfg.block_len, cfg.stride, switches=sw)

    def check_cmp():
        o_c, _ = ref.compressed_attention(qd[:, pos], kcd, vcd, cfg.block_len, cfg.stride, q_pos=pos)
        assert_rel_close(cmp()[0][:, pos].float(), o_c, TOL, "compressed rows")

    def sc():
        with torch.no_grad():
            return masked_selection_scores(ql, kcl, lse, cfg, switches=sw)

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
        return topk_blocks(scores, cfg.n_select, sw)

    def check_select():  # the reference's Eq. 11 on the same scores, masks undone (they are its own)
        sub = scores[:, pos].clone()
        want = ref.select_blocks(sub.nan_to_num(posinf=0.0, neginf=0.0), cfg.n_select, cfg.select_len,
                                 cfg.n_initial, cfg.n_local, q_pos=pos)  # fmt: skip
        if not torch.equal(select()[:, pos], want):
            raise AssertionError("topk_blocks differs from reference.select_blocks on the sampled rows")

    def select_fused():
        return topk_blocks_fused(scores, cfg.n_select)

    def check_select_fused():  # a top-n of the same scores, masks undone (ties may pick other blocks)
        sub = scores[:, pos].nan_to_num(posinf=0.0, neginf=0.0)
        short = ref.selection_shortfall(select_fused()[:, pos], sub, cfg.n_select, cfg.select_len,
                                        cfg.n_initial, cfg.n_local, q_pos=pos)  # fmt: skip
        if not (short == 0).all():
            raise AssertionError("topk_blocks_fused is not a top-n on the sampled rows")

    def slc():
        return selected_attention(ql, ksl, vsl, bi, cfg.select_len, check_indices=False, switches=sw)

    def check_slc():
        want = ref.selected_attention(qd[:, pos], ksd, vsd, bi[:, pos], cfg.select_len, q_pos=pos)
        assert_rel_close(slc()[:, pos].float(), want, TOL, "selected rows")

    def win():
        return sliding_window_attention(ql, kwl, vwl, cfg.window, switches=sw)

    def check_win():
        want = ref.sliding_window_attention(qd[:, pos], kwd, vwd, cfg.window, q_pos=pos)
        assert_rel_close(win()[:, pos].float(), want, TOL, "window rows")

    def gate():  # as nsa_attention does it
        return gated_sum(gl, o_cmp, o_slc, o_win, sw)

    def gate_fused():
        return gated_sum_fused(gl, o_cmp, o_slc, o_win)

    def gate_torch():
        g = gl.to(o_cmp.dtype)
        return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win

    def eq5_fp32():  # the check of both gated sums: Eq. 5 in fp32 on the same branch outputs
        return eq5(gl.detach().float(), o_cmp.float(), o_slc.float(), o_win.float()).detach()

    def check_gate_fused():
        assert_rel_close(gate_fused().float(), eq5_fp32(), TOL, "fused gated sum")

    def check_gate_torch():
        assert_rel_close(gate_torch().float(), eq5_fp32(), TOL, "PyTorch gated sum")

    def check_gate():
        assert_rel_close(gate().float(), eq5_fp32(), TOL, "gated sum")

    def whole():
        return nsa_attention(*st.leaves, cfg, switches=sw)[0]

    def check_whole():
        o, idx = nsa_attention(*st.leaves, cfg, switches=sw)
        if not torch.equal(idx, bi):
            raise AssertionError("nsa_attention's block indices differ from the staged selection")
        assert_rel_close(o.float(), gate().float(), TOL, "whole vs staged")

    fns = dict(cmp=(cmp, check_cmp), scores=(sc, check_sc), select=(select, check_select),
               slc=(slc, check_slc), win=(win, check_win), gate=(gate, check_gate),
               **{"select-fused": (select_fused, check_select_fused), "gate-fused": (gate_fused, check_gate_fused), "gate-torch": (gate_torch, check_gate_torch)}, whole=(whole, check_whole))  # fmt: skip
    return {name: Candidate(fn=f, check=c) for name, (f, c) in fns.items()}


def eq5(g, o_cmp, o_slc, o_win):
    """Eq. 5 in the inputs' dtype: the gated sum of the three branch outputs (gates [..., 3])."""
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


def bwd_candidates(
    setup: Setup, t: int, gen: torch.Generator, st: Staged | None = None
) -> dict[str, Candidate]:
    """The stages of ``layer.nsa_attention``'s backward (``BWD_STAGES``), each the backward of its
    autograd Function alone on what one forward (:func:`staged_forward`) saved, with the cotangent
    the layer's backward hands it (the gate's backward of one fixed dO, computed once), and the
    ``whole`` backward of one kept forward. Each stage's check: its gradients under dO zeroed but on
    the sampled rows against the reference's autograd on those rows (:func:`grad_check`); the whole's:
    its gradients against the stages' (q's summed)."""
    st = st or staged_forward(setup, t, gen)
    cfg, sw, pos, bi = st.cfg, st.sw, st.pos, st.bi
    ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = st.leaves
    do_gen = torch.Generator(device=setup.device).manual_seed(t)
    do = torch.randn(st.o_cmp.shape, device=setup.device, generator=do_gen).to(setup.dtype)
    # the gate's backward on its own leaves: the branch outputs as the layer's backward sees them
    outs = [x.detach().requires_grad_() for x in (st.o_cmp, st.o_slc, st.o_win)]
    o_gate = gated_sum(gl, *outs, sw)
    _, do_cmp, do_slc, do_win = torch.autograd.grad(o_gate, (gl, *outs), do, retain_graph=True)
    stages = {  # name: (output with its graph, leaves, cotangent, reference of the sampled rows)
        "gate": (o_gate, (gl, *outs), do, eq5),
        "win": (st.o_win, (ql, kwl, vwl), do_win,
                lambda q, k, v: ref.sliding_window_attention(q, k, v, cfg.window, q_pos=pos)),
        "slc": (st.o_slc, (ql, ksl, vsl), do_slc,
                lambda q, k, v: ref.selected_attention(q, k, v, bi[:, pos], cfg.select_len, q_pos=pos)),
        "cmp": (st.o_cmp, (ql, kcl, vcl), do_cmp,
                lambda q, k, v: ref.compressed_attention(q, k, v, cfg.block_len, cfg.stride, q_pos=pos)[0]),
    }  # fmt: skip
    # the gradients' names: the gate's leaves are all query rows, a branch's q (rows), k and v (whole)
    grads = {"gate": ("dgates", "dO_cmp", "dO_slc", "dO_win")} | dict.fromkeys(
        ("win", "slc", "cmp"), ("dq", "dk", "dv")
    )
    cands = {}
    for name, (out, leaves, cot, want) in stages.items():
        n_rows = 1 if name != "gate" else 4
        check = functools.partial(grad_check, name, out, leaves, cot, want, n_rows, pos, grads[name])
        cands[name] = Candidate(fn=bwd_only(lambda out=out: out, leaves, cot), check=check)

    @functools.cache
    def staged_grads():  # each stage's gradients once, with the layer's cotangents
        return {name: cands[name].fn() for name in stages}

    def dq_sum():
        g = staged_grads()
        return g["cmp"][0] + g["slc"][0] + g["win"][0]

    def check_dq_sum():
        g = staged_grads()
        want = g["cmp"][0].float() + g["slc"][0].float() + g["win"][0].float()
        assert_rel_close(dq_sum().float(), want, TOL, "q's gradients added")

    whole = bwd_only(lambda: nsa_attention(*st.leaves, cfg, switches=sw)[0], st.leaves, do)

    def check_whole():  # the layer's gradients are the stages': q's added, the others as they are
        g = staged_grads()
        got = whole()
        want = [dq_sum(), *g["cmp"][1:], *g["slc"][1:], *g["win"][1:], g["gate"][0]]
        for name, a, b in zip(("dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates"),
                              got, want, strict=True):  # fmt: skip
            assert_rel_close(a.float(), b.float(), GRAD_TOL, f"whole backward's {name} vs the stages'")

    cands["dq-sum"] = Candidate(fn=dq_sum, check=check_dq_sum)
    cands["whole"] = Candidate(fn=whole, check=check_whole)
    return cands


def grad_check(name: str, out, leaves, do, reference, n_rows: int, pos, names=None) -> None:
    """One backward stage's gradients at the full shape against the reference's autograd on the
    sampled query rows ``pos``: the stage's backward runs with ``do`` zeroed but on those rows, so its
    dQ rows and its whole dK, dV are what the reference gives from those rows alone. ``leaves``: the
    first ``n_rows`` are per query row [B, T, ...] (compared on ``pos``), the rest whole (keys,
    values); ``reference(*leaves)`` gives the stage's output on the rows, in fp32; ``names``: the
    gradients' names for the messages."""
    keep = torch.zeros(do.shape[1], device=do.device, dtype=do.dtype)
    keep[pos] = 1
    got = torch.autograd.grad(out, leaves, do * keep[None, :, None, None], retain_graph=True)
    ref_leaves = [(x.detach()[:, pos] if i < n_rows else x.detach()).float().requires_grad_()
                  for i, x in enumerate(leaves)]  # fmt: skip
    want = torch.autograd.grad(reference(*ref_leaves), ref_leaves, do[:, pos].float())
    names = names or [f"gradient {i}" for i in range(len(leaves))]
    for i, (a, b, what) in enumerate(zip(got, want, names, strict=True)):
        a = a[:, pos] if i < n_rows else a
        assert_rel_close(a.float(), b, GRAD_TOL, f"{name} backward: {what} against the reference's")


def reference_candidates(setup: Setup, pass_: str, st: Staged, notes: list) -> dict[str, Candidate]:
    """Full causal attention through each of ``setup.sdpa_backends`` at the same shape and pass (the
    bench's rows: cuDNN's is the rate per FLOP the stages are set against), checked on the forward."""
    from torch.nn.attention import SDPBackend

    qd, _, _, ksd, vsd, *_ = st.detached
    pos = st.pos
    ref_full = functools.cache(lambda: ref.full_causal_attention(qd[:, pos], ksd, vsd, q_pos=pos))
    sdpa = {name: getattr(SDPBackend, backend) for name, backend in setup.sdpa_backends}
    return _sdpa_candidates(setup, pass_, qd, ksd, vsd, sdpa, ref_full, pos, notes)


def stage_flops(stage: str, pass_: str, t: int, setup: Setup) -> float | None:
    """Matmul FLOPs of one stage at length t as ``bench.train_flops`` counts them: per query head and
    (query, key) pair the pass's unit (forward QK^T and PV; backward QK^T again, dP, dV, dQ, dK) over
    the branch's keys (``bench.keys_per_query``), the scores QK^T alone over the compressed keys
    (forward only); the whole layer and full attention as the bench's rows. None for the stages
    with no matmul (select, gate, dq-sum)."""
    if stage == "whole":
        return train_flops("nsa", pass_, t, setup)
    if stage.startswith("sdpa"):
        return train_flops(stage, pass_, t, setup)
    per_key = train_flops("sdpa", pass_, 1, setup)  # full attention at t = 1: one (query, key) pair
    n = keys_per_query(t, setup.paper)
    if stage in ("cmp", "slc", "win"):
        return per_key * n[stage]
    if stage == "scores":
        return setup.hq * 2 * setup.d * n["cmp"]
    return None


def kernel_rows(fn, t: int, pass_: str) -> list[dict]:
    """The kernels of ``fn()`` (the whole pass) with their device time per call (torch.profiler,
    ``paperclub.bench.kernel_times``): rows for reading, not timed interleaved, not in the sum."""
    try:
        kernels = kernel_times(fn, reps=3)
    except Exception as exc:  # reading matter: a profiler that fails costs these rows only
        return [{"stage": "kernel: (profiler failed)", "pass": pass_, "T": t, "check": error_text(exc, 200)}]
    return [
        {"stage": f"kernel: {name[:100]}", "pass": pass_, "T": t, "ms": ms,
         "check": f"torch.profiler, {launches} launch(es) a call; not interleaved, not in the sum"}
        for name, ms, launches in kernels
    ]  # fmt: skip


def run(setup: Setup, out: Path | None, t: int, gen: torch.Generator, pass_: str = "fwd") -> Path:
    """Time each stage of pass ``pass_`` (:func:`candidates`, :func:`bwd_candidates`) interleaved at
    one length with the whole and SDPA's backends, and write the breakdown file: a row per candidate
    with its share of ``whole``'s time, GFLOP, TFLOP/s and rate against ``sdpa-cudnn``'s, a
    ``sum-of-stages`` row (the stages' medians added, not timed), a ``glue`` row (the whole minus
    that sum) and, on a GPU, the whole pass's kernels (:func:`kernel_rows`)."""
    if pass_ not in PASSES:
        raise ValueError(f"breakdown: pass {pass_!r} is none of {PASSES}")
    log(f"breakdown {pass_} T={t}: building inputs and the stages")
    st = staged_forward(setup, t, gen)
    notes: list[str] = []
    cands = (candidates if pass_ == "fwd" else bwd_candidates)(setup, t, gen, st)
    whole = cands.pop("whole")
    cands |= reference_candidates(setup, pass_, st, notes) | {"whole": whole}
    kw = {"rounds": setup.rounds(t), "warmup": WARMUP, "rep": REP, "timer": setup.timer}
    res, _ = measure_logged(cands, f"breakdown {pass_} T={t}", log, **kw)
    what = "forward" if pass_ == "fwd" else "backward"
    report = Report(
        package="nsa",
        title=f"NSA {what} by stage at T = {t} ({setup.hq} query heads, {setup.h} KV heads, {setup.heads()}, bf16)",
        columns=COLUMNS,
        measure_ceilings=False,
    )
    whole_ms = res["whole"].median_ms
    cudnn = res.get("sdpa-cudnn")
    cudnn_rate = rate(stage_flops("sdpa-cudnn", pass_, t, setup), cudnn.median_ms) if cudnn else None

    def add(stage: str, ms: float | None, **row) -> None:
        fl = stage_flops(stage, pass_, t, setup)
        tf = rate(fl, ms)
        report.add(stage=stage, T=t, ms=ms, share_of_whole=ms / whole_ms if whole_ms and ms is not None else None,
                   gflop=fl / 1e9 if fl else None, tflops=tf,
                   rate_vs_cudnn=tf / cudnn_rate if tf and cudnn_rate else None, **{"pass": pass_}, **row)  # fmt: skip

    for stage, m in res.items():
        add(stage, **m.row())
    parts = [res[s].median_ms for s in STAGES_OF[pass_]]
    total = sum(parts) if all(p is not None for p in parts) else None
    add("sum-of-stages", total, check="not timed: the stages' medians added")
    glue = whole_ms - total if whole_ms is not None and total is not None else None
    add("glue", glue, check="not timed: whole minus sum-of-stages")
    if setup.device == "cuda":
        for row in kernel_rows(whole.fn, t, pass_):
            report.add(**row)
    report.notes = " ".join([NOTES[pass_].format(sw=setup.switches), NOTES_COMMON, *dict.fromkeys(notes)])
    tag = f"breakdown-{setup.heads()}-T{t}" if pass_ == "fwd" else f"breakdown-bwd-{setup.heads()}-T{t}"
    return report.write(tag=tag, out_dir=out)


def rate(flops: float | None, ms: float | None) -> float | None:
    """TFLOP/s of ``flops`` in ``ms``."""
    return flops / (ms * 1e9) if flops and ms else None


NOTES = {
    "fwd": (
        "Each stage of layer.nsa_attention's forward alone, on the previous stages' outputs computed once. "
        "cmp: compressed attention + lse; scores: Eqs. 8-10 with Eq. 11's masks in one kernel; "
        "select: topk_blocks (Switches.fused_topk = {sw.fused_topk}: torch.topk + the sort kernel when False); "
        "select-fused: selection.topk_blocks_fused, the top-n and sort in one kernel, beside the stages; "
        "slc: selected branch; win: sliding window; gate: Eq. 5's sum as nsa_attention runs it "
        "(Switches.fused_gate = {sw.fused_gate}); gate-fused / gate-torch: the one Triton kernel / the five "
        "PyTorch ops, beside the stages (not in their sum); whole: nsa_attention. Every stage is checked at "
        "this shape first (sampled rows against the reference; select exactly)."
    ),
    "bwd": (
        "Each stage of layer.nsa_attention's backward alone: its autograd Function's backward on what one "
        "forward saved (retain_graph), with the cotangent the layer's backward hands it (one fixed dO through "
        "the gate's backward). gate: Eq. 5's backward (Switches.fused_gate = {sw.fused_gate}); win, cmp: "
        "compression.strided_backward (delta, dQ, dK/dV with fp32 atomics, casts); slc: the selected "
        "branch's backward (Switches.slc_backward = {sw.slc_backward!r}: dQ with delta fused, the selection "
        "inverted, dK/dV per block, casts); dq-sum: q's three gradients added, as the autograd engine "
        "accumulates them; whole: the backward of one kept nsa_attention forward (the bench's bwd row). "
        "The scores and top-n have no backward; the compression MLP is outside the layer. Every stage is "
        "checked at this shape first: its dQ, dK, dV under dO zeroed but on 25 sampled rows against the "
        "reference's autograd on those rows (checks.GRAD_TOL); the whole's gradients against the stages'."
    ),
}
NOTES_COMMON = (
    "Paper configuration: l=32, d=16, l'=64, n=16 with 1 initial + 2 local blocks, w=512; compressed "
    "keys given (mean-pooled). sdpa-*: full causal attention through SDPA's backends, the same pass "
    "(the bench's rows), beside the stages. All are timed interleaved (paperclub.bench.measure). "
    "gflop: the row's matmul FLOPs as repro.nsa.bench.train_flops counts them (per query head and "
    "(query, key) pair: forward 2 (Dk + Dv), backward 2 (3 Dk + 2 Dv); scores 2 Dk, forward only); "
    "tflops: gflop over ms; rate_vs_cudnn: tflops over sdpa-cudnn's. sum-of-stages is the stages' "
    "medians added, glue the whole minus it (launch gaps, the autograd engine). kernel rows (GPU "
    "only): the whole pass's kernels by torch.profiler over 3 calls, for reading."
)


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], rounds=None, only=False, tag=False)
    ap.add_argument("--t", type=int, default=65536, help="the sequence length (default 65536)")
    ap.add_argument(
        "--pass", dest="pass_", choices=PASSES, default="fwd", help="forward (default) or backward"
    )
    add_heads_arg(ap)
    args = parse_bench_args(ap, argv)
    try:
        switches = apply_settings(Switches(), args.settings)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    d, dv = parse_heads(ap, args.heads)
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.lab.breakdown needs a CUDA GPU")
    log(f"breakdown {args.pass_} at T={args.t}, heads {args.heads}, switches {switches}")
    run(Setup(switches=switches, d=d, dv=dv), args.out, args.t, torch.Generator().manual_seed(1), args.pass_)


if __name__ == "__main__":
    main()
