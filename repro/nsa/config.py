"""The kernel choices of the NSA fast path as one frozen object, :class:`Switches`: passed to every entry
point (``switches=None`` takes the defaults below), saved by each autograd function for its backward.
Tests, the benchmark and the lab's sweeps build a ``Switches``; nothing else chooses a code path.

The paper's hyper-parameters (l, d, l', n, w) are not here: they are ``reference.NSAConfig``, the
function being computed; a ``Switches`` only changes how it is computed (or which launch shape runs).
"""

from __future__ import annotations

from dataclasses import dataclass

SLC_BACKWARDS = ("block-major", "query-major")
WINDOW_KERNELS = ("strided", "fa4")


@dataclass(frozen=True)
class Switches:
    """Which kernels run, and the launch shapes that sweeps vary. Each default says when and on what
    it was measured (results/ holds the files).

    strided_split: the compressed branch's forward walks its key tiles in three loops: the masked
        tiles at the window's lower edge (none without a window), the interior every query of the tile
        sees (no mask, no bounds check), the masked tiles at the diagonal; False: one masked loop over
        every tile (the kernel before 2026-11-27). On an H100 at T = 64k (bf16, 2026-11-27, 5
        interleaved rounds, results/*-strided-sweep.json) the compressed branch took 10.1 ms split
        against 12.5 ms in one loop, the whole forward 43.3 against 46.6 ms. The sliding window keeps
        one loop whatever this says: split, it took the same time (3.88 against 3.83 ms at its 64 x 64
        tile, within the rounds' range) and spills more (784 against 284 bytes, lab/sm90_check). fp32
        inputs on a GPU keep one loop too: their tile already spills at D = 128 and the three loops
        double that. Under the interpreter the compressed branch splits in every dtype, so the CPU
        tests cover the GPU's path.
    strided_bwd_split: the strided backward (both branches, every dtype) walks the tiles that see each
        other whole without a mask or bounds checks, as ``strided_split`` does the forward: the dQ kernel
        the key tiles of its query tile in the forward's three loops (edge, interior, diagonal), the
        dK/dV kernel the query tiles of its key tile (for each of its heads) in two, the interior, then
        the masked tiles on both sides of it (the diagonal; the window's far edge and T). False: every
        tile masked (the kernels before 2026-11-29, compiled to the same code). On an H200 at the
        paper's shape, T = 16k (2026-11-29, lab/breakdown.py --pass bwd, results/*-T16384-split-on.json
        and -split-off.json) the window's backward took 7.77 ms split against 8.97 ms in one loop, the
        compressed branch's 8.02 against 9.44 ms, the whole backward 29.5 against 32.2 ms (cuDNN's full
        attention 28.9 ms). Offline sm_90a at the paper's head sizes (lab/sm90_check) it takes 221-255
        registers a thread against 187-226, and spills at most 8 bytes.
    cmp_bwd_reverse: the compressed branch's dK/dV kernel walks each head's query tiles from the last
        to the first. A key tile's program walks every query from the tile's first visible position
        to T: walked forwards, the programs of one head start at different queries and read
        different Q / dO rows at any moment; walked backwards they all start at the last query tile
        and read the same rows together, which L2 then serves to the rest. On an H200 at the paper's
        shape (2026-11-29, lab/breakdown.py --pass bwd, results/*-reverse-off.json and
        -reverse-on.json) the compressed branch's backward took 85.6 ms reversed against 93.5 ms at
        T = 64k (the whole backward 172.8 against 180.4; cuDNN 459) and 7.35 against 8.04 ms at 16k
        (the whole 28.9 against 29.5). The window's backward walks at most w + BN queries a key tile
        and keeps the forward order: reversed it took 7.87 against 7.74 ms at 16k. False: the
        launches before the switch.
    strided_fwd_tile: (BM, BN, num_warps, num_stages) of the strided forward (both branches) on a GPU,
        for sweeps; None takes each branch's launch shape (``compression.forward_tile``,
        ``window.window_tile``, with the measurements behind them).
    scores_tile: (BM, BJ, num_warps, num_stages) of the block-score kernel: queries and selection
        blocks per program. None: on a GPU Triton's autotuner picks one of ``selection.SCORES_CONFIGS``
        at the first call of each shape; under the interpreter (16, 16). The tests set BJ = 32, the
        GPU configs' other width; a fixed tile on a GPU has not been timed against the autotuner.
    fused_topk: Eq. 11's top-n and its sort as one Triton kernel (``selection.topk_blocks_fused``)
        where Ns <= ``selection.FUSED_TOPK_MAX_NS`` and n <= ``selection.FUSED_TOPK_MAX_N`` (else
        ``torch.topk`` and the sort kernel). On since the H100 run of 2026-11-25 (13:35 UTC):
        ``test_gpu_fused_topk_is_a_top_n`` passed, and the breakdown at T = 64k timed it at 2.74 ms
        against 7.70 ms for torch.topk + the sort kernel.
    slc_backward: the selected branch's backward. "block-major" (``selected.backward_block_major``):
        dK/dV per KV block over the inverted selection, BQ queries x G heads per matmul, delta fused
        into the dQ kernel. "query-major" (``selected.backward_query_major``): dK/dV one (block, query)
        pair at a time with atomics at every block change, kept as the independent cross-check. The
        block-major one is the default since 2026-11-27: its GPU tests passed (bf16, fp16, fp32;
        compute-sanitizer clean) and the H100 timed it at 2.75x (8k) and 2.81x (64k) less time than the
        query-major backward, 2.0x fla's speed for the branch's forward + backward
        (results/*-slc-bwd.json).
    slc_bwd_chunk, slc_bwd_rows, slc_bwd_stages: the block-major dK/dV kernel's queries per work item,
        rows of its query tile and software-pipelining stages, for sweeps; None takes the tuned
        launch shape (``selected.BLOCK_MAJOR_CHUNK``, ``BLOCK_MAJOR_ROWS``, ``BLOCK_MAJOR_STAGES`` on
        a GPU in fp16 / bf16, with the measurements behind them; smaller ones in fp32 and under the
        interpreter). A value given is used as it is, under the interpreter too (the CPU tests set
        small chunks so that a block's queries span several work items).
    fused_gate: Eq. 5's gated sum as one Triton kernel (``gate.gated_sum_fused``) instead of five
        PyTorch ops (for head dims that are powers of two: all the kernels take). On since its first
        H100 run (2026-11-25): ``test_gpu_fused_gated_sum_bf16`` passed, and the 64k breakdown timed
        it at 1.40 ms against 6.13 ms for the PyTorch ops (which read and write 1 GB tensors eight
        times).
    window_kernel: the sliding-window branch's kernels. "strided" (``compression.py``'s strided
        kernels at stride 1: the window forward at 44% of cuDNN's rate per FLOP on an H100 at 64k,
        2026-11-27), or "fa4": ``repro.fa4``'s attention with a sliding window, (w - 1, 0) in
        flash-attn's terms (issue #39). Off by default: repro.fa4's window is new code that has not run
        on a GPU (``window.fa4_window_available`` says whether this checkout's repro.fa4 has one); the
        bench times it as its ``nsa-fa4win`` rows.
    window_bwd_heads, cmp_bwd_heads: query heads of a GQA group that one program of the strided
        dK/dV kernel walks, for the window and the compressed branch (1: a program per query head,
        the kernel before 2026-11-29; values above the group are clamped to it). One program loads
        its key tile once and adds into fp32 dK/dV once for all its heads, instead of once per head.
        On an H200 at the paper's shape, T = 16k (2026-11-29, lab/breakdown.py --pass bwd,
        results/*-T16384-heads-w*.json): the window's backward 11.02 ms at 1 head a program, 8.97 at
        the whole group (16: the default); the compressed branch's 9.44 ms at 1 (the default) and
        11.48 at 4, its key tiles few (T / 16 keys) and its query loops long already.
    """

    strided_split: bool = True
    strided_bwd_split: bool = True
    cmp_bwd_reverse: bool = True
    strided_fwd_tile: tuple[int, int, int, int] | None = None
    scores_tile: tuple[int, int, int, int] | None = None
    fused_topk: bool = True
    slc_backward: str = "block-major"
    slc_bwd_chunk: int | None = None
    slc_bwd_rows: int | None = None
    slc_bwd_stages: int | None = None
    fused_gate: bool = True
    window_kernel: str = "strided"
    window_bwd_heads: int = 16
    cmp_bwd_heads: int = 1

    def __post_init__(self) -> None:
        if self.slc_backward not in SLC_BACKWARDS:
            raise ValueError(
                f"Switches: slc_backward = {self.slc_backward!r}, expected one of {SLC_BACKWARDS}"
            )
        if self.window_kernel not in WINDOW_KERNELS:
            raise ValueError(
                f"Switches: window_kernel = {self.window_kernel!r}, expected one of {WINDOW_KERNELS}"
            )
        for name in ("strided_fwd_tile", "scores_tile"):
            tile = getattr(self, name)
            if tile is not None and (len(tile) != 4 or not all(isinstance(x, int) and x >= 1 for x in tile)):
                raise ValueError(f"Switches: {name} = {tile!r}, expected four positive ints or None")
        for name in ("window_bwd_heads", "cmp_bwd_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Switches: {name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("slc_bwd_chunk", "slc_bwd_rows", "slc_bwd_stages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"Switches: {name} must be >= 1, got {getattr(self, name)}")
