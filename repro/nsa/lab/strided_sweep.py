"""The strided forward's loops and tiles, and the whole forward with its split off and on, on one GPU.

``python -m repro.nsa.lab.strided_sweep --out DIR [--t 65536]``: the strided forward (the compressed
branch and the sliding window) in one masked loop or split into edge / interior / diagonal loops, at
each of :data:`TILES`, and the whole NSA forward with the compressed branch's split off and on beside
SDPA's cuDNN backend (the paper's attention shape, bf16).

What ``Switches.strided_split``, ``compression.forward_tile`` and ``window.window_tile`` rest on
(``results/<device>-strided-sweep.json``; its first run, 2026-11-27, was a scratch script of the same
design). Each variant's output is checked against the one-loop kernel at the branch's own tile
(relative error below 4e-3: the same products summed in another order, rounded to bf16) and cuDNN
against SDPA's flash backend on the first 8192 rows; then each group (a branch, or the whole
forward) is timed in interleaved rounds (``paperclub.bench.measure``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from paperclub.bench import Candidate, Report, bench_parser, measure, parse_bench_args
from paperclub.testing import assert_rel_close
from repro.nsa import reference as ref
from repro.nsa.bench import Setup, add_heads_arg, log, parse_heads, train_inputs
from repro.nsa.checks import TOL, eq5_rows, sample_rows
from repro.nsa.compression import forward_tile, strided_forward
from repro.nsa.config import Switches
from repro.nsa.layer import nsa_attention
from repro.nsa.window import window_tile

#: (BM, BN, warps, stages) of the strided forward, the first the compressed branch's own
TILES = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)]
COLUMNS = ["stage", "split", "tile", "T", "ms", "ms_min", "ms_max", "check"]
CHECK_TOL = 4e-3


def branch_candidates(setup: Setup, t: int, stage: str) -> dict[tuple[bool, tuple], Candidate]:
    """{(split, tile): Candidate} of one branch ("cmp" or "win") at length ``t``."""
    cfg = setup.paper
    q, (kc_raw, vc_raw, _, _, kw, vw), _ = train_inputs(setup, t)
    if stage == "cmp":
        k = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
        v = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
        geometry, own = (cfg.stride, cfg.block_len - 1, 0), forward_tile(setup.d, q.element_size())
    else:
        k, v = kw.contiguous(), vw.contiguous()
        geometry, own = (1, 0, cfg.window), window_tile(setup.d, q.element_size())
    scale = setup.d**-0.5
    want = strided_forward(q, k, v, scale, *geometry, own, Switches(), split=False)[0]
    cands = {}
    for split in (False, True):
        for tile in TILES:
            sw = Switches(strided_fwd_tile=tile)

            def run(sw=sw, split=split):
                return strided_forward(q, k, v, scale, *geometry, own, sw, split=split)[0]

            def check(run=run):
                assert_rel_close(run().float(), want.float(), CHECK_TOL, "against the one-loop kernel")

            cands[(split, tile)] = Candidate(fn=run, check=check)
    return cands


def whole_candidates(setup: Setup, t: int) -> dict[str, Candidate]:
    """The whole forward with the compressed branch's split off and on, and SDPA's cuDNN backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = setup.paper
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(setup, t)
    kc = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    vc = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    args = (q, kc, vc, ks, vs, kw, vw, gates)
    pos = sample_rows(t, torch.Generator().manual_seed(t), setup.device)
    cands = {}
    for split in (False, True):
        sw = Switches(strided_split=split)

        def run(sw=sw):
            with torch.no_grad():
                return nsa_attention(*args, cfg, switches=sw)[0]

        def check(sw=sw):  # sampled rows against the reference on the kernels' own selection
            with torch.no_grad():
                o, idx = nsa_attention(*args, cfg, switches=sw)
            want = eq5_rows(q, kc, vc, ks, vs, kw, vw, gates, idx, pos, cfg)
            assert_rel_close(o[:, pos].float(), want, TOL, "nsa rows")

        cands[f"nsa split={split}"] = Candidate(fn=run, check=check)
    g = setup.hq // setup.h
    qt = q.transpose(1, 2).contiguous()
    kt, vt = (x.repeat_interleave(g, 2).transpose(1, 2).contiguous() for x in (ks, vs))

    def sdpa(backend):
        with torch.no_grad(), sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def check_cudnn():
        n = min(t, 8192)  # the flash backend's rows, computed on a prefix to keep the check short
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = torch.nn.functional.scaled_dot_product_attention(qt[:, :, :n], kt[:, :, :n], vt[:, :, :n],
                                                                     is_causal=True)  # fmt: skip
        assert_rel_close(
            sdpa(SDPBackend.CUDNN_ATTENTION)[:, :, :n].float(), flash.float(), 2e-2, "cudnn rows"
        )

    cands["cudnn"] = Candidate(fn=lambda: sdpa(SDPBackend.CUDNN_ATTENTION), check=check_cudnn)
    return cands


def run(setup: Setup, out: Path | None, t: int) -> Path:
    report = Report(
        package="nsa",
        title=f"NSA strided forward at T = {t}: one masked loop or split, by tile ({setup.hq} query / "
        f"{setup.h} KV heads, {setup.heads()}, bf16)",
        columns=COLUMNS,
        measure_ceilings=False,
        notes=" ".join(__doc__.split("\n\n")[1:]).replace("\n", " "),
    )
    rounds = setup.rounds(t)
    for stage in ("cmp", "win"):
        log(f"strided sweep T={t}: {stage}")
        res = measure({f"{s}|{tile}": c for (s, tile), c in branch_candidates(setup, t, stage).items()},
                      rounds=rounds, warmup=5, rep=10, timer=setup.timer)  # fmt: skip
        for name, m in res.items():
            split, tile = name.split("|")
            report.add(stage=stage, split=split == "True", tile=tile, T=t, **m.row())
    log(f"strided sweep T={t}: the whole forward and cuDNN")
    res = measure(whole_candidates(setup, t), rounds=rounds, warmup=5, rep=10, timer=setup.timer)
    for name, m in res.items():
        split = None if name == "cudnn" else name.endswith("True")
        report.add(stage="cudnn" if name == "cudnn" else "nsa", split=split, tile="default", T=t, **m.row())
    return report.write(tag="strided-sweep", out_dir=out)


def main(argv=None) -> None:
    ap = bench_parser(__doc__.split("\n")[0], rounds=5, only=False, settings=False, tag=False)
    ap.add_argument("--t", type=int, default=65536, help="the sequence length (default 65536)")
    add_heads_arg(ap)
    args = parse_bench_args(ap, argv)
    d, dv = parse_heads(ap, args.heads)
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.lab.strided_sweep needs a CUDA GPU")
    run(Setup(rounds=lambda t: args.rounds, d=d, dv=dv), args.out, args.t)


if __name__ == "__main__":
    main()
