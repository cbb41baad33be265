"""paperclub.ab on the CPU: one driver run against two toy trees, alternating, and the summary rows
(new_vs_old, the peer's drift, the check's difference); bad arguments are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paperclub import ROOT
from paperclub.ab import summarise

DRIVER = """
import time
from toypkg import work, SCALE

REPS = 3

def cases(args):
    def make():
        return (lambda: (work(), [SCALE, 2.0])[1]), (lambda: time.sleep(0.001))
    return [("one", make)]
"""


def _tree(path, sleep_s, scale):
    (path / "toypkg").mkdir(parents=True)
    (path / "toypkg" / "__init__.py").write_text(
        f"import time\nSCALE = {scale}\ndef work():\n    time.sleep({sleep_s})\n"
    )
    return path


def test_ab_runs_both_trees_and_summarises(tmp_path):
    old = _tree(tmp_path / "old", 0.002, 1.0)
    new = _tree(tmp_path / "new", 0.02, 1.5)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "site"))
    r = subprocess.run(
        [sys.executable, "-m", "paperclub.ab", "--driver", str(driver), "--tree", f"old={old}", "--tree",
         f"new={new}", "--rounds", "2", "--package", "fa4", "--out", str(tmp_path / "res"), "--tag", "t"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("[ab] round") == 4  # two rounds of each tree
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "res").glob("*-t.json")]
    (row,) = doc["rows"]
    assert row["case"] == "one" and row["new_vs_old"] > 3  # 20 ms of work against 2 ms
    assert 0.3 < row["peer_drift"] < 3
    assert row["check_rel"] == pytest.approx(0.5 / 1.5) and row["check_noise"] == 0.0
    # a tree that is not a directory, or one tree only: refused before anything runs
    bad = subprocess.run(
        [sys.executable, "-m", "paperclub.ab", "--driver", str(driver), "--tree", "old=/nonexistent",
         "--tree", f"new={new}", "--package", "fa4", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--tree 'old=/nonexistent'" in bad.stderr
    one = subprocess.run(
        [sys.executable, "-m", "paperclub.ab", "--driver", str(driver), "--tree", f"new={new}",
         "--package", "fa4", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert one.returncode == 2 and "expected two trees" in one.stderr


def test_summarise_keeps_only_cases_every_run_has():
    def run(ms):
        return {
            "cases": {"a": {"ours_ms": ms, "peer_ms": 1.0, "check": [1.0]}, "b": {"ours_ms": 1, "peer_ms": 1}}
        }

    runs = {"old": [run(2.0), run(4.0)], "new": [run(3.0)]}
    runs["new"][0]["cases"].pop("b")
    (row,) = summarise(runs, "old", "new")
    assert (
        row["case"] == "a" and row["old_ms"] == 3.0 and row["new_vs_old"] == 1.0 and row["check_rel"] == 0.0
    )
