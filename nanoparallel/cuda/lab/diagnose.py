"""Why a GPU collective misses its target: measurements that separate the candidate causes.

    python -m nanoparallel.cuda.lab.diagnose --world-size 4 --out DIR --checked DIR/check-x4.json
    python -m nanoparallel.cuda.lab.diagnose --world-size 4 --dry-run     # the plan only, no GPU needed

The sweep (``nanoparallel.cuda.sweep``) says *that* a collective falls short of NCCL; this says
*where the time goes*, every rank measuring at once:

* ``nvlink``: raw bandwidth per direction, by traffic pattern, with our Triton copy
  (``link_probe_kernel``) reading from peers' buffers or writing into them, against the number of
  programs. ``pair``: rank 0 and rank 1 only, the others idle (one link alone). ``ring``: every
  rank with rank + 1 (one peer each, all GPUs busy). ``all_peers``: every rank with every other
  rank at once, the peers interleaved every 8 KiB (all links at once). ``incast``: every rank with
  rank 0 (what a kernel does that visits peers in rank order, all ranks in lock step: the old
  all-gather reading, the old all-to-all writing). ``GBps`` is the bytes one active rank moves per
  second per direction, whatever the number of its peers. Beside them: the copy engine
  (``Tensor.copy_`` to and from the next rank's buffer), NCCL send/recv in a ring, a local copy.
* one section per collective (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
  ``all_to_all``) at 64 MiB, 256 MiB and 1 GiB: NCCL, each of our algorithms as the policy runs it,
  and the pipelined ones over a grid of steps and programs (``tunable`` rows, from which
  ``nanoparallel.cuda.lab.tuning`` picks each size's best).

Every row of ours is checked against NCCL's result at its shape before it is timed (as in the
sweep); ``--checked FILE`` holds back new algorithms whose check failed in this job. Timing as in
the sweep: all ranks meet, CUDA events around back-to-back calls issued from Python, the slowest
rank reported. ``busbw_GBps`` uses nccl-tests' factors (``nanoparallel.cost_model.bus_factor``);
``vs_nccl`` is busbw over the NCCL row of the same section and size (send/recv for ``nvlink``).
What NCCL itself chose (algorithm, protocol, channels) and how its pinned variants fare is
``nanoparallel.cuda.lab.nccl_info``. The JSON goes through paperclub's Report:
``<out>/<device>-cuda-x<W>-diagnose.json``.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanoparallel.cost_model import bus_factor  # noqa: E402
from nanoparallel.cuda.primitives import _copy  # noqa: E402

COLUMNS = ["section", "variant", "bytes", "programs", "steps", "tunable", "checked", "time_us", "host_us",
           "GBps", "busbw_GBps", "vs_nccl"]  # fmt: skip
SIZES = (64 << 20, 256 << 20, 1 << 30)
PROBE_BYTES = 256 << 20  # bytes one active rank moves in a raw-copy row
PATTERNS = ("pair", "ring", "all_peers", "incast")
COLLECTIVES = ("broadcast", "all_gather", "all_to_all", "all_reduce", "reduce_scatter")
# the grids of the pipelined algorithms: steps, and programs as multiples of the SM count
GRIDS = {
    ("broadcast", "ring"): ((8, 16, 32, 64), (0.5, 1, 2)),
    ("all_gather", "push_pipelined"): ((2, 4, 8, 16), (1, 2)),
    ("all_gather", "pairwise"): ((None,), (1, 2)),
    ("all_to_all", "pairwise"): ((2, 4, 8, 16), (1, 2)),
    ("all_to_all", "push_pipelined"): ((4, 8), (2,)),
    ("all_reduce", "two_shot_pipelined"): ((4, 8, 16, 32), (1, 2)),
    ("reduce_scatter", "pipelined"): ((2, 4, 8, 16), (1, 2)),
}
# the others, once each at the policy's settings
PLAIN = {
    "broadcast": ("direct", "copy_engine"),
    "all_gather": ("direct", "copy_engine"),
    "all_to_all": ("direct", "push", "copy_engine"),
    "all_reduce": ("ring", "two_shot", "one_shot_pipelined"),
    "reduce_scatter": ("direct",),
}


@triton.jit
def link_probe_kernel(local, buf, D, n, chunk, PEERS: tl.constexpr, READ: tl.constexpr, RANK: tl.constexpr,
                      W: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Raw NVLink traffic with the peers in the bit mask PEERS, n elements each. READ: peer p's
    buffer (from element RANK*n) into local[p*n:]; else local[:n] into peer p's buffer at RANK*n.
    The peers are interleaved every BLOCK elements, as the pipelined kernels interleave them."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        if not READ:
            x = tl.load(local + offs, mask=mask)
        for i in tl.static_range(1, W):
            if (PEERS >> ((RANK + i) % W)) & 1:
                if READ:
                    y = tl.load(buf + D[(RANK + i) % W] + RANK * n + offs, mask=mask)
                    tl.store(local + ((RANK + i) % W) * n + offs, y, mask=mask)
                else:
                    tl.store(buf + D[(RANK + i) % W] + RANK * n + offs, x, mask=mask)


@triton.jit
def peer_copy_kernel(local, buf, D, n, chunk, PEER: tl.constexpr, READ: tl.constexpr, BLOCK: tl.constexpr):
    """Raw NVLink bandwidth probe, one peer (``link_probe_kernel`` is the one the diagnosis runs): READ copies peer PEER's buffer into
    ``local``, otherwise ``local`` into the peer's buffer; program b moves [b*chunk, (b+1)*chunk)."""
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, n)
    if READ:
        _copy(local, buf + D[PEER], lo, hi, BLOCK)
    else:
        _copy(buf + D[PEER], local, lo, hi, BLOCK)


def peers_of(pattern: str, rank: int, world: int) -> list[int]:
    """The peers ``rank`` moves data with in a raw-copy pattern (empty: it idles)."""
    if pattern == "pair":
        return [1 - rank] if rank < 2 else []
    if pattern == "ring":
        return [(rank + 1) % world]
    if pattern == "all_peers":
        return [p for p in range(world) if p != rank]
    if pattern == "incast":
        return [0] if rank else []
    raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")


def program_counts(sm_count: int) -> list[int]:
    """Grids for the raw-copy sweep: from 1/4 of the SMs to two programs per SM (the default)."""
    return sorted({max(1, sm_count // 4), max(1, sm_count // 2), sm_count, 2 * sm_count})


def plan(world: int, sm_count: int, sizes=SIZES, collectives=COLLECTIVES) -> list[dict]:
    """Every measurement, in order: section, variant, bytes, programs (None: the policy's), steps
    (None: the policy's or not applicable), tunable (a row of a steps x programs grid)."""
    full = 2 * sm_count
    cases = []

    def add(section, variant, nbytes, programs=None, steps=None, tunable=False):
        cases.append(dict(section=section, variant=variant, bytes=nbytes, programs=programs, steps=steps,
                          tunable=tunable))  # fmt: skip

    for pattern in PATTERNS:
        grids = program_counts(sm_count) if pattern in ("pair", "all_peers") else [full]
        for programs in grids:
            for way in ("read", "write"):
                add("nvlink", f"{pattern}_{way}", PROBE_BYTES, programs)
    for way in ("read", "write"):
        add("nvlink", f"copy_engine_ring_{way}", PROBE_BYTES)
    add("nvlink", "nccl_sendrecv", PROBE_BYTES)
    add("nvlink", "local_torch_copy", PROBE_BYTES)
    for coll in collectives:
        for nbytes in sizes:
            add(coll, "nccl", nbytes)
            for algo in PLAIN[coll]:
                add(coll, algo, nbytes)
            for (c, algo), (steps, per_sm) in GRIDS.items():
                if c != coll:
                    continue
                for s in steps:
                    for f in per_sm:
                        add(coll, algo, nbytes, max(1, round(f * sm_count)), s, tunable=True)
    return cases


def finish(rows: list[dict], world: int) -> list[dict]:
    """Fill GBps, busbw_GBps and vs_nccl from time_us (rows without a time stay empty)."""
    nccl = {}
    for r in rows:
        t = r.get("time_us")
        if not t:
            continue
        r["GBps"] = round(r["bytes"] / (t * 1e-6) / 1e9, 2)
        factor = 1.0 if r["section"] == "nvlink" else bus_factor(r["section"], world)
        r["busbw_GBps"] = round(r["GBps"] * factor, 2)
        if r["variant"] in ("nccl", "nccl_sendrecv"):
            nccl[(r["section"], r["bytes"])] = r["busbw_GBps"]
    for r in rows:
        ref = nccl.get((r["section"], r["bytes"]))
        if r.get("busbw_GBps") and ref:
            r["vs_nccl"] = round(r["busbw_GBps"] / ref, 3)
    return rows


def _iters(nbytes: int) -> int:
    return int(min(200, max(8, 2e9 // max(nbytes, 1))))


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    try:
        results.put((rank, _rank_body(rank, world, port, args), None))
    except BaseException as exc:  # tell the parent at once, which then stops every rank
        import traceback

        results.put((rank, None, f"rank {rank} crashed: {exc!r}\n{traceback.format_exc()}"))
        raise


def _rank_body(rank: int, world: int, port: int, args) -> list[dict]:
    import torch.distributed as dist

    from nanoparallel.cuda import STEP_BYTES, split_work
    from nanoparallel.cuda.check import checked_algorithms, may_time
    from nanoparallel.cuda.sweep import Case, fresh_backend, join_world, rebuild_needed, time_calls

    be, dev = join_world(rank, world, port)
    checked = checked_algorithms(args.checked)
    largest = max([PROBE_BYTES * world] + list(args.sizes))
    be._grow(largest)  # collective: every rank grows alike, before anything is timed
    f32 = torch.float32
    scratch = torch.randn(largest // 4, device=dev)
    block = STEP_BYTES // 4
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def probe(variant: str, nbytes: int, programs: int | None):
        """The call that one nvlink row times (a no-op on a rank that idles in the pattern)."""
        buf = be._staging[0]
        n = nbytes // 4
        if variant == "local_torch_copy":
            return lambda: scratch[n : 2 * n].copy_(scratch[:n])
        if variant.startswith("copy_engine_ring"):
            peer_view = buf.peer(nxt).view(f32)[:n]
            if variant.endswith("read"):
                return lambda: scratch[:n].copy_(peer_view)
            return lambda: peer_view.copy_(scratch[:n])
        if variant == "nccl_sendrecv":

            def sendrecv():
                ops = [
                    dist.P2POp(dist.isend, scratch[:n], nxt),
                    dist.P2POp(dist.irecv, scratch[n : 2 * n], prv),
                ]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            return sendrecv
        pattern, way = variant.rsplit("_", 1)
        peers = peers_of(pattern, rank, world)
        if not peers:
            return lambda: None
        each = n // len(peers)
        chunk, grid = split_work(each, programs, block)
        mask = sum(1 << p for p in peers)
        a = (scratch, buf.view(f32), buf.deltas(f32), each, chunk, mask, way == "read", rank, world, block)
        return lambda: be._launch(link_probe_kernel, grid, a)

    rows = []
    cases: dict = {}
    for spec in args.plan:
        section, variant, nbytes, programs, steps = (
            spec[k] for k in ("section", "variant", "bytes", "programs", "steps")
        )
        row = dict(spec)
        if section == "nvlink":
            fn = probe(variant, nbytes, programs)
        else:
            if variant != "nccl" and not may_time(checked, section, variant):
                continue
            key = (section, nbytes)
            if key not in cases:  # one input and NCCL reference per collective and size
                cases.clear()
                torch.cuda.empty_cache()
                count = nbytes // 4 // world * world
                g = torch.Generator(device=dev).manual_seed(rank)
                x = torch.randn(count, device=dev, generator=g)
                cases[key] = Case(section, x, world, rank)
                cases[key].pristine = x.clone()
            case = cases[key]
            case.be = be
            be.programs, be.pipeline_steps = programs, steps
            if variant == "nccl":
                fn = case.nccl
            else:
                try:
                    problem = case.check(variant)
                except Exception as exc:
                    problem = f"{type(exc).__name__}: {str(exc)[:200]}"
                bad = torch.tensor([1.0 if problem else 0.0], device=dev)
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                row["checked"] = not bad.item()
                if not row["checked"]:
                    if rank == 0:
                        print(f"{section} {variant} {nbytes} B programs={programs} steps={steps}: check failed "
                              f"({problem or 'on another rank'}); not timed", flush=True)  # fmt: skip
                    if rebuild_needed(be, dev):
                        be = fresh_backend(be)
                        be._grow(largest)
                    rows.append(row)
                    continue
                fn = lambda v=variant, c=case: c.ours(v)  # noqa: E731
        row["time_us"], row["host_us"] = (round(v, 2) for v in time_calls(fn, _iters(nbytes), dev))
        rows.append(row)
        if rank == 0:
            print(f"{section:14s} {variant:22s} {nbytes:>11d} B  programs={programs} steps={steps}  "
                  f"{row['time_us']:.1f} us (host {row['host_us']:.1f})", flush=True)  # fmt: skip
    be.programs, be.pipeline_steps = None, None
    cases.clear()
    be.barrier()
    be.close()
    dist.destroy_process_group()
    return rows


def report(rows: list[dict], world: int, dry_run: bool, sm_count: int):
    from paperclub.bench import Report

    rep = Report(
        package="nanoparallel",
        title=f"Where the time goes: NVLink by traffic pattern, each collective's variants on {world} GPUs",
        peer="NCCL (torch.distributed, NVLS off)",
        columns=COLUMNS,
        packages=["torch", "triton"],
        measure_ceilings=False,
        notes=(
            ("DRY RUN: the plan only, no measurements. " if dry_run else "")
            + "nanoparallel.cuda.lab.diagnose. nvlink: GBps per direction moved by one active rank, all active ranks at "
            "once; pair: ranks 0 and 1 only; ring: every rank with rank+1; all_peers: every rank with every other, "
            "interleaved every 8 KiB; incast: every rank with rank 0; programs = grid of the Triton probe. "
            "Collective sections: GBps = algbw, busbw with nccl-tests' factors; steps and programs as the row ran "
            "(empty: the policy's); tunable rows form the grids tuning picks from; checked: our result equalled "
            "NCCL's at that shape before timing. CUDA events around back-to-back calls, slowest rank."
        ),
    )
    for r in rows:
        rep.add(**{c: r.get(c) for c in COLUMNS})
    for p in plots(sm_count):
        rep.plot(**p)
    return rep


def plots(sm_count: int) -> list[dict]:
    """What the site draws: raw bandwidth by pattern against programs (log y: the local copy sits
    beside NVLink), and for each pipelined algorithm busbw over NCCL's against steps at a full grid."""
    out = [
        dict(title="raw copy bandwidth per direction vs programs (256 MiB per active rank)", x="programs",
             y="GBps", series="variant", where={"section": "nvlink"}, logx=True),
    ]  # fmt: skip
    for (coll, algo), (steps, _) in GRIDS.items():
        if len(steps) > 1:
            out.append(dict(title=f"{coll} {algo}: busbw/NCCL vs steps ({2 * sm_count} programs)", x="steps",
                            y="vs_nccl", series="bytes",
                            where={"section": coll, "variant": algo, "programs": 2 * sm_count}, logx=True))  # fmt: skip
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--out", type=Path, default=None, help="folder for the JSON (default nanoparallel/results)"
    )
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes of the collective rows")
    p.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    p.add_argument(
        "--checked", default=None, help="check --groups summary: time only new algorithms that passed"
    )
    p.add_argument("--tag", default=None, help="default cuda-x<W>-diagnose")
    p.add_argument("--dry-run", action="store_true", help="print and write the plan without measuring")
    p.add_argument("--sm-count", type=int, default=None, help="SMs per GPU for the plan (default: GPU 0's)")
    args = p.parse_args(argv)
    world = args.world_size
    tag = args.tag or f"cuda-x{world}-diagnose"
    sm = args.sm_count or (
        torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    )
    args.plan = plan(world, sm, sizes=tuple(args.sizes), collectives=tuple(args.collectives))
    if args.dry_run:
        rows = [dict(r) for r in args.plan]
        report(rows, world, dry_run=True, sm_count=sm).write(tag=tag + "-dry-run", out_dir=args.out)
        return
    from nanoparallel.cuda.sweep import check_world_size
    from nanoparallel.launch import spawn_ranks

    check_world_size(world)
    t0 = time.perf_counter()
    # each rank sends (rank, rows, error text or None)
    out = {rank: rows for rank, rows, _ in spawn_ranks(world, _rank_main, args, 900, lambda m: m[2])}
    rows = finish(out[0], world)
    report(rows, world, dry_run=False, sm_count=sm).write(tag=tag, out_dir=args.out)
    print(f"diagnose took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
