"""What ``algorithm="auto"`` picks, per measured world size. Generated; the entries a table's
``source`` says were set by hand are the only edits, each naming the measurement it follows.

Made by ``nanoparallel.cuda.lab.tuning`` (its docstring says how) with:
    python -m nanoparallel.cuda.lab.tuning --sweep nvidia-h100-80gb-hbm3-cuda-x2-busbw.json --sweep nvidia-h100-80gb-hbm3-cuda-x4-busbw.json --diagnose nvidia-h100-80gb-hbm3-cuda-x4-busbw-diagnose.json
Each table is ((from this many bytes, choice), ...); ``source`` names the measurements.
"""

POLICIES = {
    2: {
        "source": "NVIDIA H200 x2 sweeps 2026-11-23 (cuda-x2, cuda-x2-diagnose, cuda-x2-rs, cuda-x2-rs16), by hand; NVIDIA H100 80GB HBM3 x2 sweep 2026-11-28",
        "algorithms": {
            "all_gather": (
                (0, "pairwise"),
                (16, "direct"),
                (256, "pairwise"),
                (1 << 10, "direct"),
                (64 << 20, "push_pipelined"),
            ),
            "all_reduce": (
                (0, "one_shot"),
                (256, "ring"),
                (1 << 10, "one_shot"),
                (4 << 10, "ring"),
                (64 << 10, "one_shot_push"),
                (1 << 20, "one_shot"),
                (16 << 20, "one_shot_pipelined"),
            ),
            "all_to_all": (
                (0, "direct"),
                (1 << 10, "push"),
                (4 << 20, "direct"),
                (16 << 20, "push"),
                (64 << 20, "push_pipelined"),
                (1 << 30, "copy_engine"),
            ),
            "broadcast": (
                (0, "direct"),
                (16 << 20, "copy_engine"),
                (1 << 30, "ring"),
            ),
            "reduce_scatter": (
                (0, "ring"),
                (16 << 10, "direct"),
                (64 << 10, "ring"),
                (256 << 10, "direct"),
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
        "source": "NVIDIA H100 80GB HBM3 x4 sweep 2026-11-27 (cuda-x4) for all-reduce and all-to-all, by hand; the rest as 2 GPUs; NVIDIA H100 80GB HBM3 x4 sweep 2026-11-28; NVIDIA H100 80GB HBM3 x4 diagnose 2026-11-28; all-reduce from 64 MiB by hand from the NVIDIA H200 x4 sweep 2026-11-28 (cuda-x4-busbw2: two_shot_pipelined 0.84-0.94x NCCL against ring's 0.82-0.85x)",
        "algorithms": {
            "all_gather": (
                (0, "direct"),
                (64 << 20, "copy_engine"),
            ),
            "all_reduce": (
                (0, "two_shot"),
                (64, "one_shot"),
                (256, "two_shot"),
                (64 << 10, "one_shot_push"),
                (4 << 20, "two_shot"),
                (64 << 20, "two_shot_pipelined"),
            ),
            "all_to_all": (
                (0, "push"),
                (64 << 20, "pairwise"),
                (1 << 30, "copy_engine"),
            ),
            "broadcast": (
                (0, "direct"),
                (16 << 20, "ring"),
            ),
            "reduce_scatter": (
                (0, "direct"),
                (64, "ring"),
                (1 << 10, "direct"),
                (1 << 30, "pipelined"),
            ),
        },
        "steps": {
            "all_gather/push_pipelined": (
                (0, 4),
                (64 << 20, 8),
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
            "all_to_all/push_pipelined": ((0, 8),),
            "broadcast/ring": (
                (0, 16),
                (256 << 20, 32),
                (1 << 30, 64),
            ),
            "reduce_scatter/pipelined": (
                (0, 4),
                (1 << 30, 16),
            ),
        },
        "programs_per_sm": {
            "all_gather/pairwise": (
                (0, 1.0),
                (256 << 20, 2.0),
            ),
            "all_gather/push_pipelined": (
                (0, 1.0),
                (1 << 30, 2.0),
            ),
            "all_to_all/pairwise": ((0, 2.0),),
            "all_to_all/push_pipelined": ((0, 2.0),),
            "broadcast/ring": ((0, 1.0),),
            "reduce_scatter/pipelined": ((0, 2.0),),
        },
    },
}
