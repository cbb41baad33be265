"""A warp-specialised FlashAttention forward for Hopper (sm_90a) in Gluon, FA3's schedule.

Triton's ``tl`` cannot give warps roles; Gluon (``triton.experimental.gluon``, Triton 3.6) can. One
program (CTA) owns ``NUM_CONSUMERS`` query tiles of ``BLOCK_M`` rows of one head and runs:

* a load partition (1 warp): TMA copies of the Q tiles once, then K and V tiles into a ring of
  ``NUM_STAGES`` shared-memory buffers; each buffer has a "ready" mbarrier (expect-tx: it completes
  when the bytes have landed) and an "empty" mbarrier that every consumer arrives on once it is
  done with the buffer (count = NUM_CONSUMERS);
* consumer warpgroups (4 warps each; the default partition is consumer 0, a worker partition is
  consumer 1): S = Q K^T by asynchronous ``warpgroup_mma`` into registers, online softmax in base 2
  (scale * log2 e folded into one FMA), P cast to the input dtype and fed from registers as the A
  operand of O += P V. Each consumer overlaps its own work as FA3's "intra-warpgroup overlap" does:
  S_{j+1} = Q K_{j+1}^T and O += P_j V_j are both in flight while the softmax of S_{j+1} runs, and
  O is rescaled after the P V product lands. The two consumers share every K/V load and run
  independently, so one's softmax overlaps the other's matmuls (FA3's ping-pong). ``pingpong_sync``
  (the launcher's default) also forces the alternation, as FA3's named barriers do, with two "turn"
  mbarriers; ``attention(..., gluon=True)`` launches without them (``repro.fa4.api.GLUON_LAUNCH``): on
  an H100 dropping them changed the forward by -1.3% to +2.3% (results/*-gluon-combos.json), the
  warp schedulers interleaving the two consumers well enough on their own.

Causal masks are bottom-right aligned (row i sees keys j <= i + S_K - S_Q, S_Q <= S_K). Key tiles
that no row of a consumer sees are skipped by that consumer (it still releases their buffers);
only key tiles that cross the diagonal or the end of the keys are masked.

Layout: q, k, v, o are [B, S, H, D]; TMA descriptors view q as [B * S_Q, H * D] and k, v as
[B * S_K, H_KV * D]. Rows past a batch's end read the next batch (or zeros past the tensor): key
columns past S_K are masked to -inf, query rows past S_Q are never stored. The output is stored
from registers with a row mask, or (``store_tma=True``) through the Q tile's shared memory by a TMA
store where the tile is full (rows past S_Q would be the next batch's), masked otherwise. LSE is
[B, H, S_Q] float32 in base 2 (m + log2 l, m in units of scores * scale * log2 e), exactly what
every backward of this package reads. The offline sm_90a compile report of this kernel (shared
memory, registers, spills; no GPU) is ``repro.fa4.lab.compile`` (kernel "gluon_fwd").
"""

from __future__ import annotations

import math

import torch

try:  # Gluon ships with Triton >= 3.5; without it only the launcher's error message is left.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAS_GLUON = True
    GLUON_ERROR = ""
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON = False
    GLUON_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = [
    "GLUON_DTYPES",
    "GLUON_HEAD_DIMS",
    "HAS_GLUON",
    "KNOBS",
    "gluon_attention_forward",
    "launch_config",
]

GLUON_HEAD_DIMS = (64, 128, 256)
GLUON_DTYPES = (torch.bfloat16, torch.float16)
#: D -> (BLOCK_M rows per consumer warpgroup, BLOCK_N keys per tile, NUM_STAGES K/V buffers).
#: 64 rows per warpgroup keeps S (64 x 128 fp32), the next P and O (64 x D fp32) in registers, as
#: FA3 does (its 128-row tile is two warpgroups of 64). Shared memory at D = 128: Q 2 x 16 KiB +
#: 2 stages x (K + V) 64 KiB = 160 KiB (3 stages: 224 KiB, just inside 227 KiB); at D = 64:
#: 16 KiB + 3 x 32 KiB = 112 KiB. At D = 256 O is 128 registers a thread, so 64-key tiles (S 32
#: registers; 128-key ones spill ~550 bytes) and two stages: Q 64 KiB + 2 x 64 KiB = 192 KiB.
GLUON_DEFAULTS = {64: (64, 128, 3), 128: (64, 128, 2), 256: (64, 64, 2)}
NUM_CONSUMERS = 2
#: Registers per thread asked for (setmaxnreg) by the load warp and by the worker consumer.
LOAD_REGS = 24
CONSUMER_REGS = 240


#: Launch knobs (keyword arguments of the launcher, constexprs of the kernel), each with its reason:
#: block_n: keys per K/V tile (64 halves the S registers and the stage size, so more stages fit;
#:   128 is FA3's choice at D = 128; ``gl.arange`` needs a power of 2, so no 176, and 256 at
#:   D = 128 needs 288 KiB of shared memory and spills);
#: num_stages: depth of the K/V ring (3 at D = 128 hides more TMA latency: Q 32 KiB + 3 x 64 KiB
#:   = 224 KiB, inside the 227 KiB per block);
#: store_tma: O through shared memory (the Q tile) and a TMA store, as FA3 does, for full tiles only;
#: load_regs / consumer_regs: setmaxnreg of the load warp and the worker consumer (the default
#:   consumer gets what the launch allocation leaves).
KNOBS = ("block_n", "num_stages", "store_tma", "load_regs", "consumer_regs")


def launch_config(d: int, block_n: int | None = None, num_stages: int | None = None) -> dict:
    bm, bn, ns = GLUON_DEFAULTS[d]
    bn = bn if block_n is None else int(block_n)
    ns = ns if num_stages is None else int(num_stages)
    if bn not in (64, 128):
        # 256 compiles but needs 288 KiB of shared memory at D = 128 and spills ~1 KiB; 176 is no power of 2
        raise ValueError(f"gluon forward: block_n must be 64 or 128, got {bn}")
    if ns < 1:
        raise ValueError(f"gluon forward: num_stages must be >= 1, got {ns}")
    return dict(BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=ns, NUM_CONSUMERS=NUM_CONSUMERS)


def _constexprs(
    d: int,
    causal: bool,
    lazy_rescale: bool,
    rescale_threshold: float,
    num_consumers: int,
    pingpong_sync: bool,
    block_n: int | None,
    num_stages: int | None,
    store_tma: bool,
    load_regs: int,
    consumer_regs: int,
) -> dict:
    """The kernel's constexpr arguments, shared by the launcher and the offline compile."""
    if num_consumers not in (1, 2):
        raise ValueError(f"gluon forward: num_consumers must be 1 or 2, got {num_consumers}")
    for name, r in (("load_regs", load_regs), ("consumer_regs", consumer_regs)):
        if not (24 <= r <= 256 and r % 8 == 0):
            raise ValueError(
                f"gluon forward: {name} must be a multiple of 8 in [24, 256] (setmaxnreg), got {r}"
            )
    cfg = launch_config(d, block_n, num_stages)
    return dict(
        D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"],
        NUM_CONSUMERS=num_consumers, CAUSAL=bool(causal), LAZY_RESCALE=bool(lazy_rescale),
        RESCALE_TAU=float(rescale_threshold), PINGPONG_SYNC=bool(pingpong_sync) and num_consumers == 2,
        LOAD_REGS=int(load_regs), CONSUMER_REGS=int(consumer_regs), STORE_TMA=bool(store_tma),
    )  # fmt: skip


if HAS_GLUON:

    @gluon.jit
    def _load_partition(
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        q_row0,
        q_col,
        kv_row0,
        kv_col,
        n_blocks,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
    ):
        """One warp: the Q tiles once, then K_j, V_j for every key tile of this program."""
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [q_row0 + c * BLOCK_M, q_col], q_ready.index(c), q_smem.index(c)
            )
        for j in range(n_blocks):
            s = j % NUM_STAGES
            # The n-th reuse of a buffer waits for the n-th completion of its empty barrier; the
            # first use waits on parity 1 of a fresh barrier, which passes at once.
            ph = ((j // NUM_STAGES) & 1) ^ 1
            row = kv_row0 + j * BLOCK_N
            mbarrier.wait(k_empty.index(s), ph)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), ph)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _mask_scores(s, start_n, row0, S_K, diag, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = gl.expand_dims(cols < S_K, 0)
        if CAUSAL:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + diag, 1))
        return gl.where(ok, s, float("-inf"))

    @gluon.jit
    def _turn_begin(turn, k, n_first, CONSUMER: gl.constexpr, PINGPONG_SYNC: gl.constexpr):
        """Wait until it is this consumer's k-th turn to issue its matmuls (FA3's warp-scheduler
        barrier, with mbarriers): turns alternate 0, 1, 0, 1, ... while both consumers still have
        turns; consumer 0 has n_first + 1 turns, consumer 1 at least as many."""
        if PINGPONG_SYNC:
            if CONSUMER == 0:
                # the (k-1)-th arrival of consumer 1; consumer 1 always has a (k-1)-th turn
                mbarrier.wait(turn.index(0), (k - 1) & 1, pred=k >= 1)
            else:
                # the k-th arrival of consumer 0, while it still has turns
                mbarrier.wait(turn.index(1), k & 1, pred=k < n_first + 1)

    @gluon.jit
    def _turn_end(turn, k, n_first, CONSUMER: gl.constexpr, PINGPONG_SYNC: gl.constexpr):
        """Hand the tensor cores to the other consumer after issuing this turn's matmuls."""
        if PINGPONG_SYNC:
            if CONSUMER == 0:
                mbarrier.arrive(turn.index(1), count=1)
            else:
                # only arrivals that consumer 0 will wait for (its turns k + 1 <= n_first)
                mbarrier.arrive(turn.index(0), count=1, pred=k + 1 < n_first + 1)

    @gluon.jit
    def _store_rows(O, out, o_row0, o_col, stride_os, row0, S_Q, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                    D: gl.constexpr):  # fmt: skip
        """Masked register store of a [BLOCK_M, D] output tile, rows past S_Q left alone."""
        rows_o = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        offs = (
            (o_row0 + gl.expand_dims(rows_o, 1)).to(gl.int64) * stride_os + o_col + gl.expand_dims(cols_o, 0)
        )
        gl.store(O + offs, out, mask=gl.expand_dims(rows_o < S_Q, 1))

    @gluon.jit
    def _consume(
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        O,
        o_desc,
        LSE,
        lse_base,
        o_row0,
        o_col,
        stride_os,
        row0,
        S_Q,
        S_K,
        n_blocks,
        turn,
        n_first,
        qk_scale,
        CONSUMER: gl.constexpr,
        D: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        LAZY_RESCALE: gl.constexpr,
        RESCALE_TAU: gl.constexpr,
        PINGPONG_SYNC: gl.constexpr,
        STORE_TMA: gl.constexpr,
    ):
        """Consumer warpgroup CONSUMER (0: the default partition, 1: the worker): query rows
        [row0 + CONSUMER * BLOCK_M, + BLOCK_M) of this program's head."""
        if CONSUMER == 1:
            row0 = row0 + BLOCK_M
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_smem.dtype

        # Key range of this warpgroup: causal rows see keys < row + diag + 1.
        diag = S_K - S_Q
        if CAUSAL:
            hi = gl.minimum(row0 + BLOCK_M + diag, S_K)
            # first key tile that some row of this tile must mask
            mask_from = gl.maximum(gl.minimum(row0 + diag + 1, S_K) // BLOCK_N, 0) * BLOCK_N
            mask_from = gl.minimum(mask_from, (S_K // BLOCK_N) * BLOCK_N)
        else:
            hi = S_K
            mask_from = (S_K // BLOCK_N) * BLOCK_N
        my_blocks = gl.cdiv(hi, BLOCK_N)

        q_tile = q_smem.index(CONSUMER)
        mbarrier.wait(q_ready.index(CONSUMER), 0)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        # Prologue: tile 0's scores and probabilities.
        _turn_begin(turn, 0, n_first, CONSUMER, PINGPONG_SYNC)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _turn_end(turn, 0, n_first, CONSUMER, PINGPONG_SYNC)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(0), count=1)
        if mask_from == 0:
            s = _mask_scores(s, 0, row0, S_K, diag, s_layout, BLOCK_M, BLOCK_N, CAUSAL)
        m_i = gl.max(s, axis=1) * qk_scale
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

        for j in range(1, my_blocks):
            s_idx = j % NUM_STAGES
            ph = (j // NUM_STAGES) & 1
            prev = (j - 1) % NUM_STAGES
            prev_ph = ((j - 1) // NUM_STAGES) & 1
            # S_j = Q K_j^T and O += P_{j-1} V_{j-1}, both asynchronous, in that order.
            _turn_begin(turn, j, n_first, CONSUMER, PINGPONG_SYNC)
            mbarrier.wait(k_ready.index(s_idx), ph)
            s_tok = warpgroup_mma(
                q_tile, k_smem.index(s_idx).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            mbarrier.wait(v_ready.index(prev), prev_ph)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            _turn_end(turn, j, n_first, CONSUMER, PINGPONG_SYNC)
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # S_j has landed; P V may still run
            mbarrier.arrive(k_empty.index(s_idx), count=1)
            if j * BLOCK_N >= mask_from:
                s = _mask_scores(s, j * BLOCK_N, row0, S_K, diag, s_layout, BLOCK_M, BLOCK_N, CAUSAL)
            m_cand = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            if LAZY_RESCALE:
                # FA4: keep the stale max unless it grew by more than tau (log2 units), row by row;
                # P <= 2^tau then, and O / l is exact because O and l share the stale max.
                m_new = gl.where(m_cand - m_i > RESCALE_TAU, m_cand, m_i)
            else:
                m_new = m_cand
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p_next = gl.convert_layout(p.to(dtype), p_layout)
            # P_{j-1} (a register operand of the P V product in flight) stays alive until it lands.
            acc, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            m_i = m_new
            p_op = p_next

        last = my_blocks - 1
        _turn_begin(turn, my_blocks, n_first, CONSUMER, PINGPONG_SYNC)
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
        _turn_end(turn, my_blocks, n_first, CONSUMER, PINGPONG_SYNC)
        acc, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(last % NUM_STAGES), count=1)

        # Key tiles the other consumer still needs: release them once loaded (waiting for "ready"
        # first keeps the arrivals in the phase they belong to).
        for j in range(my_blocks, n_blocks):
            s_idx = j % NUM_STAGES
            ph = (j // NUM_STAGES) & 1
            mbarrier.wait(k_ready.index(s_idx), ph)
            mbarrier.arrive(k_empty.index(s_idx), count=1)
            mbarrier.wait(v_ready.index(s_idx), ph)
            mbarrier.arrive(v_empty.index(s_idx), count=1)

        # Epilogue: O / l and the base-2 log-sum-exp, rows past S_Q left alone.
        l_o = gl.convert_layout(l_i, row_o)
        out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
        if STORE_TMA:
            # FA3's epilogue: O through shared memory (the Q tile, no longer read) and one TMA store.
            # The descriptor spans all batches, so only a full tile may use it: a partial tile's rows
            # past S_Q are the next batch's first rows. Partial tiles take the masked store.
            if row0 + BLOCK_M <= S_Q:
                q_tile.store(out)
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [o_row0 + row0, o_col], q_tile)
                tma.store_wait(0)
            else:
                _store_rows(O, out, o_row0, o_col, stride_os, row0, S_Q, o_layout, BLOCK_M, D)
        else:
            _store_rows(O, out, o_row0, o_col, stride_os, row0, S_Q, o_layout, BLOCK_M, D)
        rows_s = row0 + gl.arange(0, BLOCK_M, layout=row_s)
        gl.store(LSE + lse_base + rows_s, m_i + gl.log2(l_i), mask=rows_s < S_Q)

    @gluon.jit
    def _gluon_fwd_kernel(
        q_desc,
        k_desc,
        v_desc,
        O,
        o_desc,
        LSE,
        H,
        GROUP,
        S_Q,
        S_K,
        qk_scale,
        N_M_BLOCKS,
        D: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
        CAUSAL: gl.constexpr,
        LAZY_RESCALE: gl.constexpr,
        RESCALE_TAU: gl.constexpr,
        PINGPONG_SYNC: gl.constexpr,
        LOAD_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        STORE_TMA: gl.constexpr,
    ):
        m_block = N_M_BLOCKS - 1 - gl.program_id(0)  # heaviest causal tiles launch first
        bh = gl.program_id(1)
        off_b = bh // H
        off_h = bh % H
        off_hk = off_h // GROUP
        row0 = m_block * (NUM_CONSUMERS * BLOCK_M)
        if CAUSAL:
            hi = gl.minimum(row0 + NUM_CONSUMERS * BLOCK_M + S_K - S_Q, S_K)
        else:
            hi = S_K
        n_blocks = gl.cdiv(hi, BLOCK_N)
        if CAUSAL:  # key tiles of consumer 0 (the first BLOCK_M rows), for the ping-pong turn count
            n_first = gl.cdiv(gl.minimum(row0 + BLOCK_M + S_K - S_Q, S_K), BLOCK_N)
        else:
            n_first = n_blocks

        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D], v_desc.layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
            mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
        fence_async_shared()  # the initialised barriers are visible to the TMA engine (async proxy)

        q_row0 = off_b * S_Q + row0
        kv_row0 = off_b * S_K
        o_row0 = off_b * S_Q
        stride_os = H * D
        lse_base = bh * S_Q
        # The argument tuples are written out in the call: a tuple bound to a name first turns its
        # constexpr entries into tensors (Triton 3.6), and the partitions need them as constexprs.
        if NUM_CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (_consume, (
                        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, O, o_desc, LSE,
                        lse_base, o_row0, off_h * D, stride_os, row0, S_Q, S_K, n_blocks, turn, n_first, qk_scale, 0,
                        D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, LAZY_RESCALE, RESCALE_TAU, PINGPONG_SYNC, STORE_TMA,
                    )),
                    (_load_partition, (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty,
                        v_empty, q_row0, off_h * D, kv_row0, off_hk * D, n_blocks,
                        BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                    )),
                    (_consume, (
                        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, O, o_desc, LSE,
                        lse_base, o_row0, off_h * D, stride_os, row0, S_Q, S_K, n_blocks, turn, n_first, qk_scale, 1,
                        D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, LAZY_RESCALE, RESCALE_TAU, PINGPONG_SYNC, STORE_TMA,
                    )),
                ],
                [1, 4],
                [LOAD_REGS, CONSUMER_REGS],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                    (_consume, (
                        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, O, o_desc, LSE,
                        lse_base, o_row0, off_h * D, stride_os, row0, S_Q, S_K, n_blocks, turn, n_first, qk_scale, 0,
                        D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, LAZY_RESCALE, RESCALE_TAU, PINGPONG_SYNC, STORE_TMA,
                    )),
                    (_load_partition, (
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty,
                        v_empty, q_row0, off_h * D, kv_row0, off_hk * D, n_blocks,
                        BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                    )),
                ],
                [1],
                [LOAD_REGS],
            )  # fmt: skip


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def gluon_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    lazy_rescale: bool = False,
    rescale_threshold: float = 8.0,
    num_consumers: int = NUM_CONSUMERS,
    pingpong_sync: bool = True,
    block_n: int | None = None,
    num_stages: int | None = None,
    store_tma: bool = False,
    load_regs: int = LOAD_REGS,
    consumer_regs: int = CONSUMER_REGS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward by the Gluon kernel: returns (o [B, S_q, H, D], lse [B, H, S_q] float32, base 2).

    q: [B, S_q, H, D]; k, v: [B, S_k, H_kv, D], H_kv dividing H, D in {64, 128, 256}, bf16 or fp16, on
    an sm_90 (Hopper) GPU; causal needs S_q <= S_k (bottom-right aligned). ``lse`` is
    m + log2(l) with m in units of scores * scale * log2(e), as ``repro.fa4``'s backward expects.
    block_n, num_stages (None: GLUON_DEFAULTS), store_tma, load_regs, consumer_regs: see KNOBS.
    """
    if not HAS_GLUON:
        raise RuntimeError(f"gluon forward: this Triton has no Gluon ({GLUON_ERROR})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"gluon forward: {name} must be [B, S, H, D], got shape {tuple(t.shape)}")
        if t.device.type != "cuda":
            raise RuntimeError(f"gluon forward: needs CUDA tensors, {name} is on {t.device}")
        if t.dtype not in GLUON_DTYPES:
            raise TypeError(f"gluon forward: {name} has dtype {t.dtype}, expected bfloat16 or float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"gluon forward: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"gluon forward: written for Hopper (sm_90a: wgmma, TMA, setmaxnreg); this GPU is sm_{major}{minor}"
        )
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if d not in GLUON_HEAD_DIMS:
        raise ValueError(
            f"gluon forward: head dim D = {d} is not supported, expected one of {GLUON_HEAD_DIMS}"
        )
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"gluon forward: k, v must be [B={b}, S_k, H_kv, D={d}], got {tuple(k.shape)}")
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"gluon forward: KV heads H_kv = {h_kv} must divide query heads H = {h}")
    if causal and s_q > s_k:
        raise ValueError(f"gluon forward: causal needs S_q <= S_k, got S_q = {s_q}, S_k = {s_k}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cx = _constexprs(
        d, causal, lazy_rescale, rescale_threshold, num_consumers, pingpong_sync,
        block_n, num_stages, store_tma, load_regs, consumer_regs,
    )  # fmt: skip
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s_q, device=q.device, dtype=torch.float32)
    bm, bn = cx["BLOCK_M"], cx["BLOCK_N"]
    gdt = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, d], gdt)
    q2, o2 = q.view(b * s_q, h * d), o.view(b * s_q, h * d)
    q_desc, o_desc = (
        TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [bm, d], q_layout) for t2 in (q2, o2)
    )
    k_desc, v_desc = (
        TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [bn, d], kv_layout)
        for t2 in (k.view(b * s_k, h_kv * d), v.view(b * s_k, h_kv * d))
    )
    n_m = -(-s_q // (num_consumers * bm))
    _gluon_fwd_kernel[(n_m, b * h)](
        q_desc, k_desc, v_desc, o, o_desc, lse, h, h // h_kv, s_q, s_k, scale / math.log(2.0), n_m,
        **cx, num_warps=4,
    )  # fmt: skip
    return o, lse
