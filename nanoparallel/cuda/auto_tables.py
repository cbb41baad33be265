"""What ``algorithm="auto"`` picks, per measured world size. Generated: do not edit by hand.

Made by ``nanoparallel.cuda.tuning`` (its docstring says how) with:
    (by hand, from the tables of nanoparallel/cuda/__init__.py before issue #35)
Each table is ((from this many bytes, choice), ...); ``source`` names the measurements.
"""

POLICIES = {
    2: {
        "source": "NVIDIA H200 x2 sweeps 2026-11-23 (cuda-x2, cuda-x2-diagnose, cuda-x2-rs, cuda-x2-rs16), by hand",
        "algorithms": {
            "all_gather": (
                (0, "direct"),
                (256 << 20, "copy_engine"),
            ),
            "all_reduce": (
                (0, "one_shot"),
                (16 << 20, "one_shot_pipelined"),
            ),
            "all_to_all": (
                (0, "direct"),
                (16 << 20, "push"),
                (64 << 20, "push_pipelined"),
                (256 << 20, "copy_engine"),
            ),
            "broadcast": (
                (0, "direct"),
                (256 << 20, "copy_engine"),
            ),
            "reduce_scatter": (
                (0, "direct"),
                (64 << 20, "pipelined"),
            ),
        },
        "steps": {
            "all_gather/push_pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
            "all_reduce/one_shot_pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
            "all_reduce/two_shot_pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
            "all_to_all/pairwise": ((0, 4),),
            "all_to_all/push_pipelined": ((0, 4),),
            "broadcast/ring": ((0, 16),),
            "reduce_scatter/pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
        },
        "programs_per_sm": {},
    },
    4: {
        "source": "NVIDIA H100 80GB HBM3 x4 sweep 2026-11-27 (cuda-x4) for all-reduce and all-to-all, by hand; the rest as 2 GPUs",
        "algorithms": {
            "all_gather": (
                (0, "direct"),
                (256 << 20, "copy_engine"),
            ),
            "all_reduce": (
                (0, "one_shot"),
                (262145, "two_shot"),
                (64 << 20, "ring"),
            ),
            "all_to_all": (
                (0, "direct"),
                (16 << 20, "push"),
                (64 << 20, "push_pipelined"),
            ),
            "broadcast": (
                (0, "direct"),
                (256 << 20, "copy_engine"),
            ),
            "reduce_scatter": (
                (0, "direct"),
                (64 << 20, "pipelined"),
            ),
        },
        "steps": {
            "all_gather/push_pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
            "all_reduce/one_shot_pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
            "all_reduce/two_shot_pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
            "all_to_all/pairwise": ((0, 4),),
            "all_to_all/push_pipelined": ((0, 4),),
            "broadcast/ring": ((0, 16),),
            "reduce_scatter/pipelined": (
                (0, 4),
                (256 << 20, 16),
            ),
        },
        "programs_per_sm": {},
    },
}
