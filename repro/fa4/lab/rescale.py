"""The kernel's own count of rescaling steps (``repro.fa4.forward_with_counts``): the fraction of
key-block steps that rescale O, by sequence length, on random data, with lazy rescaling (threshold 8)
and without (threshold 0: the steps where some row's max grew, what FA2 must rescale).

    python -m repro.fa4.lab.rescale --out DIR [--quick]   # on a GPU -> <device>-rescale.json

``python -m repro.fa4.bench`` runs it as its part ``rescale`` (in the default run, last, when a minute
of the budget is left). Shapes are the bench's: D = 128, 16 heads, B x S = 16k, bf16, S = 1k..16k
(``--quick``: 2k and 8k); data=randn has q, k, v ~ N(0, 1), data=wide q scaled so that the logits'
spread is 6 in log2 units.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paperclub.bench import Report, bench_parser, parse_bench_args
from repro.fa4.bench import SEQLENS, TOKENS, make_inputs


def run(out_dir: Path | None, seqlens=SEQLENS) -> Report:
    """The fraction of rescaling steps at each length, causal and not, randn and wide data, lazy and
    always; writes ``<device>-rescale.json``."""
    from repro.fa4 import forward_with_counts

    report = Report(
        package="fa4",
        title="Fraction of key-block steps that rescale O (kernel counter, D=128, 16 heads, bf16)",
        columns=["data", "threshold", "causal", "S", "fraction"],
        measure_ceilings=False,
        notes=(
            "Steps after each tile's first. data=randn: q, k, v ~ N(0, 1) (logit std 1.4 in log2 units); "
            "data=wide: q scaled so the logit std is 6 (log2 units). threshold=0 is the always-rescale "
            "baseline's count of steps where some row's max grew (what FA2 must rescale)."
        ),
    )
    for data, q_scale in (("randn", 1.0), ("wide", 6.0 / 1.4427)):
        for causal in (False, True):
            for s in seqlens:
                b = max(1, TOKENS // s)
                q, k, v = (t.detach() for t in make_inputs(b, s))
                for tau, lazy in ((8.0, True), (0.0, False)):
                    _, frac = forward_with_counts(q * q_scale, k, v, causal=causal, lazy_rescale=lazy)
                    report.add(data=data, threshold=tau, causal=causal, S=s, fraction=frac)
    report.plot(
        title="fraction of steps that rescale",
        x="S",
        y="fraction",
        series="data",
        where={"threshold": 8.0, "causal": False},
        logx=True,
    )
    report.write(tag="rescale", out_dir=out_dir)
    return report


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(
        __doc__.split("\n\n")[0], rounds=None, quick_help="2k and 8k", only=False, settings=False, tag=False
    )
    args = parse_bench_args(ap, argv)
    if not torch.cuda.is_available():
        raise SystemExit("repro.fa4.lab.rescale needs a CUDA GPU")
    run(args.out, (2048, 8192) if args.quick else SEQLENS)


if __name__ == "__main__":
    main()
