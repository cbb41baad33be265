"""Registers per thread of the peer kernels compiled offline for sm_90a, and how many programs fit an SM.

    python -m nanoparallel.cuda.lab.registers            # the table, no GPU needed (about a minute)
    python -m nanoparallel.cuda.lab.registers --fingerprints FILE [--jobs 2]   # every kernel's PTX fingerprint
    python -m nanoparallel.cuda.lab.registers --compare OLD NEW   # exit 1 if two fingerprint files differ

Why: program b of a rank waits for program b of every peer, so whether a launch's whole grid is
resident at once decides whether it runs in one wave or relies on the GPU starting programs in
index order (``PROGRAMS_PER_SM`` in ``nanoparallel/cuda/backend.py``). A program has
``NUM_WARPS`` x 32 threads; an H100 SM has 65536 registers, given out per warp in units of 256, so
two programs fit where a thread needs at most 128 registers. Each row is one kernel, world size
and dtype, over every rank (``RANK`` is a constexpr, so each rank compiles its own kernel): the
most registers, the most bytes spilled, and programs per SM that fit by registers.

The compile is Triton's own (``paperclub.lab.compile_sm90``, bundled ptxas), in a process without
``TRITON_INTERPRET`` (``paperclub.lab.offline``); peer offsets are given as 64-bit tuples, pointers
and sizes as 16-byte aligned, as a launch specialises them.

``--fingerprints`` compiles every ``*_kernel`` of the package (found by name in the modules of
``MODULES``, so a kernel that moves between files keeps its key) at 2 and 4 ranks, for every rank,
every dtype of the backend and every value of its other constexprs (OP, GATHER, ROTATE, READ), and
writes ``paperclub.lab``'s ``ptx_sha`` of each: the PTX without its debug lines, which name the
source file. Two such files that agree mean a refactoring left the machine code as it was
(issue #40's split of kernels.py into one file per collective: 1482 compiles, about 7 minutes on 2
cores with ``--jobs 2``).
"""

from __future__ import annotations

KERNELS = {
    # name: (module, kernel, constexprs besides RANK, W and BLOCK)
    "all_reduce two_shot_pipelined": ("all_reduce", "two_shot_pipelined_all_reduce_kernel", {"OP": 0}),
    "all_reduce one_shot_pipelined": ("all_reduce", "one_shot_pipelined_all_reduce_kernel", {"OP": 0}),
    "all_reduce ring": ("all_reduce", "ring_all_reduce_kernel", {"OP": 0, "GATHER": True}),
    "reduce_scatter pipelined": ("reduce_scatter", "reduce_scatter_pipelined_kernel", {"OP": 0}),
    "all_gather push_pipelined": ("all_gather", "all_gather_push_kernel", {}),
    "all_gather pairwise": ("all_gather", "all_gather_pairwise_kernel", {}),
    "broadcast ring": ("broadcast", "ring_broadcast_kernel", {}),
    "all_to_all pairwise": ("all_to_all", "all_to_all_pipelined_kernel", {"ROTATE": True}),
}
POINTERS = {"f32": ("*fp32", 4), "bf16": ("*bf16", 2), "i64": ("*i64", 8)}
# every dtype of the backend (DTYPES), for --fingerprints
ALL_POINTERS = {**POINTERS, "f16": ("*fp16", 2), "i32": ("*i32", 4)}
# modules that may define kernels; a name that is not a module (yet, or any more) is skipped
MODULES = (
    "kernels",
    "primitives",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_to_all",
    "lab.diagnose",
)
# every value of the constexprs that are not RANK, W, BLOCK or derived from them
CONSTEXPR_VALUES = {
    "OP": (0, 1, 2, 3),
    "GATHER": (True, False),
    "ROTATE": (True, False),
    "READ": (True, False),
}
DATA = ("inp", "out", "buf", "tensor", "local")
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


def _signature(fn, ptr: str, W: int) -> tuple[dict, list[str]]:
    """Triton signature of a peer kernel (see the module docstring) and its 16-divisible arguments."""
    sig = {a: "i32" for a in fn.arg_names}
    sig.update({a: ptr for a in DATA if a in sig})
    sig.update({a: "*i64" for a in ("hdr", "meta") if a in sig})
    sig.update({a: "*i32" for a in ("flags", "err") if a in sig})
    sig.update({a: tuple(["i64"] * W) for a in ("D", "H", "F", "M") if a in sig})
    divisible = [a for a in (*DATA, "hdr", "meta", "flags", "err", "S", "chunk", "sub") if a in sig]
    return sig, divisible


def kernels() -> dict[str, object]:
    """Every ``*_kernel`` defined in a module of MODULES, by name (names are unique in the package)."""
    import importlib

    found = {}
    for module in MODULES:
        try:
            mod = importlib.import_module(f"nanoparallel.cuda.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"nanoparallel.cuda.{module}":
                raise
            continue
        for name, fn in vars(mod).items():
            if name.endswith("_kernel") and hasattr(fn, "arg_names") and fn.fn.__module__ == mod.__name__:
                if name in found:
                    raise ValueError(f"kernel {name} is defined twice")
                found[name] = fn
    return found


def kernel_names(_cases) -> list[str]:
    """Compile driver for ``paperclub.lab.offline``: the kernel names, as a process without the
    interpreter finds them (the one that compiles them)."""
    return sorted(kernels())


def fingerprint_cases(names) -> list[dict]:
    """One case per kernel name, world size (2, 4) and dtype; the driver expands ranks and constexprs."""
    return [
        {"kernel": k, "world": w, "dtype": d} for k in sorted(names) for w in (2, 4) for d in ALL_POINTERS
    ]


def fingerprint_rows(cases: list[dict]) -> list[dict]:
    """Compile driver for ``paperclub.lab.offline``: each case over every rank and every value of the
    kernel's other constexprs; rows {"key", "ptx_sha"} (or "error"). Kernels without a data pointer
    (the bare barriers) are compiled for the case of dtype "f32" only."""
    import itertools

    from nanoparallel.cuda import NUM_WARPS, STEP_BYTES
    from paperclub.lab import compile_sm90, report_or_error

    table = kernels()
    out = []
    for case in cases:
        fn = table[case["kernel"]]
        if not any(a in fn.arg_names for a in DATA) and case["dtype"] != "f32":
            continue
        ptr, elem = ALL_POINTERS[case["dtype"]]
        W = case["world"]
        sig, divisible = _signature(fn, ptr, W)
        extra = {a: v for a, v in CONSTEXPR_VALUES.items() if a in sig}
        for rank, values in itertools.product(range(W), itertools.product(*extra.values())):
            consts = {
                "RANK": rank,
                "W": W,
                "BLOCK": STEP_BYTES // elem,
                **dict(zip(extra, values, strict=True)),
            }
            # the value each launch passes: WP2 for all_to_all_kernel, the peer(s) of the probes
            consts.update({"WP2": 1 << (W - 1).bit_length(), "PEER": (rank + 1) % W,
                           "PEERS": ((1 << W) - 1) & ~(1 << rank)})  # fmt: skip
            consts = {k: v for k, v in consts.items() if k in sig}
            named = [f"{k}={v}" for k, v in consts.items() if k not in ("W", "BLOCK")]
            key = " ".join([case["kernel"], f"W={W}", case["dtype"], *named])
            row = report_or_error(
                lambda fn=fn, consts=consts, sig=sig, divisible=divisible: compile_sm90(
                    fn,
                    constexprs=consts,
                    signature={**sig, **{k: "constexpr" for k in consts}},
                    num_warps=NUM_WARPS,
                    divisible=divisible,
                ),
                ptxas=False,
                sass=False,
            )
            out.append(
                {"key": key, **({"error": row["error"]} if "error" in row else {"ptx_sha": row["ptx_sha"]})}
            )
    return out


def fingerprints(path: str, jobs: int = 1) -> dict[str, str]:
    """Every kernel's fingerprints (``fingerprint_rows``), compiled offline in ``jobs`` processes,
    written to ``path`` as JSON {key: ptx_sha, or the compile error}."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from paperclub.lab import offline

    cases = fingerprint_cases(offline("nanoparallel.cuda.lab.registers:kernel_names", []))
    parts = [cases[i::jobs] for i in range(max(jobs, 1))]
    with ThreadPoolExecutor(len(parts)) as pool:
        done = pool.map(
            lambda part: offline("nanoparallel.cuda.lab.registers:fingerprint_rows", part, timeout_s=7200),
            parts,
        )
        rows = [r for part in done for r in part]
    result = {r["key"]: r.get("ptx_sha") or r["error"] for r in rows}
    with open(path, "w") as f:
        json.dump(dict(sorted(result.items())), f, indent=0)
        f.write("\n")
    return result


def compare(old_path: str, new_path: str) -> list[str]:
    """What differs between two fingerprint files: keys in one only, hashes that differ, errors."""
    import json

    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    out = [f"only in {old_path}: {k}" for k in sorted(set(old) - set(new))]
    out += [f"only in {new_path}: {k}" for k in sorted(set(new) - set(old))]
    out += [f"differs: {k}: {old[k]} -> {new[k]}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    out += [f"not compiled: {k}: {v[:200]}" for k, v in sorted(new.items()) if not _is_sha(v)]
    return out


def _is_sha(v: str) -> bool:
    return len(v) == 16 and all(c in "0123456789abcdef" for c in v)


def main(argv=None) -> int:
    import argparse
    import hashlib
    import json

    from paperclub.lab import offline

    ap = argparse.ArgumentParser(
        prog="python -m nanoparallel.cuda.lab.registers", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--fingerprints", metavar="FILE", help="write every kernel's PTX fingerprint to FILE")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes for --fingerprints (default 2)")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two fingerprint files")
    args = ap.parse_args(argv)
    if args.compare:
        diffs = compare(*args.compare)
        with open(args.compare[1]) as f:
            new = json.load(f)
        digest = hashlib.sha256(json.dumps(new, sort_keys=True).encode()).hexdigest()[:16]
        print("\n".join(diffs[:50]))
        print(f"{len(new)} fingerprints in {args.compare[1]} (sha of the file's contents {digest}); "
              f"{len(diffs)} differences")  # fmt: skip
        return 1 if diffs else 0
    if args.fingerprints:
        got = fingerprints(args.fingerprints, args.jobs)
        bad = [k for k, v in got.items() if not _is_sha(v)]
        print(
            f"{len(got)} compiled kernels written to {args.fingerprints}; {len(bad)} failed to compile: {bad[:5]}"
        )
        return 1 if bad else 0

    cases = [{"kernel": k, "world": w, "dtype": d} for k in KERNELS for w in (2, 4) for d in POINTERS]
    print("| kernel | ranks | dtype | registers (most over ranks) | spilled bytes | programs per SM |")
    print("|---|---|---|---|---|---|")
    for r in offline("nanoparallel.cuda.lab.registers:rows", cases):
        cells = r.get("error") or f"{r['registers']} | {r['spill_stores']} | {r['programs_per_sm']}"
        print(f"| {r['kernel']} | {r['world']} | {r['dtype']} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
