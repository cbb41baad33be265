"""The command line every bench shares (paperclub.bench.bench_parser / parse_bench_args): the common
options, --set parsed into a frozen config's fields with type checks, --only selecting by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from paperclub.bench import apply_settings, bench_parser, parse_bench_args, parse_settings, select


@dataclass(frozen=True)
class Config:
    lazy: bool = True
    tau: float = 8.0
    block: int | None = None
    mode: str = "auto"
    stages: int = 2


def test_common_options_and_defaults():
    ap = bench_parser("x", budget_s=240.0, rounds=5)
    ap.add_argument("--seed", type=int, default=0)  # a bench's own option beside the common ones
    a = parse_bench_args(ap, [])
    assert (a.out, a.budget_s, a.quick, a.only, a.settings, a.tag, a.rounds, a.seed) == (
        None, 240.0, False, (), {}, "", 5, 0,
    )  # fmt: skip
    assert a.budget.seconds == 240.0 and a.budget.elapsed() >= 0
    a = parse_bench_args(
        ap,
        ["--out", "/tmp/x", "--budget-s", "60", "--quick", "--only", "a,b", "--only", "c*", "--set", "lazy=False",
         "--set", "mode=fused", "--tag", "bwd-sweep", "--rounds", "2", "--seed", "3"],
    )  # fmt: skip
    assert a.out == Path("/tmp/x") and a.budget_s == 60 and a.quick and a.only == ("a", "b", "c*")
    assert (
        a.settings == {"lazy": False, "mode": "fused"}
        and a.tag == "bwd-sweep"
        and a.rounds == 2
        and a.seed == 3
    )
    assert parse_bench_args(bench_parser("x"), []).budget.seconds is None  # no budget: no limit


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--budget-s", "-5"], "--budget-s must be a positive"),
        (["--set", "lazy"], "expected NAME=VALUE"),
        (["--set", "=3"], "expected NAME=VALUE"),
        (["--tag", "../x"], "--tag '../x'"),
    ],
)
def test_bad_options_stop_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_bench_args(bench_parser("x"), argv)
    assert message in capsys.readouterr().err


def test_settings_are_literals_or_strings():
    got = parse_settings(["a=1", "b=2.5", "c=True", "d=(64, 2)", "e=fused", "f='x y'", "g=None"])
    assert got == {"a": 1, "b": 2.5, "c": True, "d": (64, 2), "e": "fused", "f": "x y", "g": None}


def test_apply_settings_builds_a_new_frozen_config():
    base = Config()
    new = apply_settings(base, {"lazy": False, "tau": 4, "block": 64, "mode": "fa2"})
    assert new == Config(lazy=False, tau=4, block=64, mode="fa2") and base == Config()
    assert apply_settings(base, {"block": None}).block is None  # an optional field takes None


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"lazzy": False}, "not a field of Config; known: lazy, tau, block, mode, stages"),
        ({"lazy": 1}, "expected a bool"),
        ({"stages": True}, "expected a int"),
        ({"stages": 2.5}, "expected a int"),
        ({"tau": "high"}, "expected a float"),
        ({"stages": None}, "expected a int"),
    ],
)
def test_apply_settings_refuses_unknown_fields_and_wrong_types(settings, message):
    with pytest.raises(ValueError, match=message):
        apply_settings(Config(), settings)
    with pytest.raises(TypeError, match="dataclass instance"):
        apply_settings(Config, {})


def test_select_keeps_order_matches_patterns_and_refuses_typos():
    names = ["fwd S=4k", "fwd S=8k", "bwd S=4k", "decode"]
    assert select(names, ()) == names
    assert select(names, ("bwd*", "fwd S=4k")) == ["fwd S=4k", "bwd S=4k"]
    with pytest.raises(ValueError, match="--only bwdd: no step of that name; known: fwd S=4k"):
        select(names, ("bwdd",), what="step")


def test_a_bench_without_use_for_an_option_refuses_it(capsys):
    ap = bench_parser("x", rounds=None, only=False, settings=False, tag=False)
    a = parse_bench_args(ap, ["--quick"])
    assert a.only == () and a.settings == {} and a.tag == "" and a.rounds is None
    for argv in (["--only", "a"], ["--set", "a=1"], ["--tag", "t"], ["--rounds", "2"]):
        with pytest.raises(SystemExit):
            parse_bench_args(ap, argv)
        assert "unrecognized arguments" in capsys.readouterr().err
