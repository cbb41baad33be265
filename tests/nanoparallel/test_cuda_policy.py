"""The GPU backend's choice for algorithm="auto", and its argument checks that need no GPU.

The choices come from nanoparallel/cuda/auto_tables.py, made from the GPU runs by
nanoparallel.cuda.lab.tuning. PINS and STEP_PINS below fix them at a few sizes so that a change of
policy is deliberate: after new tables are written, paste the output of
``python -m nanoparallel.cuda.lab.tuning --pins`` (with the same --sweep/--diagnose files) over them.
The backend is built without __init__ (that needs GPUs); only the pure methods are exercised.
"""

from __future__ import annotations

import pytest
import torch

from nanoparallel.cuda import (
    ALGORITHMS,
    NEW_ALGORITHMS,
    PIPELINE_STEPS,
    CudaPeerBackend,
    SplitCache,
    check_splits,
    copy_engine_pieces,
    pick,
    pipeline_steps,
)
from nanoparallel.cuda.policy import SIZE_INDEPENDENT, Policy, policies, policy_for

# what auto picks (python -m nanoparallel.cuda.lab.tuning --pins)
PINS = {
    (2, "all_gather", 8): "pairwise",
    (2, "all_gather", 64 << 10): "direct",
    (2, "all_gather", 16 << 20): "direct",
    (2, "all_gather", 64 << 20): "push_pipelined",
    (2, "all_gather", 256 << 20): "push_pipelined",
    (2, "all_gather", 1 << 30): "push_pipelined",
    (2, "all_reduce", 8): "one_shot",
    (2, "all_reduce", 64 << 10): "one_shot_push",
    (2, "all_reduce", 16 << 20): "one_shot_pipelined",
    (2, "all_reduce", 64 << 20): "one_shot_pipelined",
    (2, "all_reduce", 256 << 20): "one_shot_pipelined",
    (2, "all_reduce", 1 << 30): "one_shot_pipelined",
    (2, "all_to_all", 8): "direct",
    (2, "all_to_all", 64 << 10): "push",
    (2, "all_to_all", 16 << 20): "push",
    (2, "all_to_all", 64 << 20): "push_pipelined",
    (2, "all_to_all", 256 << 20): "push_pipelined",
    (2, "all_to_all", 1 << 30): "copy_engine",
    (2, "broadcast", 8): "direct",
    (2, "broadcast", 64 << 10): "direct",
    (2, "broadcast", 16 << 20): "copy_engine",
    (2, "broadcast", 64 << 20): "copy_engine",
    (2, "broadcast", 256 << 20): "copy_engine",
    (2, "broadcast", 1 << 30): "ring",
    (2, "reduce_scatter", 8): "ring",
    (2, "reduce_scatter", 64 << 10): "ring",
    (2, "reduce_scatter", 16 << 20): "direct",
    (2, "reduce_scatter", 64 << 20): "pipelined",
    (2, "reduce_scatter", 256 << 20): "pipelined",
    (2, "reduce_scatter", 1 << 30): "pipelined",
    (4, "all_gather", 8): "direct",
    (4, "all_gather", 64 << 10): "direct",
    (4, "all_gather", 16 << 20): "direct",
    (4, "all_gather", 64 << 20): "copy_engine",
    (4, "all_gather", 256 << 20): "copy_engine",
    (4, "all_gather", 1 << 30): "copy_engine",
    (4, "all_reduce", 8): "two_shot",
    (4, "all_reduce", 64 << 10): "one_shot_push",
    (4, "all_reduce", 16 << 20): "two_shot",
    (4, "all_reduce", 64 << 20): "two_shot_pipelined",
    (4, "all_reduce", 256 << 20): "two_shot_pipelined",
    (4, "all_reduce", 1 << 30): "two_shot_pipelined",
    (4, "all_to_all", 8): "push",
    (4, "all_to_all", 64 << 10): "push",
    (4, "all_to_all", 16 << 20): "push",
    (4, "all_to_all", 64 << 20): "pairwise",
    (4, "all_to_all", 256 << 20): "pairwise",
    (4, "all_to_all", 1 << 30): "copy_engine",
    (4, "broadcast", 8): "direct",
    (4, "broadcast", 64 << 10): "direct",
    (4, "broadcast", 16 << 20): "ring",
    (4, "broadcast", 64 << 20): "ring",
    (4, "broadcast", 256 << 20): "ring",
    (4, "broadcast", 1 << 30): "ring",
    (4, "reduce_scatter", 8): "direct",
    (4, "reduce_scatter", 64 << 10): "direct",
    (4, "reduce_scatter", 16 << 20): "direct",
    (4, "reduce_scatter", 64 << 20): "direct",
    (4, "reduce_scatter", 256 << 20): "direct",
    (4, "reduce_scatter", 1 << 30): "pipelined",
}
STEP_PINS = {
    (2, "all_gather/push_pipelined", 64 << 20): 4,
    (2, "all_gather/push_pipelined", 256 << 20): 16,
    (2, "all_gather/push_pipelined", 1 << 30): 16,
    (2, "all_reduce/one_shot_pipelined", 64 << 20): 4,
    (2, "all_reduce/one_shot_pipelined", 256 << 20): 16,
    (2, "all_reduce/one_shot_pipelined", 1 << 30): 16,
    (2, "all_reduce/two_shot_pipelined", 64 << 20): 4,
    (2, "all_reduce/two_shot_pipelined", 256 << 20): 16,
    (2, "all_reduce/two_shot_pipelined", 1 << 30): 16,
    (2, "all_to_all/pairwise", 64 << 20): 4,
    (2, "all_to_all/pairwise", 256 << 20): 4,
    (2, "all_to_all/pairwise", 1 << 30): 4,
    (2, "all_to_all/push_pipelined", 64 << 20): 4,
    (2, "all_to_all/push_pipelined", 256 << 20): 4,
    (2, "all_to_all/push_pipelined", 1 << 30): 4,
    (2, "broadcast/ring", 64 << 20): 16,
    (2, "broadcast/ring", 256 << 20): 16,
    (2, "broadcast/ring", 1 << 30): 16,
    (2, "reduce_scatter/pipelined", 64 << 20): 4,
    (2, "reduce_scatter/pipelined", 256 << 20): 16,
    (2, "reduce_scatter/pipelined", 1 << 30): 16,
    (4, "all_gather/push_pipelined", 64 << 20): 8,
    (4, "all_gather/push_pipelined", 256 << 20): 16,
    (4, "all_gather/push_pipelined", 1 << 30): 16,
    (4, "all_reduce/one_shot_pipelined", 64 << 20): 4,
    (4, "all_reduce/one_shot_pipelined", 256 << 20): 16,
    (4, "all_reduce/one_shot_pipelined", 1 << 30): 16,
    (4, "all_reduce/two_shot_pipelined", 64 << 20): 4,
    (4, "all_reduce/two_shot_pipelined", 256 << 20): 16,
    (4, "all_reduce/two_shot_pipelined", 1 << 30): 16,
    (4, "all_to_all/pairwise", 64 << 20): 4,
    (4, "all_to_all/pairwise", 256 << 20): 4,
    (4, "all_to_all/pairwise", 1 << 30): 4,
    (4, "all_to_all/push_pipelined", 64 << 20): 8,
    (4, "all_to_all/push_pipelined", 256 << 20): 8,
    (4, "all_to_all/push_pipelined", 1 << 30): 8,
    (4, "broadcast/ring", 64 << 20): 16,
    (4, "broadcast/ring", 256 << 20): 32,
    (4, "broadcast/ring", 1 << 30): 64,
    (4, "reduce_scatter/pipelined", 64 << 20): 4,
    (4, "reduce_scatter/pipelined", 256 << 20): 4,
    (4, "reduce_scatter/pipelined", 1 << 30): 16,
}


def backend(world_size: int, sm_count: int = 132) -> CudaPeerBackend:
    be = object.__new__(CudaPeerBackend)
    be.world_size = world_size
    be.pipeline_steps = None
    be.programs = None
    be.sm_count, be.max_programs = sm_count, 2 * sm_count
    be.policy = policy_for(world_size)
    return be


def test_auto_picks_the_pinned_algorithms():
    for (world, collective, nbytes), expected in PINS.items():
        assert backend(world)._algorithm(collective, "auto", nbytes) == expected, (world, collective, nbytes)


def test_pipeline_steps_are_the_pinned_ones_and_the_knob_wins():
    for (world, key, nbytes), expected in STEP_PINS.items():
        collective, algorithm = key.split("/")
        assert backend(world)._pipeline_steps(collective, nbytes, algorithm) == expected, (world, key, nbytes)
    be = backend(4)
    assert be._pipeline_steps("all_reduce", 1 << 30, "no_such_table") == PIPELINE_STEPS
    be.pipeline_steps = 3  # a measurement's knob wins over the tables
    assert be._pipeline_steps("all_reduce", 1 << 30, "one_shot_pipelined") == 3


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_a_world_size_takes_the_tables_of_the_nearest_measured_one(world):
    measured = policies()
    got = policy_for(world)
    nearest = min(measured, key=lambda w: (abs(w - world), -w))  # a tie (3: 2 or 4) goes to the larger
    assert got == measured[nearest]
    if world >= 3:
        assert got == measured[4]


def test_every_table_is_well_formed():
    for world, pol in policies().items():
        for collective, table in pol.algorithms.items():
            assert table[0][0] == 0, f"{world} GPUs, {collective}: the first row must start at 0 bytes"
            assert [b for b, _ in table] == sorted({b for b, _ in table}), f"{world}, {collective}: bounds"
            for _, algo in table:
                assert algo in ALGORITHMS[collective], (world, collective, algo)
        for kind, tables in (("steps", pol.steps), ("programs_per_sm", pol.programs_per_sm)):
            for key, table in tables.items():
                collective, algorithm = key.split("/")
                assert algorithm in ALGORITHMS[collective], (world, kind, key)
                assert table[0][0] == 0 and all(v > 0 for _, v in table), (world, kind, key)
                if collective in SIZE_INDEPENDENT:  # ranks of an uneven all-to-all differ in size
                    assert len(table) == 1, f"{world} GPUs, {key}: {kind} must not depend on the size"
                if kind == "programs_per_sm":
                    assert all(v <= 2 for _, v in table), "more than 2 programs per SM cannot all be resident"


def test_new_algorithms_are_named_calls_only_until_a_gpu_run_has_timed_them():
    # issue #35's kernels are listed, so the check covers them, but auto takes none of them yet
    for collective, names in NEW_ALGORITHMS.items():
        assert set(names) <= set(ALGORITHMS[collective])
        for pol in policies().values():
            chosen = {a for _, a in pol.algorithms.get(collective, ())}
            assert not chosen & set(names), f"{collective}: auto takes {chosen & set(names)} before a GPU run"


def test_programs_knob_and_policy():
    be = backend(4, sm_count=132)
    assert be._programs("all_reduce", "ring", 1 << 30) == 264  # no table: two per SM
    be.policy = Policy(algorithms={}, programs_per_sm={"broadcast/ring": ((0, 2.0), (64 << 20, 0.5))})
    assert be._programs("broadcast", "ring", 1 << 20) == 264
    assert be._programs("broadcast", "ring", 64 << 20) == 66
    be.programs = 7  # the knob wins, capped at max_programs
    assert be._programs("broadcast", "ring", 64 << 20) == 7
    be.programs = 10_000
    assert be._programs("broadcast", "ring", 64 << 20) == 264


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


def _rank_plans(counts: list[list[int]]):
    """Each rank's SplitPlan of one all-to-all: counts[s][d] rows from rank s to rank d."""
    W = len(counts)
    plans = []
    for r in range(W):
        ins = counts[r]
        outs = [counts[s][r] for s in range(W)]
        plans.append(SplitCache(W, torch.device("cpu")).plan(sum(ins), sum(outs), 1, ins, outs, cache=False))
    return plans


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_auto_all_to_all_takes_one_algorithm_on_every_rank(world, seed):
    """The ranks must launch the same all-to-all kernel; each sees only its own splits. A 2 x H200
    check found rank 0 (516 bytes) taking direct and rank 1 (27 KB) push, and wrong data."""
    from nanoparallel.cuda.all_to_all import all_to_all_algorithm

    gen = torch.Generator().manual_seed(seed)
    scale = [1, 1 << 10, 1 << 18, 1 << 24][seed % 4]
    uneven = torch.randint(0, 4 * scale, (world, world), generator=gen).tolist()
    even = [[scale] * world for _ in range(world)]
    for counts, elem in ((uneven, 4), (even, 4), (even, 2)):
        be = backend(world)
        be.staging_cap = 1 << 30
        slot = be.staging_cap // elem // world // 64 * 64
        chosen = {
            all_to_all_algorithm(be, plan, "auto", sum(plan.input_splits) * elem, slot, counts is even)
            for plan in _rank_plans(counts)
        }
        assert len(chosen) == 1, f"counts {counts}: the ranks take {chosen}"
    # the case the GPU check failed on
    plans = _rank_plans([[53, 76], [3094, 3732]])
    be = backend(2)
    be.staging_cap = 64 << 20
    assert {all_to_all_algorithm(be, p, "auto", sum(p.input_splits) * 4, 1 << 20, False) for p in plans} == {
        "direct"
    }
    # even splits (None on every rank) keep the table's choice by size
    plans = _rank_plans([[1 << 18] * 2] * 2)
    assert all_to_all_algorithm(be, plans[0], "auto", (1 << 19) * 4, 1 << 20, True) == be._algorithm(
        "all_to_all", "auto", (1 << 19) * 4
    )


def test_named_all_to_all_too_large_for_a_slot_says_so():
    from nanoparallel.cuda.all_to_all import all_to_all_algorithm

    plan = _rank_plans([[10, 300], [5, 7]])[0]
    with pytest.raises(ValueError, match=r"'push' gives each sender 64 elements.*a split has 300"):
        all_to_all_algorithm(backend(2), plan, "push", 1240, 64, False)
