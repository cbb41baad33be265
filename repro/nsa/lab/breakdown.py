"""The NSA forward timed stage by stage at one length, on one GPU (the paper's attention shape, bf16).

``python -m repro.nsa.lab.breakdown --out DIR [--t 65536] [--heads 192,128] [--set SWITCH=VALUE]``.

Stages (``STAGES``): ``cmp`` (compressed attention and its lse), ``scores`` (Eqs. 8-10 with Eq. 11's
masks), ``select`` (top-n, as the switches choose), ``slc``, ``win``, ``gate`` (Eq. 5's sum as the
switches choose) and ``whole`` (``layer.nsa_attention``), each checked at that shape first and then
all timed interleaved, with each stage's share of the whole and the stages' sum; beside them, not in
the sum, the ``ALTERNATIVES`` (the one-pass top-n, the fused gate and the five PyTorch ops). Writes
``results/<device>-breakdown-<heads>-T<t>.json`` (``--heads``: the paper's 192,128 by default, or 128;
the 64k file of 2026-11-27, D = 128, is ``<device>-breakdown.json``). Diagnosis, not the benchmark: nothing in the fast path imports it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paperclub.bench import Candidate, Report, apply_settings, bench_parser, measure_logged, parse_bench_args
from paperclub.testing import assert_rel_close
from repro.nsa import reference as ref
from repro.nsa.bench import REP, WARMUP, Setup, add_heads_arg, log, parse_heads, train_inputs
from repro.nsa.checks import TOL, sample_rows
from repro.nsa.compression import compressed_attention
from repro.nsa.config import Switches
from repro.nsa.gate import gated_sum, gated_sum_fused
from repro.nsa.layer import nsa_attention
from repro.nsa.selected import selected_attention
from repro.nsa.selection import masked_selection_scores, topk_blocks, topk_blocks_fused
from repro.nsa.window import sliding_window_attention

STAGES = ("cmp", "scores", "select", "slc", "win", "gate")
#: timed beside the stages, not added into their sum: Eq. 11's top-n and sort as one Triton kernel
#: (selection.topk_blocks_fused; the ``select`` stage is whichever Switches.fused_topk makes topk_blocks
#: run), and Eq. 5 as one Triton kernel (gate.gated_sum_fused) and as the five PyTorch ops; the ``gate``
#: stage is whichever Switches.fused_gate makes nsa_attention run
ALTERNATIVES = ("select-fused", "gate-fused", "gate-torch")
COLUMNS = ["stage", "T", "ms", "ms_min", "ms_max", "check", "share_of_whole"]


def candidates(setup: Setup, t: int, gen: torch.Generator) -> dict[str, Candidate]:
    """The stages of ``layer.nsa_attention``'s forward at the paper's configuration, each alone on the
    inputs the stage before it produced (computed once here), and the whole forward: ``cmp``
    (compressed attention and its lse), ``scores`` (Eqs. 8-10 with Eq. 11's masks, one kernel),
    ``select`` (``selection.topk_blocks`` as ``setup.switches`` has it), ``slc`` (selected branch),
    ``win`` (sliding window), ``gate`` (Eq. 5's gated sum as the switches have it), ``whole``, and
    beside them the ALTERNATIVES. Leaves require grad as in the bench's ``nsa`` rows, so each stage
    saves what its backward needs, as it does there."""
    cfg, sw = setup.paper, setup.switches
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(setup, t)
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    del kc_raw, vc_raw
    leaves = [x.detach().clone().requires_grad_() for x in (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)]
    ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = leaves
    qd, kcd, vcd, ksd, vsd, kwd, vwd = (x.detach() for x in leaves[:7])
    pos = sample_rows(t, gen, setup.device)
    o_cmp, lse = compressed_attention(ql, kcl, vcl, cfg.block_len, cfg.stride, switches=sw)
    with torch.no_grad():
        scores = masked_selection_scores(ql, kcl, lse, cfg, switches=sw)
        bi = topk_blocks(scores, cfg.n_select, sw)
    o_slc = selected_attention(ql, ksl, vsl, bi, cfg.select_len, check_indices=False, switches=sw)
    o_win = sliding_window_attention(ql, kwl, vwl, cfg.window, switches=sw)

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
        return nsa_attention(*leaves, cfg, switches=sw)[0]

    def check_whole():
        o, idx = nsa_attention(*leaves, cfg, switches=sw)
        if not torch.equal(idx, bi):
            raise AssertionError("nsa_attention's block indices differ from the staged selection")
        assert_rel_close(o.float(), gate().float(), TOL, "whole vs staged")

    fns = dict(cmp=(cmp, check_cmp), scores=(sc, check_sc), select=(select, check_select),
               slc=(slc, check_slc), win=(win, check_win), gate=(gate, check_gate),
               **{"select-fused": (select_fused, check_select_fused), "gate-fused": (gate_fused, check_gate_fused), "gate-torch": (gate_torch, check_gate_torch)}, whole=(whole, check_whole))  # fmt: skip
    return {name: Candidate(fn=f, check=c) for name, (f, c) in fns.items()}


def run(setup: Setup, out: Path | None, t: int, gen: torch.Generator) -> Path:
    """Time each stage of the forward (:func:`breakdown_candidates`) interleaved at one length and write
    ``<device>-breakdown.json``: a row per stage and ``whole``, with its share of ``whole``'s time, and
    a ``sum-of-stages`` row (the stages' medians added, not timed)."""
    log(f"breakdown T={t}: building inputs and the stages")
    kw = {"rounds": setup.rounds(t), "warmup": WARMUP, "rep": REP, "timer": setup.timer}
    res, _ = measure_logged(candidates(setup, t, gen), f"breakdown T={t}", log, **kw)
    report = Report(
        package="nsa",
        title=f"NSA forward by stage at T = {t} ({setup.hq} query heads, {setup.h} KV heads, {setup.heads()}, bf16)",
        columns=COLUMNS,
        measure_ceilings=False,
    )
    whole = res["whole"].median_ms
    for stage, m in res.items():
        share = m.median_ms / whole if whole and m.median_ms is not None else None
        report.add(stage=stage, T=t, share_of_whole=share, **m.row())
    parts = [res[s].median_ms for s in STAGES]
    total = sum(parts) if all(p is not None for p in parts) else None
    report.add(stage="sum-of-stages", T=t, ms=total, check="not timed: the stages' medians added",
               share_of_whole=total / whole if total is not None and whole else None)  # fmt: skip
    report.notes = (
        "Each stage of layer.nsa_attention's forward alone, on the previous stages' outputs computed once "
        "(paper configuration: l=32, d=16, l'=64, n=16 with 1 initial + 2 local blocks, w=512; compressed "
        "keys given). cmp: compressed attention + lse; scores: Eqs. 8-10 with Eq. 11's masks in one kernel; "
        f"select: topk_blocks (Switches.fused_topk = {setup.switches.fused_topk}: torch.topk + the sort kernel when False); "
        "select-fused: selection.topk_blocks_fused, the top-n and sort in one kernel, beside the stages; slc: selected branch; win: sliding window; gate: Eq. 5's "
        f"sum as nsa_attention runs it (Switches.fused_gate = {setup.switches.fused_gate}); gate-fused / gate-torch: the one "
        "Triton kernel / the five PyTorch ops, beside the stages (not in their sum); whole: nsa_attention. Every stage is checked at this shape first (sampled rows against "
        "the reference; select exactly), then all are timed interleaved (paperclub.bench.measure). "
        "sum-of-stages is the medians added (not timed); whole minus it is launch gaps and checks."
    )
    return report.write(tag=f"breakdown-{setup.heads()}-T{t}", out_dir=out)


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], rounds=None, only=False, tag=False)
    ap.add_argument("--t", type=int, default=65536, help="the sequence length (default 65536)")
    add_heads_arg(ap)
    args = parse_bench_args(ap, argv)
    try:
        switches = apply_settings(Switches(), args.settings)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    d, dv = parse_heads(ap, args.heads)
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.lab.breakdown needs a CUDA GPU")
    log(f"breakdown at T={args.t}, heads {args.heads}, switches {switches}")
    run(Setup(switches=switches, d=d, dv=dv), args.out, args.t, torch.Generator().manual_seed(1))


if __name__ == "__main__":
    main()
