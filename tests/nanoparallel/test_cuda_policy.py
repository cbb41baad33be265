"""The GPU backend's choice for algorithm="auto", and its argument checks that need no GPU.

The thresholds come from the 2 x H200 sweep (and, from three GPUs on, the 4 x H100 one); these tests pin the rule (which algorithm at which
size and rank count) so a change to it is deliberate. The backend is built without __init__ (that
needs GPUs); only the pure methods are exercised.
"""

from __future__ import annotations

import pytest
import torch

from nanoparallel.cuda import (
    ALGORITHMS,
    AUTO_ALL_REDUCE_STEPS,
    COPY_ENGINE_ALL_TO_ALL_MIN_BYTES,
    COPY_ENGINE_MIN_BYTES,
    ONE_SHOT_MAX_BYTES,
    PIPELINE_STEPS,
    PIPELINED_ALL_REDUCE_MIN_BYTES,
    PIPELINED_ALL_TO_ALL_MIN_BYTES,
    PIPELINED_REDUCE_SCATTER_MIN_BYTES,
    PUSH_ALL_TO_ALL_MIN_BYTES,
    RING_ALL_REDUCE_MIN_BYTES,
    CudaPeerBackend,
    SplitCache,
    check_splits,
    copy_engine_pieces,
    pick,
    pipeline_steps,
)


def backend(world_size: int) -> CudaPeerBackend:
    be = object.__new__(CudaPeerBackend)
    be.world_size = world_size
    be.pipeline_steps = None
    return be


@pytest.mark.parametrize(
    "nbytes,expected",
    [
        (0, "one_shot"),
        (8, "one_shot"),
        (64 << 10, "one_shot"),  # small messages: one barrier, bound by host time
        (4 << 20, "one_shot"),
        (PIPELINED_ALL_REDUCE_MIN_BYTES - 1, "one_shot"),
        (PIPELINED_ALL_REDUCE_MIN_BYTES, "one_shot_pipelined"),
        (64 << 20, "one_shot_pipelined"),  # 1.20x NCCL's busbw on 2 x H200
        (1 << 30, "one_shot_pipelined"),  # 0.96x at 4 steps, 1.08x at 16
    ],
)
def test_auto_all_reduce_two_gpus(nbytes, expected):
    assert backend(2)._algorithm("all_reduce", "auto", nbytes) == expected


@pytest.mark.parametrize("world", [3, 4, 8])
def test_auto_all_reduce_more_gpus(world):
    # measured on 4 x H100: two_shot up to 16 MiB, the ring 0.80-0.82x NCCL's busbw from 64 MiB
    be = backend(world)
    assert be._algorithm("all_reduce", "auto", ONE_SHOT_MAX_BYTES) == "one_shot"
    assert be._algorithm("all_reduce", "auto", ONE_SHOT_MAX_BYTES + 1) == "two_shot"
    assert be._algorithm("all_reduce", "auto", RING_ALL_REDUCE_MIN_BYTES - 1) == "two_shot"
    assert be._algorithm("all_reduce", "auto", RING_ALL_REDUCE_MIN_BYTES) == "ring"
    assert be._algorithm("all_reduce", "auto", 1 << 30) == "ring"


@pytest.mark.parametrize("world", [3, 4, 8])
def test_auto_all_to_all_more_gpus_keeps_the_pipelined_push(world):
    # measured on 4 x H100: the copy engine (the 2-GPU choice from 256 MiB) was slower there
    be = backend(world)
    assert be._algorithm("all_to_all", "auto", PUSH_ALL_TO_ALL_MIN_BYTES) == "push"
    for nbytes in (PIPELINED_ALL_TO_ALL_MIN_BYTES, COPY_ENGINE_ALL_TO_ALL_MIN_BYTES, 1 << 30):
        assert be._algorithm("all_to_all", "auto", nbytes) == "push_pipelined"


def test_auto_other_collectives():
    be = backend(2)
    for coll in ("all_gather", "broadcast"):
        assert be._algorithm(coll, "auto", COPY_ENGINE_MIN_BYTES - 1) == "direct"
        assert be._algorithm(coll, "auto", COPY_ENGINE_MIN_BYTES) == "copy_engine"


def test_auto_reduce_scatter_takes_pipelined_from_its_measured_bound():
    # measured on 2 x H200: pipelined beats NCCL from 64 MiB, direct is the faster one at 8 B
    be = backend(2)
    assert "pipelined" in ALGORITHMS["reduce_scatter"]
    for nbytes in (8, 64 << 10, PIPELINED_REDUCE_SCATTER_MIN_BYTES - 1):
        assert be._algorithm("reduce_scatter", "auto", nbytes) == "direct"
    for nbytes in (PIPELINED_REDUCE_SCATTER_MIN_BYTES, 1 << 30):
        assert be._algorithm("reduce_scatter", "auto", nbytes) == "pipelined"
    assert be._algorithm("reduce_scatter", "direct", 1 << 30) == "direct"
    assert be._algorithm("reduce_scatter", "pipelined", 1 << 30) == "pipelined"
    assert be._pipeline_steps("reduce_scatter", 64 << 20) == PIPELINE_STEPS
    be.pipeline_steps = 3
    assert be._pipeline_steps("reduce_scatter", 1 << 30) == 3


@pytest.mark.parametrize(
    "nbytes,expected",
    [
        (8, "direct"),
        (64 << 10, "direct"),
        (PUSH_ALL_TO_ALL_MIN_BYTES - 1, "direct"),
        (PUSH_ALL_TO_ALL_MIN_BYTES, "push"),
        (PIPELINED_ALL_TO_ALL_MIN_BYTES - 1, "push"),
        (PIPELINED_ALL_TO_ALL_MIN_BYTES, "push_pipelined"),  # 1.05x NCCL at 64 MiB
        (COPY_ENGINE_ALL_TO_ALL_MIN_BYTES - 1, "push_pipelined"),
        (COPY_ENGINE_ALL_TO_ALL_MIN_BYTES, "copy_engine"),  # 1.06x at 256 MiB and 1 GiB
        (1 << 30, "copy_engine"),
    ],
)
def test_auto_all_to_all(nbytes, expected):
    assert backend(2)._algorithm("all_to_all", "auto", nbytes) == expected


def test_every_auto_choice_is_a_listed_algorithm():
    for world in (2, 3, 8):
        for coll in ALGORITHMS:
            for nbytes in (8, 1 << 20, 1 << 30):
                assert backend(world)._algorithm(coll, "auto", nbytes) in ALGORITHMS[coll]


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match=r"all_reduce: algorithm 'tree' is not one of .*one_shot.*auto"):
        backend(2)._algorithm("all_reduce", "tree", 8)


def test_auto_tables_pick_the_last_bound_reached():
    table = ((0, "a"), (100, "b"), (1000, "c"))
    assert [pick(table, n) for n in (0, 99, 100, 999, 1000, 1 << 40)] == ["a", "a", "b", "b", "c", "c"]
    assert [pick(((0, 4), (10, 16)), n) for n in (9, 10)] == [4, 16]  # any kind of choice


def test_pipeline_steps_by_size_for_all_reduce_only():
    be = backend(2)
    # all-reduce: 4 steps up to 256 MiB (4 and 8 tied at 64 MiB), 16 from there (best at 256 MiB, 1 GiB)
    assert be._pipeline_steps("all_reduce", 64 << 20) == PIPELINE_STEPS == 4
    assert be._pipeline_steps("all_reduce", (256 << 20) - 1) == 4
    assert be._pipeline_steps("all_reduce", 256 << 20) == 16
    assert be._pipeline_steps("all_reduce", 1 << 30) == 16
    assert AUTO_ALL_REDUCE_STEPS[0] == (0, PIPELINE_STEPS)
    # all-to-all: one count whatever the size, since ranks of an uneven all-to-all differ in size
    # and must all cut their calls into the same number of barriers
    assert {be._pipeline_steps("all_to_all", n) for n in (8, 64 << 20, 1 << 30)} == {PIPELINE_STEPS}
    be.pipeline_steps = 3  # a measurement's knob wins over the table, for both
    assert be._pipeline_steps("all_reduce", 1 << 30) == be._pipeline_steps("all_to_all", 8) == 3


@pytest.mark.parametrize("chunk,steps", [(16, 4), (64, 3), (1000, 4), (2048, 1), (4096, 8), (100, 100)])
def test_pipeline_steps_cover_the_range(chunk, steps):
    sub, got = pipeline_steps(chunk, steps, 16)
    assert sub % 16 == 0 and 1 <= got <= steps
    assert got * sub >= chunk and (got - 1) * sub < chunk, "a step is empty or elements are left over"


@pytest.mark.parametrize("pieces", [1, 3, 4, 7])
def test_copy_engine_pieces_tile_every_segment(pieces):
    splits = [0, 1, 63, 64, 65, 1000, 4097]
    covered = {p: [] for p in range(len(splits))}
    for c in range(pieces):
        for p, start, end in copy_engine_pieces(splits, 0, c, pieces):
            assert 0 <= start < end <= splits[p] and start % 64 == 0
            covered[p].append((start, end))
    for p, ranges in covered.items():
        pos = 0
        for start, end in ranges:  # in piece order, without gaps or overlaps
            assert start == pos
            pos = end
        assert pos == splits[p], f"segment {p}: pieces cover {pos} of {splits[p]} elements"


def test_split_cache_validates_once_and_keys_by_value():
    cache = SplitCache(3, torch.device("cpu"), max_entries=4)
    a = cache.plan(6, 9, 2, [1, 2, 3], [3, 3, 3])
    assert a.input_splits == (2, 4, 6) and a.output_splits == (6, 6, 6)  # rows x 2 elements
    assert a.input_offsets == (0, 2, 6) and a.output_offsets == (0, 6, 12) and a.largest == 6
    assert a.table.tolist() == [2, 4, 6, 6, 6, 6]
    assert cache.plan(6, 9, 2, (1, 2, 3), [3, 3, 3]) is a and cache.misses == 1  # a tuple hits too
    even = cache.plan(6, 6, 1, None, None)
    assert even.input_splits == (2, 2, 2) and cache.plan(6, 6, 1, None, None) is even
    splits = [1, 2, 3]
    b = cache.plan(6, 6, 1, splits, None)
    splits[0] = 5  # the caller reuses its list: the key was taken by value
    assert cache.plan(6, 6, 1, [1, 2, 3], None) is b
    with pytest.raises(ValueError, match="sums to 10 but the tensor has 6 rows"):
        cache.plan(6, 6, 1, splits, None)
    for k in range(5):  # past max_entries the cache starts over instead of growing
        cache.plan(3 * k + 3, 3, 1, None, None)
    assert len(cache._plans) <= 4
    uncached = cache.plan(6, 9, 2, [1, 2, 3], [3, 3, 3], cache=False)
    assert uncached.table is None and uncached.input_splits == a.input_splits


@pytest.mark.parametrize(
    "splits,total,message",
    [
        (None, 7, "not given and 7 rows do not split evenly over 3 ranks"),
        ([1, 2], 3, "must be 3 non-negative counts"),
        ([4, -1, 0], 3, "must be 3 non-negative counts"),
        ([1, 1, 1], 4, "sums to 3 but the tensor has 4 rows"),
    ],
)
def test_check_splits_says_what_is_wrong(splits, total, message):
    with pytest.raises(ValueError, match=message):
        check_splits("all_to_all", "input_splits", splits, total, 3)
