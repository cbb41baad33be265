"""The benchmark's timeline reading (repro.parallelism.bench.call_spans_ms): each call's span covers
its work on every stream, and nothing outside its window."""

from __future__ import annotations

import pytest

from repro.parallelism.bench import call_spans_ms


def test_span_covers_every_stream_and_only_its_own_window():
    events = [
        ("bench:call", False, 0.0, 10.0),
        ("gemm", True, 5.0, 1005.0),  # compute stream
        ("ncclDevKernel_ReduceScatter", True, 1006.0, 1456.0),  # NCCL's stream, after the event's end
        ("bench:call", False, 2000.0, 2010.0),
        ("gemm", True, 2004.0, 3004.0),
        ("Memcpy DtoD", True, 2900.0, 3100.0),  # a copy engine, overlapping the matmul
        ("cudaLaunchKernel", False, 2001.0, 2002.0),  # host events other than the ranges are ignored
    ]
    assert call_spans_ms(events, 2) == pytest.approx([1.451, 1.096])


def test_missing_ranges_or_work_are_errors():
    with pytest.raises(RuntimeError, match="found 1 'bench:call' ranges, expected 2"):
        call_spans_ms([("bench:call", False, 0.0, 1.0), ("k", True, 0.5, 2.0)], 2)
    with pytest.raises(RuntimeError, match="call 1 put no work on the device"):
        call_spans_ms(
            [("bench:call", False, 0.0, 1.0), ("k", True, 0.5, 2.0), ("bench:call", False, 5.0, 6.0)], 2
        )
