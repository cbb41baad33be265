"""The benchmark's logic on the CPU at toy sizes: every shape is checked before it is timed, a
failing check keeps its row out of the timings, and the report has both gate regimes and varlen;
the lab's precision comparison the same way."""

from __future__ import annotations

import json

import pytest

from repro.kda import bench
from repro.kda.lab import tuning


def test_bench_checks_before_timing(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "H", 1)
    monkeypatch.setattr(bench, "K", 16)
    monkeypatch.setattr(bench, "V", 16)
    monkeypatch.setattr(bench, "TOKENS", 64)
    monkeypatch.setattr(bench, "ALL_T", [64])
    monkeypatch.setattr(bench, "ROUNDS", 1)
    monkeypatch.setattr(
        bench,
        "varlen_offsets",
        lambda total, device=None: __import__("torch").tensor([0, 20, 64], dtype=__import__("torch").int32),
    )
    real = bench.impls

    def impls(config=None, cu_seqlens=None):
        out = {n: f for n, f in real(config, cu_seqlens).items() if n == "ours"}
        # a candidate whose output is wrong: its check must fail and it must not be timed
        out["fla_kda"] = lambda q, k, v, g, beta: out["ours"](q, k, v, g, beta) * 1.5
        return out

    monkeypatch.setattr(bench, "impls", impls)
    bench.run(quick=False, out_dir=tmp_path)
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = doc["rows"]
    shapes = {(r["gates"], r["T"]) for r in rows}
    assert shapes == {("std", 64), ("mild", 64), ("varlen", 64)}
    ours = [r for r in rows if r["impl"] == "ours"]
    assert ours and all(r["check"] == "ok" and r["ms"] is not None for r in ours)
    wrong = [r for r in rows if r["impl"] == "fla_kda"]
    assert wrong and all(r["ms"] is None and r["check"].startswith("failed: AssertionError") for r in wrong)
    assert "fla_kda at std T=64" in doc["notes"]
    # --only varlen: the packed batch alone, in its own file; an unknown part is named
    for f in tmp_path.glob("*.json"):
        f.unlink()
    bench.main(["--only", "varlen", "--out", str(tmp_path), "--rounds", "1"])
    (path,) = tmp_path.glob("*.json")
    assert "gates-varlen" in path.name
    assert {r["gates"] for r in json.loads(path.read_text())["rows"]} == {"varlen"}
    with pytest.raises(SystemExit, match="--only slow: no part of that name"):
        bench.main(["--only", "slow", "--out", str(tmp_path)])


def test_precision_rows_checked_and_labelled(tmp_path, monkeypatch):
    """lab/tuning.py precision at a toy size: one row per dtype and product precision, each checked
    before timing; a wrong peer is reported as failed, not timed."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "H", 1)
    monkeypatch.setattr(bench, "K", 16)
    monkeypatch.setattr(bench, "V", 16)
    monkeypatch.setattr(tuning, "PRECISION_SHAPES", ((1, 64),))
    real = bench.impls

    def impls(config=None, cu_seqlens=None):
        out = {n: f for n, f in real(config, cu_seqlens).items() if n == "ours"}
        out["fla_kda"] = lambda q, k, v, g, beta: out["ours"](q, k, v, g, beta) * 1.5
        return out

    monkeypatch.setattr(bench, "impls", impls)
    tuning.precision(tmp_path, rounds=1)
    rows = json.loads(next(tmp_path.glob("*precision.json")).read_text())["rows"]
    ours = {(r["dtype"], r["prec"]) for r in rows if r["impl"] == "ours" and r["check"] == "ok"}
    assert ours == {(d, p) for d in ("float16", "bfloat16") for p in tuning.DOT_PRECISION_CHOICES}
    assert all(r["err_max"] is not None and r["ms"] is not None for r in rows if r["impl"] == "ours")
    wrong = [r for r in rows if r["impl"] == "fla_kda"]
    assert len(wrong) == 2 and all(r["check"].startswith("failed") and r["ms"] is None for r in wrong)


def test_large_head_and_dplr_parts_check_before_timing(tmp_path, monkeypatch):
    """--only d256,dplr at toy sizes on the CPU: rows for ours in the head-size part (its size patched
    small: the logic, not the size) and in the DPLR part, each checked before it is timed, written
    under their tag."""
    import torch

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "H", 1)
    monkeypatch.setattr(bench, "K", 16)
    monkeypatch.setattr(bench, "V", 16)
    monkeypatch.setattr(bench, "TOKENS", 64)
    monkeypatch.setattr(bench, "LARGE_HEADS", (24,))  # padded to 32: the logic, not the size
    monkeypatch.setattr(bench, "LARGE_HEAD_T", (64,))
    monkeypatch.setattr(bench, "DPLR_T", (64,))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    bench.main(["--only", "d256,dplr", "--out", str(tmp_path), "--rounds", "1"])
    (path,) = tmp_path.glob("*.json")
    assert "gates-d256-dplr" in path.name
    rows = json.loads(path.read_text())["rows"]
    assert {(r["gates"], r["D"]) for r in rows} == {("d24", 24), ("dplr", 16)}
    assert all(r["impl"] == "ours" and r["check"] == "ok" and r["ms"] is not None for r in rows)


def test_tune_at_another_head_size(monkeypatch):
    """lab/tuning.py tune --head-size: the defaults and a change timed at K = V = the given size (on the
    CPU at a toy size), and the rows say which size; a change that does not build is left out."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "H", 1)
    rows = tuning.tune(
        B=1, T=64, rounds=1, changes={"wy_warps": {"wy_warps": 2}, "bad": {"wy_bk": 3}}, head_size=32
    )
    assert [r["change"] for r in rows] == ["defaults (K=V=32)", "wy_warps=2 (K=V=32)"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)


def test_tune_times_a_peer_in_the_same_rounds(monkeypatch):
    """lab/tuning.py tune --peer: the peer gets its own row and every row its speed against it (here a
    stand-in peer, our own chunk_kda under another name, on the CPU at a toy size)."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "H", 1)
    real_impls = bench.impls
    monkeypatch.setattr(
        bench, "impls", lambda config=None: {**real_impls(config), "stand_in": real_impls()["ours"]}
    )
    rows = tuning.tune(B=1, T=64, rounds=1, changes={}, head_size=32, peer="stand_in", check=False)
    assert [r["change"] for r in rows] == ["defaults (K=V=32)", "peer stand_in (K=V=32)"]
    assert all(r["fwd_vs_peer"] > 0 and r["fwd_bwd_vs_peer"] > 0 for r in rows)
