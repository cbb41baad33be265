"""Every kernel launch of chunk_kda at head size 256 in fp32, compiled offline for sm_90a, asks for
no more shared memory than a Hopper GPU gives one block.

Why a CPU test: the interpreter has no shared memory, so an over-large tile passes every CPU test and
fails only at launch on the GPU (Triton's OutOfResources). That happened: fla's B2-T300-H2-D256 fp32
case failed on an H200 on 2026-11-28, the state backward at value blocks of 32 asking for 237,568
bytes. fp32 at D = 256 is the largest footprint chunk_kda has (ieee products, 4-byte tiles of 256
columns), so the case bounds the others. The compile runs in a subprocess of
``repro.kda.lab.ptx_snapshot`` (it replaces Triton's launcher for the whole process).
"""

import json
import os
import subprocess
import sys

from paperclub import ROOT
from paperclub.lab import HOPPER_SMEM_PER_BLOCK


def test_head256_fp32_launches_fit_hopper_shared_memory(tmp_path):
    out = tmp_path / "snapshot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-m", "repro.kda.lab.ptx_snapshot", str(out), "--only", "d256-fp32"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    kernels = {row["kernel"] for row in rows}
    # forward and backward both compiled: the state backward is the one that overflowed
    assert {"kda_state_fwd_kernel", "kda_state_bwd_fused_kernel", "kda_out_fwd_kernel"} <= kernels
    too_big = [
        (row["kernel"], row["constexprs"].get("BV"), row["num_warps"], row["shared"])
        for row in rows
        if row["shared"] > HOPPER_SMEM_PER_BLOCK
    ]
    assert not too_big, f"launches over {HOPPER_SMEM_PER_BLOCK} bytes of shared memory: {too_big}"
