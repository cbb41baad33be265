"""The GPU correctness check's tolerance (nanoparallel.cuda.check), on the CPU: a sum's rounding error is
measured against the operands' magnitudes, so a correctly rounded ring whose ranks cancel passes, and
a result missing a rank's contribution still fails."""

from __future__ import annotations

import torch

from nanoparallel.cuda.check import _close, draw, magnitude, reduce_ref


def _ring_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """What a ring does to one element: add the next rank's value, round to the dtype, pass on."""
    acc = xs[0]
    for x in xs[1:]:
        acc = (acc.float() + x.float()).to(xs[0].dtype)
    return acc


def test_cancelling_bf16_ring_average_passes_against_the_operands_magnitude():
    # 1.5 + 2^-8 rounds back to 1.5 in bf16 (a tie, to even), then the ranks cancel: the ring gives
    # 0 where the exact mean is 2^-10, 100% of the result but 0.1% of the operands' mean magnitude
    xs = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.5, 2.0**-8, -1.5, 0.0)]
    out = _ring_sum(xs) / 4
    ref = reduce_ref(xs, "avg")
    assert out.item() == 0.0 and ref.item() == 2.0**-10
    assert _close(out, ref, torch.bfloat16, 4) is not None  # against the result: fails
    assert _close(out, ref, torch.bfloat16, 4, magnitude(xs, "avg")) is None


def test_a_missing_rank_fails_against_the_operands_magnitude():
    xs = [draw(4099, torch.bfloat16, seed) for seed in range(4)]
    for op in ("sum", "avg"):
        wrong = reduce_ref(xs[:3], "sum") / (4 if op == "avg" else 1)  # rank 3's values left out
        problem = _close(wrong, reduce_ref(xs, op), torch.bfloat16, 4, magnitude(xs, op))
        assert problem is not None and "relative error" in problem, op
        # and a correct ring passes at the ring's tolerance
        ring = _ring_sum(xs).double() / (4 if op == "avg" else 1)
        assert _close(ring, reduce_ref(xs, op), torch.bfloat16, 4, magnitude(xs, op)) is None, op


def test_max_and_min_are_measured_against_the_result():
    xs = [draw(31, torch.float32, seed) for seed in range(3)]
    for op in ("max", "min"):
        assert torch.equal(magnitude(xs, op), reduce_ref(xs, op).abs())
        assert (
            _close(reduce_ref(xs, op).float(), reduce_ref(xs, op), torch.float32, 1, magnitude(xs, op))
            is None
        )
