"""Summaries of the multi-GPU results for the paper page: ``python -m repro.usp.ingest [DIR]``.

Reads the Report files :mod:`repro.usp.dist_bench` wrote (``*-sweep-<G>gpu.json``, ``*-peers-*``,
``*-dpsp-*``) in DIR (default ``repro/usp/results``) and writes, beside them, Reports the site renders
with their plots (one file per source world size):

* ``*-weak-scaling-<G>gpu.json``: per S per GPU and mask, the best of our rows at 1, 2, G GPUs, its
  per-GPU TFLOP/s and the efficiency against one SDPA call on one GPU at the same tokens per GPU
  (the target is 0.85 at G = 4), with the plot;
* ``*-strong-scaling-<G>gpu.json``: tokens/s at the strong-scaling length on 1, 2, G GPUs, ours
  (best split and every split), one SDPA call, torch CP where it ran there, with the plot;
* ``*-versus-peers-<G>gpu.json``: at each shape, our best time against each peer's;
* ``*-zigzag-<G>gpu.json``: the load-balanced (zigzag) ring against the contiguous one, causal;
* ``*-dp-vs-sp-<G>gpu.json``: the machine's tokens/s per configuration at equal global batch.

Nothing here measures anything; it only regroups rows that were checked and timed.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from paperclub.bench import Report

__all__ = ["ingest"]


def _ok(r: dict) -> bool:
    return str(r.get("check", "")).startswith("ok") and isinstance(r.get("ms"), (int, float))


def _ours(r: dict) -> bool:
    return str(r.get("impl", "")).startswith("usp") and _ok(r)


def _k(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 else str(s)


def _report(doc: dict, title: str, columns: list[str], notes: str) -> Report:
    return Report(package="usp", title=title, columns=columns, measure_ceilings=False,
                  notes=notes + f" Regrouped from {doc.get('_name', 'the sweep')} (measured {doc.get('date', '?')[:10]}).",
                  peer=doc.get("peer", ""))  # fmt: skip


def weak_scaling(doc: dict) -> Report | None:
    rows = doc["rows"]
    rep = _report(doc, f"USP weak scaling: per-GPU attention TFLOP/s at fixed tokens per GPU, {doc['_world']} GPUs",
                  ["S_per_gpu", "causal", "gpus", "series", "best", "tflops_per_gpu", "sdpa_1gpu_tflops",
                   "usp_1gpu_tflops", "efficiency", "target", "meets"],
                  "fwd+bwd, bf16. best: the fastest of our rows at that GPU count (every split and variant); "
                  "efficiency: its per-GPU TFLOP/s over one SDPA call's on one GPU at the same tokens per GPU "
                  "(the issue's target: 0.85 on 4 GPUs).")  # fmt: skip
    keys = sorted({(r["S_per_gpu"], r["causal"]) for r in rows if r.get("gpus") == 1 and r.get("S_per_gpu")})
    for s, causal in keys:
        base = [
            r
            for r in rows
            if r.get("impl") == "full sdpa" and r.get("S") == s and r["causal"] == causal and _ok(r)
        ]
        if not base:
            continue
        t1 = base[0]["tflops_per_gpu"]
        u1 = [r["tflops_per_gpu"] for r in rows if r.get("impl") == "usp n=1" and r.get("S") == s and r["causal"] == causal and _ok(r)]  # fmt: skip
        for g in sorted({r["gpus"] for r in rows if r.get("S_per_gpu") == s}):
            cand = [
                r
                for r in rows
                if _ours(r) and r["gpus"] == g and r.get("S_per_gpu") == s and r["causal"] == causal
            ]
            if not cand:
                continue
            best = max(cand, key=lambda r: r["tflops_per_gpu"])
            eff = best["tflops_per_gpu"] / t1
            rep.add(S_per_gpu=s, causal=causal, gpus=g, series=f"{_k(s)}/GPU {'causal' if causal else 'non-causal'}",
                    best=best["impl"], tflops_per_gpu=best["tflops_per_gpu"], sdpa_1gpu_tflops=t1,
                    usp_1gpu_tflops=u1[0] if u1 else None, efficiency=eff, target=0.85 if g > 1 else None,
                    meets=(eff >= 0.85) if g > 1 else None)  # fmt: skip
    if not rep.rows:
        return None
    rep.plot(title="weak scaling: per-GPU TFLOP/s / one GPU's", x="gpus", y="efficiency", series="series")
    rep.plot(title="weak scaling: per-GPU attention TFLOP/s", x="gpus", y="tflops_per_gpu", series="series")
    return rep


def _strong_length(rows: list[dict]) -> int | None:
    by_s = defaultdict(set)
    for r in rows:
        if _ok(r) and r.get("S"):
            by_s[r["S"]].add(r["gpus"])
    cands = [s for s, g in by_s.items() if 1 in g and len(g) >= 2]
    return max(cands) if cands else None


def strong_scaling(doc: dict, peers: dict | None) -> Report | None:
    rows = doc["rows"]
    S = _strong_length(rows)
    if S is None:
        return None
    rep = _report(doc, f"USP strong scaling at S = {_k(S)}: tokens/s on 1, 2, {doc['_world']} GPUs",
                  ["impl", "causal", "gpus", "S", "ms", "tokens_per_s", "speedup", "efficiency"],
                  "fwd+bwd, bf16, one sequence. speedup: over one SDPA call on one GPU; efficiency: speedup / "
                  "GPUs. 'ours (best split)' is the fastest of our rows at each GPU count.")  # fmt: skip
    for causal in (True, False):
        sel = [r for r in rows if r.get("S") == S and r["causal"] == causal and _ok(r)]
        base = [r for r in sel if r["impl"] == "full sdpa"]
        if not base:
            continue
        t1 = base[0]["ms"]

        def add(impl, r, causal=causal, t1=t1):
            rep.add(impl=impl, causal=causal, gpus=r["gpus"], S=S, ms=r["ms"], tokens_per_s=r["tokens_per_s"],
                    speedup=t1 / r["ms"], efficiency=t1 / r["ms"] / r["gpus"])  # fmt: skip

        add("full sdpa (1 GPU)", base[0])
        for g in sorted({r["gpus"] for r in sel}):
            ours = [r for r in sel if _ours(r) and r["gpus"] == g]
            if ours:
                add("ours (best split)", min(ours, key=lambda r: r["ms"]))
            for r in ours:
                if (
                    g > 1
                    and r.get("backend") == "auto"
                    and r.get("layout") == "zigzag"
                    and r.get("head_groups") == 1
                ):
                    add(r["impl"], r)
        for r in (peers or {}).get("rows", []):
            if (
                r.get("S") == S
                and r.get("causal") == causal
                and _ok(r)
                and r.get("pass") == "fwd+bwd"
                and "context_parallel" in r["impl"]
            ):
                add(r["impl"], r)
    if not rep.rows:
        return None
    rep.plot(title=f"strong scaling, S = {_k(S)}", x="gpus", y="tokens_per_s", series="impl", facet="causal")
    return rep


def versus_peers(doc: dict) -> Report | None:
    rows = doc["rows"]
    rep = _report(doc, f"USP against its peers, {doc['_world']} GPUs",
                  ["S", "gpus", "causal", "pass", "peer", "peer_ms", "peer_check", "ours", "ours_ms", "ours_speedup"],
                  "ours_speedup = peer_ms / ours_ms (above 1: ours is faster), our best split against each "
                  "peer at the same shape, mask and pass; checked and timed in the same interleaved rounds.")  # fmt: skip
    groups = defaultdict(list)
    for r in rows:
        groups[r.get("S"), r.get("gpus"), r.get("causal"), r.get("pass")].append(r)
    for (S, g, causal, passes), rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        ours = [r for r in rs if _ours(r)]
        best = min(ours, key=lambda r: r["ms"]) if ours else None
        for r in rs:
            if str(r.get("impl", "")).startswith("usp"):
                continue
            rep.add(S=S, gpus=g, causal=causal, **{"pass": passes}, peer=r["impl"], peer_ms=r.get("ms"),
                    peer_check=r.get("check"), ours=best["impl"] if best else None, ours_ms=best["ms"] if best else None,
                    ours_speedup=(r["ms"] / best["ms"]) if (best and _ok(r)) else None)  # fmt: skip
    return rep if rep.rows else None


def zigzag(doc: dict) -> Report | None:
    rows = doc["rows"]
    rep = _report(doc, "Load-balanced (zigzag) ring against the contiguous ring, causal",
                  ["S", "gpus", "ulysses", "ring", "zigzag_ms", "contiguous_ms", "zigzag_speedup"],
                  "Causal fwd+bwd, the same split with the two layouts, in the same rounds. zigzag_speedup = "
                  "contiguous_ms / zigzag_ms.")  # fmt: skip
    for r in rows:
        if r.get("layout") != "contiguous" or not _ours(r) or not r["causal"]:
            continue
        z = [x for x in rows if _ours(x) and x["causal"] and x.get("layout") == "zigzag" and x["gpus"] == r["gpus"]
             and x["ulysses"] == r["ulysses"] and x["ring"] == r["ring"] and x["S"] == r["S"]
             and x.get("backend") == r.get("backend") and x.get("head_groups") == r.get("head_groups")]  # fmt: skip
        if z:
            rep.add(S=r["S"], gpus=r["gpus"], ulysses=r["ulysses"], ring=r["ring"], zigzag_ms=z[0]["ms"],
                    contiguous_ms=r["ms"], zigzag_speedup=r["ms"] / z[0]["ms"])  # fmt: skip
    return rep if rep.rows else None


def dp_vs_sp(doc: dict) -> Report | None:
    world = doc["_world"]
    rep = _report(doc, f"Data against sequence parallelism at equal global batch, {world} GPUs",
                  ["config", "causal", "global_batch", "gpus", "ulysses", "ring", "S", "ms", "global_tokens_per_s",
                   "vs_data_parallel", "mem_gib"],
                  "fwd+bwd, bf16. global_tokens_per_s: the machine's (per-replica tokens/s x replicas); "
                  "vs_data_parallel: over data parallel's at the same global batch and mask.")  # fmt: skip
    rows = [r for r in doc["rows"] if _ok(r)]
    out = []
    for r in rows:
        m = re.search(r"global batch (\d+)", r["impl"])
        gb = int(m.group(1)) if m else None
        out.append((r, gb, r["tokens_per_s"] * world / r["gpus"]))
    for r, gb, tps in out:
        dp = [t for x, g, t in out if g == gb and x["causal"] == r["causal"] and x["gpus"] == 1]
        rep.add(config=r["impl"].split(" (")[0], causal=r["causal"], global_batch=gb, gpus=r["gpus"],
                ulysses=r["ulysses"], ring=r["ring"], S=r["S"], ms=r["ms"], global_tokens_per_s=tps,
                vs_data_parallel=tps / dp[0] if dp else None, mem_gib=r.get("mem_gib"))  # fmt: skip
    return rep if rep.rows else None


def ingest(results: Path) -> list[Path]:
    """Write the summaries for every multi-GPU result file in ``results``; returns the files written."""
    docs: dict[tuple[str, str], dict] = {}
    for f in sorted(results.glob("*.json")):
        m = re.match(r"(.+)-(sweep|peers|dpsp)-(\d+)gpu\.json$", f.name)
        if m and not m.group(1).endswith("-versus"):
            doc = json.loads(f.read_text())
            doc["_name"], doc["_world"] = f.name, int(m.group(3))
            docs[m.group(2), m.group(3)] = doc
    written = []
    for (kind, g), doc in docs.items():
        env = doc.get("environment") or {}
        todo = []
        if kind == "sweep":
            todo = [("weak-scaling", weak_scaling(doc)), ("strong-scaling", strong_scaling(doc, docs.get(("peers", g)))),
                    ("zigzag", zigzag(doc))]  # fmt: skip
        elif kind == "peers":
            todo = [("versus-peers", versus_peers(doc))]
        elif kind == "dpsp":
            todo = [("dp-vs-sp", dp_vs_sp(doc))]
        for tag, rep in todo:
            if rep is not None:
                written.append(rep.write(out_dir=results, tag=f"{tag}-{g}gpu", env=env))
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="?", default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    for p in ingest(args.results):
        print(f"ingest: wrote {p}")


if __name__ == "__main__":
    main()
