"""dflash/tau-grows-beats-ar and dflash/beats-ar-equal-cost, read off the committed benchmark results
(``results/<gpu>.json``).

tau is a property of trained models, which only the bench trains (on the GPU, in the call). These
tests check the measured rows. ``test_measured_tau`` (the stronger, block-for-block statement): at
temperature 0, the DFlash drafter's tau at its best block size exceeds its tau at block size 4
(grows with the block, up to a point), and at every block size both drafters were run, DFlash's tau
exceeds the autoregressive drafter's. ``test_beats_ar_equal_cost`` (the claim as the paper states
it): at every DFlash block size, DFlash's tau exceeds the AR drafter's at equal or lower drafting
cost per round (``bench.equal_cost_pairs``), at temperature 0 and 1. Skipped while no GPU result
has been committed (the second also while the committed one predates the ``draft_ms`` column).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro.dflash.bench import equal_cost_pairs

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _gpu_docs():
    """The committed benchmark results of a GPU run (the claims records and CPU runs left out)."""
    files = sorted(p for p in RESULTS.glob("*.json") if not p.name.startswith(("claims", "gpu-checks")))
    docs = [json.loads(p.read_text()) for p in files]
    return [
        d
        for d in docs
        if d.get("package") == "dflash" and d.get("device_count") and "CPU" not in str(d.get("device", ""))
    ]


def _rows():
    files = sorted(p for p in RESULTS.glob("*.json") if not p.name.startswith("claims"))
    docs = [json.loads(p.read_text()) for p in files]
    return [
        (d.get("device", ""), d["rows"])
        for d in docs
        if d.get("package") == "dflash" and d.get("device_count")
    ]


# History: the quick H100 run (2026-11-25 00:21, drafters trained for seconds) had DFlash's tau
# below the AR drafter's at every block; the first full run (09:19, 35-41 s of training each) was
# above at blocks 4 and 8 but equal at 16 (4.807 both), and this test was a strict xfail. The run
# of 2026-11-25 13:50 (78 s of drafter training, 63 s for the AR drafter) reproduces it at
# temperature 0: 3.15 / 4.23 / 4.44 against 2.74 / 3.76 / 4.16 at blocks 4 / 8 / 16. At
# temperature 1 the AR drafter's tau is the higher at equal block size (the page says so); the
# issue's claim is at equal drafting cost, which test_beats_ar_equal_cost checks at both.
@pytest.mark.claim("dflash/tau-grows-beats-ar", section="Experiments")
def test_measured_tau():
    found = [(dev, rows) for dev, rows in _rows() if "CPU" not in str(dev)]
    if not found:
        pytest.skip("no GPU benchmark result committed yet (python -m repro.dflash.bench)")
    for dev, rows in found:
        tau = {
            (r["impl"], r["block_size"]): r["tau"]
            for r in rows
            if r.get("temperature") == 0.0 and r.get("tau") is not None and r.get("check") == "ok"
        }
        dflash = {b: t for (impl, b), t in tau.items() if impl == "dflash"}
        ar = {b: t for (impl, b), t in tau.items() if impl == "ar"}
        assert dflash and ar, f"{dev}: no checked dflash/ar rows at temperature 0"
        assert 4 in dflash and max(dflash.values()) > dflash[4], (
            f"{dev}: tau does not grow from block 4: {dflash}"
        )
        for b in sorted(set(dflash) & set(ar)):
            assert dflash[b] > ar[b], f"{dev}: block {b}: DFlash tau {dflash[b]} <= AR tau {ar[b]}"


@pytest.mark.claim("dflash/beats-ar-equal-cost", section="Experiments")
def test_beats_ar_equal_cost():
    """At every DFlash block size b, temperature 0 and 1, in each mode with drafting costs: DFlash's
    tau exceeds the AR drafter's at the largest AR block whose drafting time per round is at most
    DFlash's (AR block 2 when none is that cheap, which then drafts longer than DFlash: a comparison
    that favours the AR drafter)."""
    docs = _gpu_docs()
    if not docs:
        pytest.skip("no GPU benchmark result committed yet (python -m repro.dflash.bench)")
    for doc in docs:
        dev, rows = doc.get("device"), doc["rows"]
        if "draft_ms" not in doc.get("columns", []):
            pytest.skip(
                f"{dev}: the committed result ({doc.get('date')}) predates the drafting-cost column "
                "draft_ms and the AR rows at blocks 2 and 3; rerun the bench on the GPU"
            )
        for temperature in (0.0, 1.0):
            per_mode = {m: equal_cost_pairs(rows, m, temperature) for m in ("eager", "graphs")}
            assert per_mode["eager"], (
                f"{dev}: no checked DFlash rows with tau and draft_ms at T={temperature}"
            )
            for mode, pairs in per_mode.items():
                for p in pairs:
                    where = f"{dev}, {mode}, T={temperature}, DFlash block {p['block_size']}"
                    assert p["ar_block"] is not None and p["ar_tau"] is not None, (
                        f"{where}: no checked AR row at or under its drafting cost {p['draft_ms']} ms, nor at block 2"
                    )
                    assert p["tau"] > p["ar_tau"], (
                        f"{where} ({p['draft_ms']} ms): DFlash tau {p['tau']} <= AR tau {p['ar_tau']} at "
                        f"block {p['ar_block']} ({p['ar_draft_ms']} ms)"
                    )
