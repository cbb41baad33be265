"""dflash/tau-grows-beats-ar, read off the committed benchmark results (``results/<gpu>.json``).

tau is a property of trained models, which only the bench trains (on the GPU, in the call). This
test checks the measured rows: at temperature 0, the DFlash drafter's tau at its best block size
exceeds its tau at block size 4 (grows with the block, up to a point), and at every block size both
drafters were run, DFlash's tau exceeds the autoregressive drafter's. Skipped while no GPU result
has been committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _rows():
    files = sorted(p for p in RESULTS.glob("*.json") if not p.name.startswith("claims"))
    docs = [json.loads(p.read_text()) for p in files]
    return [
        (d.get("device", ""), d["rows"])
        for d in docs
        if d.get("package") == "dflash" and d.get("device_count")
    ]


# Not fully reproduced. The quick H100 run (2026-11-25 00:21, drafters trained for seconds) had
# DFlash's tau below the AR drafter's at every block. The full run (2026-11-25 09:19, 35-41 s of
# training each) has it growing (3.21 / 4.24 / 4.52 / 4.81 at blocks 4 / 8 / 12 / 16) and above
# the AR drafter's at 4 and 8 (2.86, 4.02), but equal at 16 (4.807 both: 375 tokens in 78 rounds
# each), so "above at every block" still fails. strict: once a committed result reproduces the
# claim, this marker must go.
@pytest.mark.xfail(
    strict=True,
    reason="full H100 run: DFlash tau above the AR drafter's at blocks 4 and 8, equal at 16 (4.807 both)",
)
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
