"""Benchmark: DFlash speculative decoding against target-only decoding, an EAGLE-3-style drafter and
an autoregressive drafter.

``python -m repro.dflash.bench --out DIR --budget-s 240 [--quick] [--seed 0]``

Everything happens in the call (no checkpoint leaves the GPU machine): load the standard-library
corpus, train from a fixed seed the target, the DFlash drafter, the EAGLE-3-style drafter
(``eagle.py``: fused low/mid/high target features, one causal layer, training-time test) and the
1-layer autoregressive drafter, each under a wall-clock cap taken from the budget (``train.py``,
config ``gpu``; on a machine without CUDA the ``tiny`` config, for a smoke run). The two
feature-conditioned drafters are trained alike: on the same windows in the same order, for the same
number of steps (DFlash's, which its cap decides; the EAGLE one's own cap only guards the budget),
with the same learning rate, position weights and soft labels. Then held-out prompts are decoded:

* ``target``: plain decoding with a KV cache (one target forward per token, no host syncs);
* ``dflash``: :func:`repro.dflash.speculative_generate` with the DFlash drafter, block sizes 4..16;
* ``eagle``: the same loop and verify step with the EAGLE-style drafter, drafting a chain of
  block_size - 1 tokens (block_size - 1 drafter forwards per round), block sizes 2..16 (2 and 3 so
  that some EAGLE block drafts as cheaply as one DFlash forward);
* ``ar``: the same with the autoregressive drafter (a 1-layer LM that never sees the target's
  states), block sizes 2..16.

Each runs in two modes (column ``mode``): ``eager``, the host-driven loops, and ``graphs``, the
static steps of ``static.py`` captured as CUDA graphs (on a CPU they run eagerly): target-only
decoding replays one graph per token; a DFlash round and an EAGLE round each replay a draft graph
and a verify graph and read the accepted length once (graphed against graphed); the AR drafter
still drafts eagerly and replays only the verification. The graphs are captured in the check,
before timing.

At temperature 0 each speculative candidate's check decodes every prompt and requires the output to
equal the target's greedy output token for token (a candidate that fails is not timed); at
temperature 1 the check only validates the output. Timing: ``paperclub.bench.measure``, interleaved
rounds, each call decoding all prompts once, wall clock with a CUDA synchronize (a decoding loop
is host-driven, so device events would miss the host's share). Columns: ``tau`` (mean tokens per
verification), ``tokens_per_s``, ``speedup`` over eager target-only decoding at the same
temperature and ``speedup_same_mode`` over target-only decoding in the row's own mode (graphs
against graphs), and rows ``component:*`` with the time of one target verification, one DFlash
draft, one EAGLE draft and one AR step (which explain the speedups: at this size each forward
costs its kernel launches, not its FLOPs), eager and as graph replays.

Drafting cost (column ``draft_ms``): milliseconds of drafter work per verification round, from those
component timings, not from the timed decoding runs: for DFlash one draft forward
(``component:dflash_draft`` of the row's mode); for the EAGLE-style drafter its block_size - 1
forwards (``component:eagle_draft``: eagerly, a forward over one verified pair and block_size - 2
one-position steps with their argmax; as a graph, the whole draft step, whose first forward covers
the block's block_size positions, padded); for the AR drafter its block_size - 1 steps
(``component:ar_draft``, eager in both modes since it drafts eagerly). Rows ``eagle_at_dflash_cost``
and ``ar_at_dflash_cost`` compare at equal drafting cost (:func:`equal_cost_pairs`), eager with
eager and graphs with graphs: at each DFlash block, the baseline's tau and speedup at the largest of
its blocks whose ``draft_ms`` is at most DFlash's (``eagle_block``/``ar_block`` and their
``*_draft_ms``; block 2 when none is that cheap, which then costs more).

Models run in fp32 at inference (TF32 off), so that the verification of a block and the one-token
steps of target-only decoding round alike enough for greedy equality.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from paperclub.bench import Budget, Candidate, Report, bench_parser, measure, parse_bench_args, time_ms
from repro.dflash.data import load_corpus
from repro.dflash.speculative import generate, speculative_generate
from repro.dflash.static import StaticDecoder
from repro.dflash.train import CONFIGS, train_all, train_eagle

PROMPT_LEN = 64


def wall_ms(fn, *, warmup: int = 0, rep: int = 1) -> float:
    """Median wall time of ``fn()`` in ms over ``rep`` calls after ``warmup`` (CUDA synchronized)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def heldout_prompts(text: torch.Tensor, n: int, length: int, seed: int) -> list[torch.Tensor]:
    """``n`` prompts of ``length`` bytes from the held-out text, each starting after a newline."""
    gen = torch.Generator().manual_seed(seed)
    newlines = (text[:-length] == 10).nonzero().flatten() + 1
    pick = newlines[torch.randperm(newlines.numel(), generator=gen)[:n]]
    return [text[int(s) : int(s) + length].long() for s in pick]


def equal_cost_pairs(rows: list[dict], mode: str, temperature: float, base: str = "ar") -> list[dict]:
    """DFlash against a baseline drafter (``base``: ``"eagle"`` or ``"ar"``) at equal or lower
    drafting cost, one dict per DFlash block.

    rows: the Report's rows (``impl``, ``mode``, ``block_size``, ``temperature``, ``tau``,
    ``speedup``, ``draft_ms``, ``check``); only checked rows with a tau and a ``draft_ms`` of the
    given mode and temperature count. For each DFlash block b with drafting cost c_D(b), the
    baseline's row at the largest block whose cost is <= c_D(b) (no interpolation); when none is
    that cheap, its block 2 (``base_costs_more``). Returns dicts with ``block_size``, ``tau``,
    ``speedup``, ``draft_ms`` (DFlash's) and ``base_block``, ``base_tau``, ``base_speedup``,
    ``base_draft_ms``, ``base_costs_more`` (None when there is no baseline row to compare with).
    """

    def usable(r, impl):
        return (r.get("impl") == impl and r.get("mode") == mode and r.get("temperature") == temperature
                and r.get("check") == "ok" and r.get("tau") is not None and r.get("draft_ms") is not None)  # fmt: skip

    other = {r["block_size"]: r for r in rows if usable(r, base)}
    out = []
    for d in sorted((r for r in rows if usable(r, "dflash")), key=lambda r: r["block_size"]):
        within = [b for b, r in other.items() if r["draft_ms"] <= d["draft_ms"]]
        b_base = max(within) if within else (2 if 2 in other else None)
        o = other.get(b_base, {})
        out.append(
            {
                "block_size": d["block_size"],
                "tau": d["tau"],
                "speedup": d.get("speedup"),
                "draft_ms": d["draft_ms"],
                "base_block": b_base,
                "base_tau": o.get("tau"),
                "base_speedup": o.get("speedup"),
                "base_draft_ms": o.get("draft_ms"),
                "base_costs_more": None if b_base is None else not within,
            }
        )
    return out


def decode_rows(report, notes, temperature, target, drafters, prompts, new_tokens, rounds, seed, left, draft_ms,
                reserve_rounds=0.0, modes=("eager", "graphs")) -> None:  # fmt: skip
    """Check, then time target-only decoding and speculative decoding with each drafter of
    ``drafters`` (``{impl: (model, block sizes)}``) on all prompts at one temperature.

    draft_ms: ``{(impl, mode, block): ms}`` of drafting per round, copied into the rows. Rounds: the
    check and one timed round always; more (up to ``rounds``) while the measured round time leaves
    ``reserve_rounds`` such rounds of the budget for what comes after.
    """
    dev = target.device
    gen = torch.Generator(device=dev)
    stats: dict[str, float] = {}

    def run_target(mode="eager"):
        gen.manual_seed(seed)
        return [generate(target, p, new_tokens, temperature, generator=gen, mode=mode) for p in prompts]

    def run_spec(model, B, name, mode="eager"):
        gen.manual_seed(seed)
        outs = [
            speculative_generate(
                target, model, p, new_tokens, block_size=B, temperature=temperature, generator=gen, mode=mode
            )
            for p in prompts
        ]
        taus = [a + 1 for o in outs for a in o.accepted]
        stats[name] = sum(taus) / max(len(taus), 1)
        return outs

    t0 = time.perf_counter()
    reference = run_target()
    est_target = time.perf_counter() - t0

    def check_target(mode):
        for i, o in enumerate(run_target(mode)):
            if temperature == 0 and not torch.equal(o, reference[i]):
                raise AssertionError(f"prompt {i}: {mode} target-only output differs from the eager one")

    def check_spec(model, B, name, mode):
        for i, o in enumerate(run_spec(model, B, name, mode)):
            if o.tokens.shape != (new_tokens,) or int(o.tokens.min()) < 0 or int(o.tokens.max()) > 255:
                raise AssertionError(f"prompt {i}: malformed output {tuple(o.tokens.shape)}")
            if temperature == 0 and not torch.equal(o.tokens, reference[i]):
                first = int((o.tokens != reference[i]).nonzero()[0])
                raise AssertionError(f"prompt {i}: greedy output differs from the target's at token {first}")

    # names "<impl>:<mode>-<block>"; mode "eager" is the host-driven loop, "graphs" the static steps
    # replayed as CUDA graphs (captured in the check, before timing; on a CPU they run eagerly)
    cands = {}
    for mode in modes:
        cands[f"target:{mode}"] = Candidate(
            fn=lambda mode=mode: run_target(mode), check=lambda mode=mode: check_target(mode)
        )
        for kind, (model, sizes) in drafters.items():
            for B in sizes:
                name = f"{kind}:{mode}-{B}"
                cands[name] = Candidate(
                    fn=lambda m=model, B=B, n=name, mode=mode: run_spec(m, B, n, mode),
                    check=lambda m=model, B=B, n=name, mode=mode: check_spec(m, B, n, mode),
                )
    # the check and one interleaved round; then more rounds (same interleaving, checked candidates
    # only) as far as the measured time of a round allows, merged into the same medians
    res = measure(cands, rounds=1, warmup=0, rep=1, timer=wall_ms)
    round_s = sum(m.median_ms for m in res.values() if m.ok) / 1e3
    extra = 0
    while extra < rounds - 1 and round_s * (extra + 1 + reserve_rounds) < left() - 15:
        extra += 1
    if extra:
        more = measure({n: cands[n].fn for n, m in res.items() if m.ok}, rounds=extra, warmup=0, rep=1,
                       timer=wall_ms)  # fmt: skip
        for n, m in more.items():
            if not m.ok:  # failed while timing: recorded as such
                res[n] = m
                continue
            r = res[n]
            r.rounds += m.rounds
            r.median_ms, r.min_ms, r.max_ms = statistics.median(r.rounds), min(r.rounds), max(r.rounds)
    notes.append(
        f"temperature {temperature}: {1 + extra} rounds (one round of all {len(cands)} candidates "
        f"{round_s:.1f} s; one eager target-only run {est_target:.2f} s)"
    )
    base = res["target:eager"].median_ms  # speedup: over eager target-only decoding, in every mode
    total_tokens = len(prompts) * new_tokens

    def ratio(num, den):
        return round(num / den, 3) if (num and den) else None

    for name, m in res.items():
        label, _, b = name.partition("-")
        impl, _, mode = label.partition(":")
        same = res.get(f"target:{mode}")  # speedup_same_mode: over target-only in the row's mode
        tps = total_tokens / (m.median_ms / 1e3) if m.median_ms else None
        report.add(
            impl=impl,
            mode=mode,
            block_size=int(b) if b else 1,
            temperature=temperature,
            tau=round(stats[name], 3) if name in stats else (1.0 if impl == "target" else None),
            tokens_per_s=round(tps, 1) if tps else None,
            speedup=ratio(base, m.median_ms),
            speedup_same_mode=ratio(same.median_ms if same and same.ok else None, m.median_ms),
            draft_ms=draft_ms.get((impl, mode, int(b) if b else 1)),
            **m.row(),
        )


def main(argv=None) -> Path:
    ap = bench_parser(__doc__.split("\n\n")[0], budget_s=240.0, quick_help="fewer prompts, block sizes and rounds",
                      rounds=None, only=False, settings=False, tag=False)  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = parse_bench_args(ap, argv)
    # counted from here, not from the process's start: the training caps below are shares of it
    run_budget = Budget(args.budget_s)
    budget = args.budget_s
    left = run_budget.left

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if cuda:
        tc = CONFIGS["gpu"]
        n_prompts, new_tokens = (2, 96) if args.quick else (4, 96)
        blocks = [4, 8, 16] if args.quick else [4, 8, 12, 16]
        eagle_blocks = [2, 4, 8, 16] if args.quick else [2, 3, 4, 8, 12, 16]
        ar_blocks = [2, 4, 8] if args.quick else [2, 3, 4, 8, 16]
        rounds = 2 if args.quick else 3
        # wall-clock caps on training, as shares of the budget; decoding gets the rest (about half).
        # The EAGLE drafter trains for DFlash's step count: its cap only keeps the budget.
        share = (
            {"target": 0.12, "dflash": 0.1, "eagle": 0.1, "ar": 0.04}
            if args.quick
            else {"target": 0.17, "dflash": 0.15, "eagle": 0.15, "ar": 0.04}
        )
    else:  # CPU smoke run: the tiny config, cut short
        tc = replace(CONFIGS["tiny"], target_steps=30, drafter_steps=20, ar_steps=20)
        n_prompts, new_tokens, blocks, eagle_blocks, ar_blocks, rounds = 2, 24, [4, 8], [2, 4], [2, 4], 1
        share = {"target": 0.2, "dflash": 0.15, "eagle": 0.15, "ar": 0.1}
    notes: list[str] = []
    corpus = load_corpus(tc.corpus_bytes)
    notes.append(f"corpus: {corpus.describe()} (Python {sys.version.split()[0]} standard library)")
    caps = {k: v * budget for k, v in share.items()}
    target, drafter, ar, _, log = train_all(tc, dev, args.seed, corpus, show=True, seconds=caps)
    eagle = train_eagle(target, tc, corpus, log.steps["dflash"], dev, args.seed, log, True, caps["eagle"])
    notes.append(
        f"training (seed {args.seed}, caps {dict((k, round(v)) for k, v in caps.items())} s; eagle: dflash's "
        f"{log.steps['dflash']} steps on the same windows): steps {log.steps}, seconds {log.seconds}, final loss "
        f"{log.loss} (nats/byte; target and ar: next byte; dflash: weighted block CE; eagle: weighted "
        f"training-time-test CE over {tc.eagle.ttt_steps} steps)"
    )
    for m in (target, drafter, eagle, ar):
        m.float().eval()
    n_params = {
        name: sum(p.numel() for p in m.parameters())
        for name, m in (("target", target), ("dflash", drafter), ("eagle", eagle), ("ar", ar))
    }
    notes.append(
        f"models: target {tc.target}, {n_params['target']} params; dflash {tc.drafter} (feature layers "
        f"{drafter.feature_layers}), {n_params['dflash']} own params; eagle {tc.eagle} (feature layers "
        f"{eagle.feature_layers}), {n_params['eagle']} own params; ar {tc.ar}, {n_params['ar']} params "
        "(both feature-conditioned drafters share the target's embedding and LM head, not counted)"
    )
    prompts = [p.to(dev) for p in heldout_prompts(corpus.heldout, n_prompts, PROMPT_LEN, args.seed)]
    notes.append(f"{n_prompts} held-out prompts of {PROMPT_LEN} bytes, {new_tokens} new tokens each")

    report = Report(
        package="dflash",
        title="DFlash speculative decoding vs target-only, an EAGLE-3-style and an autoregressive drafter (toy byte-level target)",
        columns=[
            "impl",
            "mode",
            "block_size",
            "temperature",
            "tau",
            "tokens_per_s",
            "speedup",
            "speedup_same_mode",
            "ms",
            "ms_min",
            "ms_max",
            "check",
            "draft_ms",
            "eagle_block",
            "eagle_draft_ms",
            "ar_block",
            "ar_draft_ms",
        ],  # fmt: skip
        peer="target-only decoding, an EAGLE-3-style drafter and a 1-layer autoregressive drafter (ours)",
    )
    draft_ms = component_rows(
        report, target, drafter, eagle, ar, prompts[0], blocks, eagle_blocks, ar_blocks, cuda
    )

    drafters = {"dflash": (drafter, blocks), "eagle": (eagle, eagle_blocks), "ar": (ar, ar_blocks)}
    for temperature in (0.0, 1.0):
        if left() < 20:
            notes.append(f"temperature {temperature}: skipped, budget spent")
            break
        # at temperature 0, keep room for temperature 1's check and first round (each about twice
        # a round at temperature 0)
        decode_rows(report, notes, temperature, target, drafters, prompts, new_tokens, rounds, args.seed, left,
                    draft_ms, reserve_rounds=4.0 if temperature == 0 else 0.0)  # fmt: skip

    # equal drafting cost: at each DFlash block, each baseline at the largest of its blocks that drafts
    # as cheaply, eager against eager and graphs against graphs (tau is the same in both modes, the
    # costs are not)
    for base in ("eagle", "ar"):
        for temperature in (0.0, 1.0):
            for mode in ("eager", "graphs"):
                pairs = equal_cost_pairs(report.rows, mode, temperature, base)
                for p in pairs:
                    report.add(impl=f"{base}_at_dflash_cost", mode=mode, block_size=p["block_size"],
                               temperature=temperature, tau=p["base_tau"], speedup=p["base_speedup"],
                               draft_ms=p["draft_ms"], **{f"{base}_block": p["base_block"],
                               f"{base}_draft_ms": p["base_draft_ms"]})  # fmt: skip
                if pairs:
                    notes.append(f"equal drafting cost, {base} ({mode}, temperature {temperature:g}): " + "; ".join(
                        _pair_note(p, base.upper() if base == "ar" else "EAGLE") for p in pairs))  # fmt: skip
    notes.append(
        "tau at temperature 1 is from the last timed call (seeded generator, same draws every call). "
        "What limits the speedup here: every forward of these few-million-parameter models costs its "
        "kernel launches and the host loop (see the component rows: a target forward of 1 or 16 tokens "
        "takes about the same time), and each round has one host sync to read the accepted length. "
        "Rows with mode 'graphs' run the static steps of static.py replayed as CUDA graphs (DFlash and "
        "EAGLE: draft and verification one replay each; AR: drafts eagerly, verification replayed; "
        "still one host read of the accepted length per round). speedup is over eager target-only "
        "decoding, speedup_same_mode over target-only decoding in the row's mode (graphs vs graphs). "
        "draft_ms: drafting time per verification round from the component timings (not from the timed "
        "runs): DFlash one draft forward (component:dflash_draft of the row's mode; its argmax not "
        "included); EAGLE block_size - 1 forwards with their argmax (component:eagle_draft of the row's "
        "mode); AR block_size - 1 greedy steps timed as one call (component:ar_draft, eager in both modes; "
        "at temperature 1 sampling costs a little more). Rows <base>_at_dflash_cost: at each DFlash block "
        "(block_size, draft_ms), the baseline's tau and speedup at <base>_block, its largest block with "
        "<base>_draft_ms <= draft_ms (block 2 when none is that cheap)."
    )
    report.notes = " | ".join(notes)
    for t in (0.0, 1.0):
        # tau is the same in both modes (same tokens), so the eager rows carry it
        report.plot(title=f"acceptance length tau vs block size, temperature {t:g}", x="block_size", y="tau",
                    series="impl", where={"temperature": t, "mode": "eager"})  # fmt: skip
        report.plot(title=f"tau vs drafting time per round (CUDA graphs, ms), temperature {t:g}", x="draft_ms",
                    y="tau", series="impl", where={"temperature": t, "mode": "graphs"})  # fmt: skip
        for mode in ("eager", "graphs"):
            report.plot(title=f"speedup over target-only decoding ({mode}, same mode), temperature {t:g}",
                        x="block_size", y="speedup_same_mode", series="impl",
                        where={"temperature": t, "mode": mode})  # fmt: skip
    if not cuda:
        report.measure_ceilings = False
    path = report.write(out_dir=args.out)
    print(f"total {run_budget.elapsed():.0f} s of a {budget:.0f} s budget", file=sys.stderr)
    return path


def _pair_note(p: dict, name: str) -> str:
    head = (
        f"DFlash block {p['block_size']} tau {p['tau']} speedup {p['speedup']} at {p['draft_ms']:.2f} ms vs "
    )
    if p["base_block"] is None:
        return head + f"no {name} row"
    return head + (
        f"{name} block {p['base_block']} tau {p['base_tau']} speedup {p['base_speedup']} at "
        f"{p['base_draft_ms']:.2f} ms"
        + (f" (costs more: no {name} block is as cheap)" if p["base_costs_more"] else "")
    )


def component_rows(report, target, drafter, eagle, ar, prompt, blocks, eagle_blocks, ar_blocks, cuda) -> dict:
    """Time one verification, one draft of each drafter and one AR step alone (rows ``component:*``),
    eagerly and, on a GPU, as captured static steps; returns ``{(impl, mode, block): drafting ms per
    round}`` for the decoding rows."""
    dev = target.device
    draft_ms: dict[tuple[str, str, int], float] = {}
    with torch.no_grad():
        for B in sorted(set(blocks) | {1}):
            cache = target.new_cache()
            target(prompt[None, :], cache)
            blk = torch.zeros(1, B, dtype=torch.long, device=dev)

            def verify(cache=cache, blk=blk):
                target(blk, cache, drafter.feature_layers)
                cache.crop(PROMPT_LEN)

            report.add(impl="component:target_forward", mode="eager", block_size=B, ms=time_ms(verify))
        dcache = drafter.new_cache()
        _, feats = target(prompt[None, :], feature_layers=drafter.feature_layers)
        drafter.extend_context(dcache, feats)
        for B in blocks:
            ms = time_ms(lambda B=B: drafter.draft_logits(dcache, prompt[-1], B))
            report.add(impl="component:dflash_draft", mode="eager", block_size=B, ms=ms)
            draft_ms[("dflash", "eager", B)] = round(ms, 4)

        # EAGLE, eagerly: the pairs of the prompt but its last cached, then one round's drafting: a
        # forward over the last verified pair (one here; a + 1 in decoding) and B - 2 steps on its
        # own outputs, each with the argmax that feeds the next
        ecache = eagle.new_cache()
        _, feats = target(prompt[None, :], feature_layers=eagle.feature_layers)
        g = eagle.fuse_features(feats)
        eagle(g[:, :-2], prompt[None, 1:-1], ecache)
        base_len = ecache.length

        def eagle_draft(B):
            a = eagle(g[:, -2:-1], prompt[None, -1:], ecache)
            tok = eagle.logits(a[0]).argmax(-1)
            for _ in range(B - 2):
                a = eagle(a, tok[None], ecache)
                tok = eagle.logits(a[0]).argmax(-1)
            ecache.crop(base_len)

        for B in eagle_blocks:
            ms = time_ms(lambda B=B: eagle_draft(B))
            report.add(impl="component:eagle_draft", mode="eager", block_size=B, ms=ms)
            draft_ms[("eagle", "eager", B)] = round(ms, 4)

        acache = ar.new_cache()
        ar(prompt[None, :], acache)
        one = prompt[None, -1:]

        def ar_step():
            ar(one, acache)
            acache.crop(PROMPT_LEN)

        report.add(impl="component:ar_step", mode="eager", block_size=1, ms=time_ms(ar_step))

        def ar_draft(B):
            # one round's drafting: B - 1 greedy steps, each fed the previous step's token
            tok = one
            for _ in range(B - 1):
                logits, _ = ar(tok, acache)
                tok = logits[:, -1:].argmax(-1)
            acache.crop(PROMPT_LEN)

        for B in ar_blocks:
            ms = time_ms(lambda B=B: ar_draft(B))
            report.add(impl="component:ar_draft", mode="eager", block_size=B, ms=ms)
            for mode in ("eager", "graphs"):  # the AR drafter drafts eagerly in both modes
                draft_ms[("ar", mode, B)] = round(ms, 4)

    # the same parts as captured static steps (mode "graphs"): a whole verification step (target
    # forward, acceptance, token writes, DFlash's padded context update or the EAGLE drafter's
    # feature copy), a DFlash or EAGLE draft step, and one target-only token; each replay starts
    # from the same state, so every call does the same work. GPU only: on a CPU nothing is captured
    # and the smoke run has no time to spare
    if not cuda:
        return draft_ms
    with torch.inference_mode():
        n0 = PROMPT_LEN + 1
        plain = StaticDecoder(target, None, 1, 0.0, graphs=True)
        plain.prefill(prompt, None)

        def graph_token():
            plain.n.fill_(n0)
            plain.steps["step"]()

        report.add(impl="component:target_forward", mode="graphs", block_size=1, ms=time_ms(graph_token))
        for impl, model, sizes in (("dflash", drafter, blocks), ("eagle", eagle, eagle_blocks)):
            for B in sizes:
                dec = StaticDecoder(target, model, B, 0.0, graphs=True)
                dec.prefill(prompt, None)  # then n = n0 and accepted = 0: every replay drafts alike

                def graph_verify(dec=dec):
                    dec.n.fill_(n0)
                    dec.steps["verify"]()

                suffix = "" if impl == "dflash" else "_eagle"
                report.add(impl=f"component:verify_step{suffix}", mode="graphs", block_size=B,
                           ms=time_ms(graph_verify))  # fmt: skip
                dec.n.fill_(n0)
                dec.accepted.zero_()
                ms = time_ms(dec.steps["draft"])
                report.add(impl=f"component:{impl}_draft", mode="graphs", block_size=B, ms=ms)
                draft_ms[(impl, "graphs", B)] = round(ms, 4)
    return draft_ms


if __name__ == "__main__":
    main()
