"""The shared sweep driver (paperclub.bench.sweep, variants, describe_changes): configs built into
candidates, checked, timed in the same interleaved rounds as the peers, each row against the baseline."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from paperclub.bench import SWEEP_COLUMNS, Candidate, Report, describe_changes, sweep, variants


@dataclass(frozen=True)
class Config:
    tma: bool = False
    stages: int = 2


def test_variants_and_changes():
    cfgs = variants(Config(), {"tma": {"tma": True}, "tma+s3": {"tma": True, "stages": 3}})
    assert list(cfgs) == ["default", "tma", "tma+s3"] and cfgs["tma+s3"] == Config(True, 3)
    assert describe_changes(cfgs["tma+s3"], cfgs["default"]) == "tma=True, stages=3"
    assert describe_changes(Config(), Config()) == ""
    with pytest.raises(ValueError, match="names the base config"):
        variants(Config(), {"default": {}})
    with pytest.raises(ValueError, match="not a field"):
        variants(Config(), {"x": {"tmaa": True}})


def test_sweep_rows_against_the_baseline_interleaved_with_peers():
    order: list[str] = []
    ms = {"default": [4.0, 4.0], "tma": [2.0, 2.0], "cudnn": [1.0, 1.0]}

    def timer(fn, *, warmup, rep):
        name = fn()
        order.append(name)
        return ms[name].pop(0)

    def build(cfg: Config):
        if cfg.stages == 9:
            raise RuntimeError("out of shared memory: 300000 > 232448")
        name = "tma" if cfg.tma else "default"
        return Candidate(fn=lambda: name, check=lambda: None)

    cfgs = variants(Config(), {"tma": {"tma": True}, "s9": {"stages": 9}})
    rows = sweep(cfgs, build, peers={"cudnn": lambda: "cudnn"}, rounds=2, timer=timer)
    assert order == ["default", "tma", "cudnn"] * 2  # one round times every candidate in turn
    by = {r["config"]: r for r in rows}
    assert list(by) == ["default", "tma", "s9", "cudnn"] and set(rows[0]) == set(SWEEP_COLUMNS)
    assert (
        by["default"]["vs_baseline"] == 1.0
        and by["tma"]["vs_baseline"] == 2.0
        and by["cudnn"]["vs_baseline"] == 4.0
    )
    assert by["tma"]["changes"] == "tma=True" and by["cudnn"]["changes"] == ""
    # a config whose build fails is a row with its error, not timed, and does not stop the others
    assert by["s9"]["ms"] is None and by["s9"]["vs_baseline"] is None
    assert by["s9"]["check"].startswith("failed: RuntimeError: out of shared memory")
    report = Report(package="fa4", title="t", columns=["S", *SWEEP_COLUMNS], measure_ceilings=False)
    for r in rows:
        report.add(S=4096, **r)  # the rows fit a Report with the bench's own columns beside
    # a peer as the baseline
    rows = sweep({"a": Config()}, lambda c: (lambda: "a"), peers={"p": lambda: "p"}, baseline="p", rounds=1,
                 timer=lambda fn, warmup, rep: {"a": 2.0, "p": 1.0}[fn()])  # fmt: skip
    assert {r["config"]: r["vs_baseline"] for r in rows} == {"a": 0.5, "p": 1.0}


def test_sweep_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="nothing to time"):
        sweep({}, lambda c: c)
    with pytest.raises(ValueError, match="both a config and a peer"):
        sweep({"a": 1}, lambda c: lambda: None, peers={"a": lambda: None})
    with pytest.raises(ValueError, match="baseline 'z'"):
        sweep({"a": 1}, lambda c: lambda: None, baseline="z")


def test_error_text_is_one_line_and_bounded():
    from paperclub.bench import error_text

    exc = RuntimeError("compile failed:\n  line 1\n\tline 2  " + "x" * 1000)
    text = error_text(exc, limit=80)
    assert "\n" not in text and "\t" not in text
    assert text.startswith("RuntimeError: compile failed: line 1 line 2 x")
    assert len(text) == 80 and text.endswith("...")
    assert error_text(ValueError()) == "ValueError"
    assert error_text(KeyError("k"), limit=400) == "KeyError: 'k'"
