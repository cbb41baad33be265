"""The selected branch's backwards and launch shapes, timed against one another and fla's, on one GPU.

``python -m repro.nsa.lab.slc_backward --out DIR [--lengths 8192,65536]``.

The selected branch alone (the paper's attention shape, bf16) on the block indices the paper's
configuration selects for the bench's inputs (l' = 64, n = 16). A sweep (``paperclub.bench.sweep``)
over ``Switches``: :data:`IMPLS` names each setting (the default block-major backward first, the
baseline), fla's ``parallel_nsa`` beside them. Two passes per length: ``bwd`` (the backward of one
forward kept for every timed call, with a fixed cotangent) and ``fwd+bwd``. Checked first: the
query-major backward's forward rows against the reference, every other setting's dQ, dK, dV against
the query-major backward's (``checks.GRAD_TOL``), fla's output against ours (its gradients' errors
against ours are logged). Writes ``results/<device>-slc-bwd.json`` after each length. What the
default of ``Switches.slc_backward`` and ``selected.BLOCK_MAJOR_ROWS`` / ``_STAGES`` rest on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paperclub.bench import Candidate, Report, bench_parser, parse_bench_args, sweep, timed_pass, variants
from paperclub.testing import assert_rel_close, rel_error
from repro.nsa import reference as ref
from repro.nsa.bench import PEER, Setup, add_heads_arg, failed, log, parse_heads, train_inputs
from repro.nsa.checks import GRAD_TOL, TOL, sample_rows
from repro.nsa.config import Switches
from repro.nsa.layer import nsa_attention
from repro.nsa.selected import selected_attention

#: impl -> its change to the default Switches; the first is the baseline (the default)
IMPLS = {
    "ours-slc-tiled": {},
    "ours-slc": {"slc_backward": "query-major"},
    "ours-slc-tiled-r64s1": {"slc_bwd_rows": 64, "slc_bwd_stages": 1},
    "ours-slc-tiled-r32s1": {"slc_bwd_rows": 32, "slc_bwd_stages": 1},
}
COLUMNS = ["impl", "pass", "T", "changes", "ms", "ms_min", "ms_max", "check", "vs_baseline", "vs_fla"]
QUERY_MAJOR = Switches(slc_backward="query-major")


def candidates(setup: Setup, t: int, fla, gen: torch.Generator, impls: dict = IMPLS):
    """(configs, build, peers): the sweep's Switches by name, ``build(config, pass)`` -> Candidate, and
    fla's candidates by pass, for the selected branch alone at length ``t``."""
    cfg = setup.paper
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(setup, t)
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    with torch.no_grad():
        idx = nsa_attention(q, k_cmp, v_cmp, ks, vs, kw, vw, gates, cfg)[1]
    del kc_raw, vc_raw, kw, vw, gates, k_cmp, v_cmp
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, ks, vs))
    gen_do = torch.Generator(device=setup.device).manual_seed(t)
    do = torch.randn(*q.shape[:-1], setup.d_v, device=setup.device, generator=gen_do).to(setup.dtype)
    pos = sample_rows(t, gen, setup.device)
    cache: dict = {}

    def forward(sw):
        return selected_attention(*leaves, idx, cfg.select_len, check_indices=False, switches=sw)

    def base_grads():
        if "base" not in cache:
            cache["base"] = torch.autograd.grad(forward(QUERY_MAJOR), leaves, do)
        return cache["base"]

    def check_of(sw: Switches):
        def check():
            if sw.slc_backward == "query-major":
                want = ref.selected_attention(leaves[0].detach()[:, pos], leaves[1].detach(), leaves[2].detach(),
                                              idx[:, pos], cfg.select_len, q_pos=pos)  # fmt: skip
                assert_rel_close(forward(sw)[:, pos].detach().float(), want, TOL, "ours slc rows")
                return
            got = torch.autograd.grad(forward(sw), leaves, do)
            for name, a, r in zip("qkv", got, base_grads(), strict=True):
                assert_rel_close(a.float(), r.float(), GRAD_TOL, f"{sw} d{name} vs the query-major backward")

        return check

    def build(sw: Switches, pass_: str) -> Candidate:
        # bwd: the forward once, its graph kept for every timed backward (paperclub.bench.bwd_only)
        return Candidate(fn=timed_pass(pass_, lambda: forward(sw), leaves, do), check=check_of(sw))

    parallel_nsa, why = fla
    peers = {}
    for pass_ in ("bwd", "fwd+bwd"):
        if parallel_nsa is None:
            peers[pass_] = failed(why)
            continue

        def fla_fwd():
            return parallel_nsa(*leaves, block_indices=idx, block_counts=cfg.n_select, block_size=cfg.select_len,
                                window_size=0)  # fmt: skip

        def check_fla():  # fla's forward must agree; its gradients are logged, not required
            with torch.no_grad():
                assert_rel_close(fla_fwd().float(), forward(Switches()).float(), TOL, "fla slc vs ours")
            got = torch.autograd.grad(fla_fwd(), leaves, do)
            errs = [rel_error(x.float(), y.float()) for x, y in zip(got, base_grads(), strict=True)]
            log(f"slc-bwd T={t}: fla's dq, dk, dv against ours: " + ", ".join(f"{e:.2e}" for e in errs))

        peers[pass_] = Candidate(fn=timed_pass(pass_, fla_fwd, leaves, do), check=check_fla)
    configs = variants(setup.switches, {k: v for k, v in impls.items() if v}, baseline=next(iter(impls)))
    return configs, build, peers


def run(
    setup: Setup, out: Path | None, lengths: list[int], fla, gen: torch.Generator, impls: dict = IMPLS
) -> Path:
    """Sweep :data:`IMPLS` and fla at each length and pass; write ``<device>-slc-bwd.json`` after each
    length."""
    report = Report(
        package="nsa",
        title=f"NSA selected branch backward ({setup.hq} query heads, {setup.h} KV heads, {setup.heads()}, bf16)",
        columns=COLUMNS,
        measure_ceilings=False,
        **PEER,
        notes=" ".join(__doc__.split("\n\n")[1:]).replace("\n", " "),
    )
    path = None
    for t in lengths:
        log(f"slc-bwd T={t}: building inputs and candidates")
        configs, build, peers = candidates(setup, t, fla, gen, impls)
        for p in ("bwd", "fwd+bwd"):
            rows = sweep(configs, lambda sw, p=p, build=build: build(sw, p), peers={"fla-slc": peers[p]},
                         rounds=setup.rounds(t), warmup=5, rep=20, timer=setup.timer)  # fmt: skip
            fla_ms = next(r["ms"] for r in rows if r["config"] == "fla-slc")
            for r in rows:
                vs = fla_ms / r["ms"] if fla_ms and r["ms"] else None
                report.add(impl=r.pop("config"), T=t, vs_fla=vs, **{"pass": p}, **r)
                log(f"slc-bwd T={t} {p}: {report.rows[-1]['impl']}: {r['ms'] or r['check']}")
        if setup.device == "cuda":
            torch.cuda.empty_cache()
        path = report.write(tag="slc-bwd", out_dir=out)
    return path


def main(argv=None) -> None:
    from repro.nsa.bench import load_fla

    ap = bench_parser(__doc__.split("\n")[0], rounds=None, only=False, settings=False, tag=False)
    ap.add_argument("--lengths", default="8192,65536", help="comma-separated T values")
    add_heads_arg(ap)
    args = parse_bench_args(ap, argv)
    d, dv = parse_heads(ap, args.heads)
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.lab.slc_backward needs a CUDA GPU")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    run(Setup(d=d, dv=dv), args.out, lengths, load_fla(), torch.Generator().manual_seed(2))


if __name__ == "__main__":
    main()
