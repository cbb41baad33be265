"""One tree's run for :mod:`paperclub.ab`, started by path (``python .../ab_worker.py DRIVER [ARGS]``):
it imports nothing of paperclub, so that the tree on ``PYTHONPATH`` (old or new) is the only code
of ours in the process besides the driver.

The driver file defines ``cases(args) -> [(name, make)]``; ``make()`` builds the inputs and returns
``(ours, peer)``, the two callables to time; ``ours()`` returns its outputs (a tensor, a number, or a
sequence of them), which the first call summarises for the comparison between the trees (a
tensor by its sum and the sum of its absolute values). Each case: warm-up, then ``REPS`` timings of
ours and the peer alternating, CUDA events, the median of each. Prints one JSON line."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time


def _time(fn, start, end) -> float:
    """Milliseconds of one call: CUDA events, or the host clock where there is no GPU (a CPU test)."""
    if start is None:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def summary(outputs) -> list[float]:
    """The numbers that stand for ``ours()``'s outputs: per tensor its sum and the sum of its absolute
    values (in float32), per number itself."""
    items = outputs if isinstance(outputs, list | tuple) else [outputs]
    out = []
    for x in items:
        if hasattr(x, "float"):
            out += [x.float().sum().item(), x.float().abs().sum().item()]
        else:
            out.append(float(x))
    return out


def main(argv: list[str]) -> int:
    import torch

    if not argv:
        print("usage: ab_worker.py DRIVER [ARGS]", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("ab_driver", argv[0])
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    reps = getattr(driver, "REPS", 15)
    out = {}
    for name, make in driver.cases(argv[1:]):
        ours, peer = make()
        check = summary(ours())
        for _ in range(3):
            ours()
            peer()
        start = end = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t_ours, t_peer = [], []
        for _ in range(reps):
            t_ours.append(_time(ours, start, end))
            t_peer.append(_time(peer, start, end))
        out[name] = {
            "ours_ms": statistics.median(t_ours),
            "peer_ms": statistics.median(t_peer),
            "check": check,
        }
        print(f"# {name}: ours {out[name]['ours_ms']:.3f} ms, peer {out[name]['peer_ms']:.3f} ms", flush=True)
        del ours, peer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps({"cases": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
