"""A compile driver for tests/test_bench_lab.py (run by paperclub.lab.offline in a process without the
interpreter): imports each case's module from its folder and compiles its ``scale_kernel``."""

from __future__ import annotations

import importlib
import sys

from paperclub.lab import compile_sm90, report_or_error


def compile_files(cases: list[dict]) -> list[dict]:
    rows = []
    for case in cases:
        sys.path.insert(0, case["folder"])
        mod = importlib.import_module(case["module"])
        rows.append(
            report_or_error(
                lambda m=mod, case=case: compile_sm90(
                    m.scale_kernel,
                    constexprs={"BLOCK": case["block"]},
                    types={"X": "*fp32", "Y": "*fp32"},
                    divisible=["X", "Y"],
                ),  # fmt: skip
                module=case["module"],
                block=case["block"],
            )
        )
    return rows
