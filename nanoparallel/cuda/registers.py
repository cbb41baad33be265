"""Registers per thread of the peer kernels compiled offline for sm_90a, and how many programs fit an SM.

    python -m nanoparallel.cuda.registers            # the table, no GPU needed (about a minute)

Why: program b of a rank waits for program b of every peer, so whether a launch's whole grid is
resident at once decides whether it runs in one wave or relies on the GPU starting programs in
index order (``PROGRAMS_PER_SM`` in ``nanoparallel/cuda/__init__.py``). A program has
``NUM_WARPS`` x 32 threads; an H100 SM has 65536 registers, given out per warp in units of 256, so
two programs fit where a thread needs at most 128 registers. Each row is one kernel, world size
and dtype, over every rank (``RANK`` is a constexpr, so each rank compiles its own kernel): the
most registers, the most bytes spilled, and programs per SM that fit by registers.

The compile is Triton's own (``paperclub.lab.compile_sm90``, bundled ptxas), in a process without
``TRITON_INTERPRET`` (``paperclub.lab.offline``); peer offsets are given as 64-bit tuples, pointers
and sizes as 16-byte aligned, as a launch specialises them.
"""

from __future__ import annotations

KERNELS = {
    # name: (module, kernel, constexprs besides RANK, W and BLOCK)
    "all_reduce two_shot_pipelined": ("all_reduce", "two_shot_pipelined_all_reduce_kernel", {"OP": 0}),
    "all_reduce one_shot_pipelined": ("kernels", "one_shot_pipelined_all_reduce_kernel", {"OP": 0}),
    "all_reduce ring": ("kernels", "ring_all_reduce_kernel", {"OP": 0, "GATHER": True}),
    "reduce_scatter pipelined": ("kernels", "reduce_scatter_pipelined_kernel", {"OP": 0}),
    "all_gather push_pipelined": ("all_gather", "all_gather_push_kernel", {}),
    "all_gather pairwise": ("all_gather", "all_gather_pairwise_kernel", {}),
    "broadcast ring": ("broadcast", "ring_broadcast_kernel", {}),
    "all_to_all pairwise": ("kernels", "all_to_all_pipelined_kernel", {"ROTATE": True}),
}
POINTERS = {"f32": ("*fp32", 4), "bf16": ("*bf16", 2), "i64": ("*i64", 8)}
REGISTERS_PER_SM = 65536


def programs_per_sm(registers: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps that fit an SM's registers (allocated per warp, 256 at a time)."""
    per_warp = -(-registers * 32 // 256) * 256
    return REGISTERS_PER_SM // (per_warp * num_warps)


def rows(cases: list[dict]) -> list[dict]:
    """Compile driver for ``paperclub.lab.offline``: each case {"kernel", "world", "dtype"} over
    every rank; returns the case with registers, spills and programs per SM (or the error)."""
    import importlib

    from nanoparallel.cuda import NUM_WARPS, STEP_BYTES
    from paperclub.lab import compile_sm90, report_or_error

    out = []
    for case in cases:
        module, name, extra = KERNELS[case["kernel"]]
        fn = getattr(importlib.import_module(f"nanoparallel.cuda.{module}"), name)
        ptr, elem = POINTERS[case["dtype"]]
        W = case["world"]
        sig = {a: "i32" for a in fn.arg_names}
        sig.update({a: ptr for a in ("inp", "out", "buf", "tensor") if a in sig})
        sig.update({a: "*i64" for a in ("hdr", "meta") if a in sig})
        sig.update({a: "*i32" for a in ("flags", "err") if a in sig})
        sig.update({a: tuple(["i64"] * W) for a in ("D", "H", "F", "M") if a in sig})
        divisible = [a for a in ("inp", "out", "buf", "tensor", "hdr", "meta", "flags", "err", "S", "chunk", "sub")
                     if a in sig]  # fmt: skip
        worst = {"registers": 0, "spill_stores": 0}
        for rank in range(W):
            consts = {"RANK": rank, "W": W, "BLOCK": STEP_BYTES // elem, **extra}
            sig_r = {**sig, **{k: "constexpr" for k in consts}}
            row = report_or_error(
                lambda fn=fn, consts=consts, sig_r=sig_r, divisible=divisible: compile_sm90(
                    fn, constexprs=consts, signature=sig_r, num_warps=NUM_WARPS, divisible=divisible
                ),
                sass=False,
            )
            if "error" in row:
                worst = {"error": row["error"]}
                break
            worst["registers"] = max(worst["registers"], row["registers"])
            worst["spill_stores"] = max(worst["spill_stores"], row.get("spill_stores") or 0)
        if "error" not in worst:
            worst["programs_per_sm"] = programs_per_sm(worst["registers"], NUM_WARPS)
        out.append({**case, **worst})
    return out


def main() -> None:
    from paperclub.lab import offline

    cases = [{"kernel": k, "world": w, "dtype": d} for k in KERNELS for w in (2, 4) for d in POINTERS]
    print("| kernel | ranks | dtype | registers (most over ranks) | spilled bytes | programs per SM |")
    print("|---|---|---|---|---|---|")
    for r in offline("nanoparallel.cuda.registers:rows", cases):
        cells = r.get("error") or f"{r['registers']} | {r['spill_stores']} | {r['programs_per_sm']}"
        print(f"| {r['kernel']} | {r['world']} | {r['dtype']} | {cells} |")


if __name__ == "__main__":
    main()
