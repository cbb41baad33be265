"""The shared timer: checks gate timing, rounds interleave candidates, median and range are kept."""

from __future__ import annotations

import pytest

from paperclub.bench import Candidate, measure


def _fake_timer(log: list[str], times: dict[str, list[float]]):
    def timer(fn, *, warmup, rep):
        name = fn()
        log.append(name)
        return times[name].pop(0)

    return timer


def test_rounds_interleave_and_keep_median_and_range():
    log: list[str] = []
    times = {"a": [3.0, 1.0, 2.0], "b": [10.0, 30.0, 20.0]}
    res = measure({"a": lambda: "a", "b": Candidate(fn=lambda: "b")}, rounds=3, timer=_fake_timer(log, times))
    assert log == ["a", "b", "a", "b", "a", "b"]  # candidates in turn, not all of a then all of b
    assert (res["a"].median_ms, res["a"].min_ms, res["a"].max_ms) == (2.0, 1.0, 3.0)
    assert (res["b"].median_ms, res["b"].min_ms, res["b"].max_ms) == (20.0, 10.0, 30.0)
    assert res["a"].row() == {"ms": 2.0, "ms_min": 1.0, "ms_max": 3.0, "check": "ok"}


def test_failed_check_is_not_timed():
    log: list[str] = []

    def wrong():
        raise AssertionError("output: relative error 3.0e-01 exceeds 1.0e-02")

    res = measure(
        {
            "bad": Candidate(fn=lambda: "bad", check=wrong),
            "good": Candidate(fn=lambda: "good", check=lambda: None),
        },
        rounds=2,
        timer=_fake_timer(log, {"good": [1.0, 1.0]}),
    )
    assert "bad" not in log
    assert not res["bad"].ok and res["bad"].median_ms is None
    assert "3.0e-01" in res["bad"].error and res["bad"].row()["check"].startswith("failed: AssertionError")
    assert res["good"].ok and res["good"].median_ms == 1.0


def test_error_while_timing_drops_the_candidate():
    def timer(fn, *, warmup, rep):
        return fn()

    def boom():
        raise RuntimeError("out of memory")

    res = measure({"x": boom, "y": lambda: 2.0}, rounds=2, timer=timer)
    assert not res["x"].ok and "while timing" in res["x"].error and res["x"].median_ms is None
    assert res["y"].median_ms == 2.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="rounds"):
        measure({"a": lambda: 0}, rounds=0)
    with pytest.raises(TypeError, match="candidate 'a'"):
        measure({"a": 3})


def test_report_stores_the_ceilings_its_rows_used(tmp_path, monkeypatch):
    """A bench that computes a percentage of the machine's ceiling before its rows hands that
    measurement to the Report, which stores it as given (not a second probe taken at write time,
    which would not be the rows' denominator); without it the Report measures when it writes.
    Fails if write() ignores ceilings_used or measures again."""
    import json

    import paperclub.bench as pb

    probes = []
    monkeypatch.setattr(pb, "ceilings", lambda: probes.append(1) or {"matmul_bf16_tflops": 664.0})
    used = {"matmul_bf16_tflops": 773.0, "copy_tbps": 3.0}
    report = pb.Report(package="kda", title="t", columns=["tflops"], ceilings_used=used)
    report.add(tflops=400.0)
    doc = json.loads(report.write(out_dir=tmp_path, env={"device": "test device"}).read_text())
    assert doc["ceilings"] == used and probes == []
    plain = pb.Report(package="kda", title="t", columns=["tflops"])
    doc = json.loads(plain.write(out_dir=tmp_path, tag="x", env={"device": "test device"}).read_text())
    assert doc["ceilings"] == {"matmul_bf16_tflops": 664.0} and probes == [1]


def test_report_writes_only_the_plots_that_draw_something(tmp_path):
    """A run cut to some sections (e.g. NSA's train rows without decode) writes no plot whose ``where``
    selects no row with numbers, so the site and ``paperclub check`` find none empty. Fails if an
    empty plot is written or a drawing one dropped."""
    import json

    import paperclub.bench as pb

    report = pb.Report(package="nsa", title="t", columns=["section", "T", "ms"], measure_ceilings=False)
    report.plot(title="train", x="T", y="ms", series="section", where={"section": "train"})
    report.plot(title="decode", x="T", y="ms", series="section", where={"section": "decode"})
    report.add(section="train", T=8192, ms=1.5)
    report.add(section="decode", T=8192, ms=None)  # decode measured nothing: no number to draw
    doc = json.loads(report.write(out_dir=tmp_path, env={"device": "test device"}).read_text())
    assert [p["title"] for p in doc["plots"]] == ["train"]
