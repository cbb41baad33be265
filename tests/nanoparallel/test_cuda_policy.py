"""The GPU backend's choice for algorithm="auto", and its argument checks that need no GPU.

The thresholds come from the 2 x H200 sweep; these tests pin the rule (which algorithm at which
size and rank count) so a change to it is deliberate. The backend is built without __init__ (that
needs GPUs); only the pure methods are exercised.
"""

from __future__ import annotations

import pytest

from nanoparallel.cuda import (
    ALGORITHMS,
    COPY_ENGINE_MIN_BYTES,
    ONE_SHOT_MAX_BYTES,
    PUSH_ALL_REDUCE_MIN_BYTES,
    PUSH_ALL_TO_ALL_MIN_BYTES,
    CudaPeerBackend,
)


def backend(world_size: int) -> CudaPeerBackend:
    be = object.__new__(CudaPeerBackend)
    be.world_size = world_size
    return be


@pytest.mark.parametrize(
    "nbytes", [0, 8, 64 << 10, PUSH_ALL_REDUCE_MIN_BYTES - 1, PUSH_ALL_REDUCE_MIN_BYTES, 1 << 30]
)
def test_auto_all_reduce_two_gpus(nbytes):
    got = backend(2)._algorithm("all_reduce", "auto", nbytes)
    assert got == ("one_shot_push" if nbytes >= PUSH_ALL_REDUCE_MIN_BYTES else "one_shot")


@pytest.mark.parametrize("world", [3, 4, 8])
def test_auto_all_reduce_more_gpus(world):
    be = backend(world)
    assert be._algorithm("all_reduce", "auto", ONE_SHOT_MAX_BYTES) == "one_shot"
    assert be._algorithm("all_reduce", "auto", ONE_SHOT_MAX_BYTES + 1) == "two_shot"


def test_auto_other_collectives():
    be = backend(2)
    for coll in ("all_gather", "broadcast"):
        assert be._algorithm(coll, "auto", COPY_ENGINE_MIN_BYTES - 1) == "direct"
        assert be._algorithm(coll, "auto", COPY_ENGINE_MIN_BYTES) == "copy_engine"
    assert be._algorithm("all_to_all", "auto", PUSH_ALL_TO_ALL_MIN_BYTES - 1) == "direct"
    assert be._algorithm("all_to_all", "auto", PUSH_ALL_TO_ALL_MIN_BYTES) == "push"
    assert be._algorithm("reduce_scatter", "auto", 1 << 30) == "direct"


def test_every_auto_choice_is_a_listed_algorithm():
    for world in (2, 3, 8):
        for coll in ALGORITHMS:
            for nbytes in (8, 1 << 20, 1 << 30):
                assert backend(world)._algorithm(coll, "auto", nbytes) in ALGORITHMS[coll]


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match=r"all_reduce: algorithm 'tree' is not one of .*one_shot.*auto"):
        backend(2)._algorithm("all_reduce", "tree", 8)
