"""A warp-specialised attention backward for Hopper (sm_90a) in Gluon: FA3's schedule (``bwd="gluon"``).

The Triton one-pass backward (``repro.fa4.triton_bwd_fused``) runs FA3's 5-matmul schedule as one
instruction stream and keeps dK and dV of 128 keys in one program's registers: at D = 128 every
tile spills (630-780 bytes, offline sm_90a compile). This kernel gives warps roles, as FA3 does
(shah2024flashattention3, the backward section), and splits the key block over two warpgroups:

* one program per (key block of BLOCK_N = 128 keys, KV head, batch); K and V of the block are
  loaded once by TMA;
* a load partition (1 warp) walks the query tiles of the KV head's group of query heads (GQA) and
  copies Q, dO (tiles of BLOCK_M = 64 rows) and the matching LSE and delta vectors by TMA into a
  ring of NUM_STAGES shared-memory stages; per stage a "Q ready" and a "dO ready" mbarrier
  (expect-tx) and an "empty" one that both consumers release;
* two consumer warpgroups (the default partition and a worker), consumer c owning keys
  [n0 + 64 c, n0 + 64 c + 64): each holds dK_c and dV_c, [64, D] fp32, in registers for the whole
  loop (64 registers per thread each at D = 128: half of what one 128-key program holds), and per
  query tile runs, as asynchronous wgmma (A = K_c / V_c from shared memory, or P / dS from registers):

      S^T_c  = K_c Q^T                        [64, BLOCK_M]
      P^T_c  = 2^(S^T_c * scale * log2 e - LSE)   (the forward's base-2 log-sum-exp; masked)
      dV_c  += P^T_c dO
      dP^T_c = V_c dO^T
      dS^T_c = P^T_c (dP^T_c - delta)
      dK_c  += dS^T_c Q
      dQ[:, D/2 c : D/2 (c + 1)] += scale * dS K[:, D/2 c : D/2 (c + 1)]

  The last product needs dS over all 128 keys: each consumer writes its dS^T_c (bf16/fp16) into a
  double-buffered [128, BLOCK_M] shared tile and arrives on that buffer's mbarrier; once both have,
  each computes half of dQ's columns from the whole tile (A = dS, the tile read transposed; B =
  K's column half), FA3's split of the dQ matmul over its two warpgroups.

dQ accumulation, into the fp32 buffer that ``triton_bwd_fused``'s preprocess kernel zeroes (cast by
the caller), each consumer for its own [BLOCK_M, D/2] half, no two consumers adding the same
element, by one of two means (``dq_tma``, ``Switches.bwd_dq_tma``):

* TMA bulk reductions (DQ_TMA, the default since its H100 run of 2026-11-27: the 16-case GPU matrix
  passed, compute-sanitizer clean, forward + backward 0.99-1.05x cuDNN at S = 4k-16k where the atomic
  adds gave 0.77-0.84x: results/nvidia-h100-80gb-hbm3-bwd-gluon-dq.json), FA3's way: each consumer
  writes its scaled dQ half into a [BLOCK_M, D/2] fp32 staging tile in shared memory and one thread
  adds the tile to the dQ buffer with a TMA bulk reduction
  (``cp.reduce.async.bulk.tensor.2d.global.shared::cta.add``). Gluon's public ``hopper.tma`` in
  Triton 3.6 has copies and stores only, but the op exists below it (``ttng.async_tma_reduce``, which
  ``tl`` descriptors' ``atomic_add`` lowers to) and the Gluon IR builder exposes it
  (``create_async_tma_reduce``): ``_tma_reduce_add`` is a ten-line ``@builtin`` over it, written as
  Gluon's own ``async_copy_shared_to_global`` is. Before the tile is rewritten the next step waits for
  the reduction's reads (``tma.store_wait(0)``, i.e. ``cp.async.bulk.wait_group.read 0``) and a
  warpgroup barrier; after writing it, a ``fence.proxy.async`` and a barrier, then the reduction and
  its bulk-group commit. At D = 128 the box's 64 fp32 columns exceed the 128-byte swizzle, so Triton
  issues two [64, 32] reductions per tile from two warps (the host descriptor gets the same box from
  the compiled metadata). The staging tiles add 32 KiB of shared memory (D = 128: 193 KiB in all).
* fp32 atomic adds (``gl.atomic_add``, relaxed: ``red.global.add``; ``dq_tma=False``): the previous
  default, kept as the cross-check.

A third variant, the dQ product deferred by one step so that the dS^T exchange's barrier leaves the
critical path, gave wrong dQ on an H100 (relative error 1.27-1.41 against the FA2 backward at every
shape of its D = 128 fp16 sweep, 2026-11-27) and was deleted; so were the bisect's SKIP bits that
located the first fault (results/*-gluon-bwd-sweep.json and *-boundary-pad-*.json keep those runs;
the API refuses ``bwd_dq_defer``). The per-process GPU sweep of this kernel is ``repro.fa4.lab.gluon_bwd_sweep``,
its offline compile report ``repro.fa4.lab.compile`` (kernel "gluon_bwd").

Causal (bottom-right aligned, diag = S_K - S_Q): query tiles before the first row that sees key n0
are skipped (the load warp never loads them); a consumer masks a tile only where its keys cross the
diagonal, the keys end (S_K) or the queries end (S_Q). TMA reads past a batch's last query row
return the next batch's rows (and the LSE / delta of the next head): those columns are masked to
P = 0, so they add nothing to dK, dV, and no dQ is added for them. Causal needs S_Q <= S_K (the
public entry point splits off the rows that see no key).

Head size 256 (``_gluon_bwd_d256_kernel``, issue #42). dK_c and dV_c of 64 keys x 256 columns would be
256 registers a thread, so a program takes BLOCK_N = 64 keys and the two consumers split the work by
product instead of by keys, each holding one [64, 256] fp32 accumulator (128 registers a thread):

* consumer 0 (the default partition): S^T = K Q^T, P^T (masked), P^T (16-bit) into a double-buffered
  [64, BLOCK_M] exchange tile, dV += P^T dO;
* consumer 1 (a worker): dP^T = V dO^T, then, with consumer 0's P^T read back from the tile,
  dS^T = P^T (dP^T - delta) into a second exchange tile, dK += dS^T Q;
* each: dQ[:, D/2 c : D/2 (c + 1)] += scale * dS K[:, D/2 c : ...] from the dS^T tile.

Each consumer issues 2.5 of the 5 products' FLOPs (none is computed twice); P^T travels one way and dS^T
the other, each through shared memory with a "ready" mbarrier per buffer (count 1), and a buffer's reuse
two steps on is ordered by the opposite barrier of the step between. P^T is rounded to 16 bits before
consumer 1 multiplies it (the D <= 128 kernel keeps it in fp32): dq and dk errors 1.23x the Triton
one-pass kernel's, dv's equal (lab/gluon_bwd_d256_check.py, H200, 2026-11-29). Shared memory: K + V
64 KiB, P^T and dS^T 2 x 2 x 8 KiB, and either two Q/dO stages (128 KiB, dQ by atomics) or one stage and
the dQ staging tiles (64 + 64 KiB, dQ by TMA bulk reductions; D256_TMA_STAGES): 225 KiB. The bulk
reductions, the default, ran the backward at 1.00-1.25x cuDNN's on an H200 (bf16, B 2, H 16, S 4k/8k,
causal or not) where the atomics ran 0.72-0.85x and the Triton one-pass kernel 0.34-0.37x.

Layout: q, do, dq [B, S_Q, H, D]; k, v, dk, dv [B, S_K, H_KV, D]; TMA descriptors view q and do as
[B * S_Q, H * D], k and v as [B * S_K, H_KV * D], lse and delta ([B, H, S_Q] fp32) as one vector.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from repro.fa4.gluon_fwd import GLUON_DTYPES, GLUON_ERROR, HAS_GLUON

if HAS_GLUON:
    from triton._C.libtriton import ir as _triton_ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = [
    "DQ_TMA",
    "GLUON_BWD_DEFAULTS",
    "check_device",
    "gluon_attention_backward",
    "pad_stats",
]

#: D -> (BLOCK_M query rows per step, NUM_STAGES of the Q/dO ring). BLOCK_N = 128 keys per program
#: (64 per consumer warpgroup), FA3's tile at D = 128 (its 64 x 128 causal tile). Shared memory at
#: D = 128: K + V 64 KiB, 2 stages x (Q + dO) 64 KiB, dS 2 x 16 KiB = 160 KiB; at D = 64: 96 KiB.
#: Registers per consumer thread at D = 128: dK + dV 128, S^T and dP^T 32 each, the dQ half 32.
#: D = 256 (its own kernel, ``_gluon_bwd_d256_kernel``): 64 keys per program, 64 query rows per step;
#: two stages with the dQ atomics (K + V 64 KiB, 2 x (Q + dO) 128 KiB, P^T and dS^T 2 x 2 x 8 KiB =
#: 224 KiB), one with the bulk reductions (their staging tiles, 2 x [64, 128] fp32, take 64 KiB):
#: D256_TMA_STAGES.
GLUON_BWD_DEFAULTS = {64: (64, 2), 128: (64, 2), 256: (64, 2)}
BLOCK_N = 128
#: Keys per program at D = 256: dV or dK of 64 keys x 256 columns is 128 fp32 registers per thread.
BLOCK_N_D256 = 64
#: Q/dO stages at D = 256 with dQ by TMA bulk reductions (two do not fit in 227 KiB beside the staging).
D256_TMA_STAGES = 1
NUM_CONSUMERS = 2
#: Registers per thread (setmaxnreg) of the load warp and of the worker consumer, as in the forward.
LOAD_REGS = 24
CONSUMER_REGS = 240

#: dQ by TMA bulk reductions (see the module docstring) unless the caller says otherwise: the
#: default since its H100 run of 2026-11-27; ``dq_tma=False`` (``Switches(bwd_dq_tma=False)``) is the
#: atomic-add cross-check. A constant: ``api.resolve`` writes it into the resolved Switches, and the
#: launcher runs what the config says.
DQ_TMA = True


if HAS_GLUON:

    @_gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into global memory at ``coord`` of ``tensor_desc`` with one
        TMA bulk reduction (``cp.reduce.async.bulk.tensor.*.global.shared::cta.add``, asynchronous:
        ``tma.store_wait`` before ``src`` is written again). Triton 3.6 builds this op
        (``ttng.async_tma_reduce``, what ``tl`` descriptors' ``atomic_add`` lowers to) and its Gluon
        builder has ``create_async_tma_reduce``, but ``gluon.language.nvidia.hopper.tma`` exports no
        wrapper for it: this is that wrapper, written as ``tma.async_copy_shared_to_global`` is."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(
            _triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
        )

    @gluon.jit
    def _dq_bulk_add(dq_desc, dq_stage, dq, row, col):
        """One consumer warpgroup's [BLOCK_M, D/2] dQ part (fp32, scaled) added to the dQ buffer by a
        TMA bulk reduction from its staging tile. The previous reduction must have finished reading the
        tile (the wait is on the thread that issued it, so a barrier follows it), and every thread's
        writes must be visible to the TMA unit (the async proxy) before the one issuing thread starts."""
        tma.store_wait(0)
        gl.thread_barrier()
        dq_stage.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        _tma_reduce_add(dq_desc, [row, col], dq_stage)

    @gluon.jit
    def _dq_add(DQACC, dq_stage, dq, sm_scale, off_b, m, off_h, S_Q, H, dq_row_offs, dq_cols, dq_rows0,
                CONSUMER: gl.constexpr, D: gl.constexpr, DQ_TMA: gl.constexpr):  # fmt: skip
        """Add one consumer's dQ part, times sm_scale (rows [m, + BLOCK_M) of query head off_h, its D/2 columns)
        to the fp32 dQ buffer: by a TMA bulk reduction (DQ_TMA; DQACC a descriptor) or by per-element
        relaxed atomics (``red.global.add``; DQACC a pointer), rows past S_Q masked."""
        if DQ_TMA:
            _dq_bulk_add(DQACC, dq_stage, dq * sm_scale, off_b * S_Q + m, off_h * D + CONSUMER * (D // 2))
        else:
            # a 64-bit scalar base, a row pointer per row and the columns as immediates (a 64-bit
            # offset per element held 64 more registers and spilled)
            dq_base = DQACC + ((off_b * S_Q + m).to(gl.int64) * H + off_h) * D
            gl.atomic_add(
                (dq_base + dq_row_offs) + gl.expand_dims(dq_cols, 0),
                dq * sm_scale,
                mask=gl.expand_dims(dq_rows0 < S_Q - m, 1),
                sem="relaxed",
            )

    @gluon.jit
    def _bwd_load_partition(
        q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc,
        q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
        kv_ready, q_ready, do_ready, empty,
        q_row0, kv_row, kv_col, stat_row0, h0, m_lo, total, S_Q, S_STAT,
        D: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """One warp: K and V of the key block once, then (Q, LSE) and (dO, delta) of every step."""
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_ready, k_smem)
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_ready, v_smem)
        start_m = m_lo
        off_h = h0  # query head: the group's first, then the next after each pass over the tiles
        for it in range(total):
            st = it % NUM_STAGES
            # the n-th reuse of a stage waits for the n-th completion of its empty barrier; a fresh
            # barrier passes parity 1 at once
            ph = ((it // NUM_STAGES) & 1) ^ 1
            stat = (stat_row0 + off_h) * S_STAT + start_m  # LSE / delta rows are S_STAT long
            q_col = off_h * D
            mbarrier.wait(empty.index(st), ph)
            mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [q_row0 + start_m, q_col], q_ready.index(st), q_smem.index(st)
            )
            tma.async_copy_global_to_shared(lse_desc, [stat], q_ready.index(st), lse_smem.index(st))
            mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                do_desc, [q_row0 + start_m, q_col], do_ready.index(st), do_smem.index(st)
            )
            tma.async_copy_global_to_shared(delta_desc, [stat], do_ready.index(st), delta_smem.index(st))  # fmt: skip
            start_m += BLOCK_M
            if start_m >= S_Q:
                start_m = m_lo
                off_h += 1

    @gluon.jit
    def _bwd_consume(
        q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
        kv_ready, q_ready, do_ready, empty, ds_ready,
        DQACC, DK, DV, off_b, h0, off_hk, H, H_KV, S_Q, S_K, n0, m_lo, total,
        qk_scale, sm_scale,
        CONSUMER: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_TMA: gl.constexpr,
    ):  # fmt: skip
        """Consumer warpgroup CONSUMER: keys [n0 + CONSUMER * HALF, + HALF) of the block, and columns
        [CONSUMER * D/2, + D/2) of each step's dQ tile.

        DQ_TMA: DQACC is a tensor descriptor of the fp32 dQ buffer viewed as [B * S_Q, H * D] with box
        [BLOCK_M, D/2]; this consumer's dQ part goes through its staging tile dq_smem[CONSUMER] and one
        bulk reduction (``_dq_bulk_add``). Rows past S_Q in a tile hold exact zeros (P^T was masked to 0
        there, so dS^T is 0): the reduction adds +-0 to the next batch's rows, which changes nothing,
        and the TMA unit drops rows past the buffer's end."""
        HALF: gl.constexpr = BLOCK_N // 2
        DQ_COLS: gl.constexpr = D // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
        )
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # a query index per column of S^T
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # a key index per row
        dtype: gl.constexpr = q_smem.dtype

        kn0 = n0 + CONSUMER * HALF
        k_mine = k_smem.slice(CONSUMER * HALF, HALF, dim=0)
        v_mine = v_smem.slice(CONSUMER * HALF, HALF, dim=0)
        k_cols = k_smem.slice(CONSUMER * DQ_COLS, DQ_COLS, dim=1)
        diag = S_K - S_Q
        keys = kn0 + gl.arange(0, HALF, layout=row_s)
        key_ok = gl.expand_dims(keys < S_K, 1)
        s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
        dk = gl.zeros([HALF, D], gl.float32, acc_layout)
        dv = gl.zeros([HALF, D], gl.float32, acc_layout)
        dq_rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        dq_cols = CONSUMER * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
        dq_row_offs = gl.expand_dims(dq_rows0 * (H * D), 1)
        dq_stage = dq_smem.index(CONSUMER)
        mbarrier.wait(kv_ready, 0)

        start_m = m_lo
        off_h = h0
        for it in range(total):
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            buf = it % 2
            mbarrier.wait(q_ready.index(st), ph)
            q_tile = q_smem.index(st)
            s_tok = warpgroup_mma(k_mine, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(st), ph)
            do_tile = do_smem.index(st)
            dp_tok = warpgroup_mma(v_mine, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse = lse_smem.index(st).load(col_s)
            sT = warpgroup_mma_wait(1, deps=(s_tok,))
            pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
            # Mask where this consumer's keys cross the diagonal, the keys end or the queries end:
            # rows past S_Q hold the next batch's Q (and the next head's LSE), keys past S_K the next
            # batch's keys (zeros past the tensor's end).
            edge = (start_m + BLOCK_M > S_Q) | (kn0 + HALF > S_K)
            if CAUSAL:
                edge = edge | (start_m + diag < kn0 + HALF - 1)
            if edge:
                qs = start_m + gl.arange(0, BLOCK_M, layout=col_s)
                ok = key_ok & gl.expand_dims(qs < S_Q, 0)
                if CAUSAL:
                    ok = ok & (gl.expand_dims(keys, 1) <= gl.expand_dims(qs + diag, 0))
                pT = gl.where(ok, pT, 0.0)
            pT_op = gl.convert_layout(pT.to(dtype), op_layout)
            dv_tok = warpgroup_mma(pT_op, do_tile, dv, is_async=True)
            delta = delta_smem.index(st).load(col_s)
            dpT = warpgroup_mma_wait(1, deps=(dp_tok,))  # dP^T has landed; dV += P^T dO may still run
            dsT = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
            # dS^T of this consumer's keys into the shared tile, visible to the other consumer and
            # to the tensor cores (async proxy) before the arrival
            ds_smem.index(buf).slice(CONSUMER * HALF, HALF, dim=0).store(dsT)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dsT_op = gl.convert_layout(dsT, op_layout)
            dk_tok = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)
            dv, _ = warpgroup_mma_wait(1, deps=(dv_tok, pT_op))  # P^T's registers are free once dV lands
            mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)  # both halves of dS^T written
            dq_tok = warpgroup_mma(
                ds_smem.index(buf).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
            )
            dk, dq, _ = warpgroup_mma_wait(0, deps=(dk_tok, dq_tok, dsT_op))
            mbarrier.arrive(empty.index(st), count=1)  # Q, dO, LSE, delta of this stage are free
            # this step's part of dQ rows [start_m, + BLOCK_M) of query head off_h
            _dq_add(DQACC, dq_stage, dq, sm_scale, off_b, start_m, off_h, S_Q, H,
                    dq_row_offs, dq_cols, dq_rows0, CONSUMER, D, DQ_TMA)  # fmt: skip
            start_m += BLOCK_M
            if start_m >= S_Q:
                start_m = m_lo
                off_h += 1

        if DQ_TMA:
            tma.store_wait(0)  # the staging tile is read before the block's shared memory is released

        # dK, dV of this consumer's keys (summed over the group's query heads), rows past S_K left alone.
        rows_k = gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        kv_base = ((off_b * S_K + kn0).to(gl.int64) * H_KV + off_hk) * D
        offs_kv = gl.expand_dims(rows_k, 1) * (H_KV * D) + gl.expand_dims(cols, 0)
        row_ok = gl.expand_dims(rows_k < S_K - kn0, 1)
        gl.store(DV + kv_base + offs_kv, dv.to(dtype), mask=row_ok)
        gl.store(DK + kv_base + offs_kv, (dk * sm_scale).to(dtype), mask=row_ok)

    @gluon.jit
    def _gluon_bwd_kernel(
        q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, DQACC, DK, DV,
        H, H_KV, GROUP, S_Q, S_K, S_STAT, qk_scale, sm_scale,
        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, LOAD_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, DQ_TMA: gl.constexpr,
    ):  # fmt: skip
        n_block = gl.program_id(0)  # causal: low key blocks see the most queries and launch first
        bhk = gl.program_id(1)
        off_b = bhk // H_KV
        off_hk = bhk % H_KV
        n0 = n_block * BLOCK_N
        # causal: query rows i < n0 - diag see none of this block's keys; their tiles are skipped
        if CAUSAL:
            m_lo = (gl.maximum(n0 - (S_K - S_Q), 0) // BLOCK_M) * BLOCK_M
        else:
            m_lo = 0
        n_tiles = gl.cdiv(S_Q - m_lo, BLOCK_M)
        total = GROUP * n_tiles  # steps: the group's query heads x the query tiles each

        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, D], do_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        if DQ_TMA:  # each consumer's dQ staging tile [BLOCK_M, D/2] fp32 (DQACC is then a descriptor)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, D // 2], DQACC.layout)
        else:
            dq_smem = ds_smem  # not used
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)
        fence_async_shared()  # the initialised barriers are visible to the TMA engine (async proxy)

        # Argument tuples written out in the call: a tuple bound to a name first turns its constexpr
        # entries into tensors (Triton 3.6), and the partitions need them as constexprs.
        gl.warp_specialize(
            [
                (_bwd_consume, (
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                    kv_ready, q_ready, do_ready, empty, ds_ready,
                    DQACC, DK, DV, off_b, off_hk * GROUP, off_hk, H, H_KV, S_Q, S_K, n0, m_lo, total,
                    qk_scale, sm_scale, 0, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, DQ_TMA,
                )),
                (_bwd_load_partition, (
                    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc,
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
                    kv_ready, q_ready, do_ready, empty,
                    off_b * S_Q, off_b * S_K + n0, off_hk * D, off_b * H, off_hk * GROUP, m_lo, total, S_Q, S_STAT,
                    D, BLOCK_M, NUM_STAGES,
                )),
                (_bwd_consume, (
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                    kv_ready, q_ready, do_ready, empty, ds_ready,
                    DQACC, DK, DV, off_b, off_hk * GROUP, off_hk, H, H_KV, S_Q, S_K, n0, m_lo, total,
                    qk_scale, sm_scale, 1, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, DQ_TMA,
                )),
            ],
            [1, 4],
            [LOAD_REGS, CONSUMER_REGS],
        )  # fmt: skip

    # ----------------------------------------------------------------------------------------------
    # D = 256: 64 keys per program, one consumer for dV and one for dK (see the module docstring).
    # ----------------------------------------------------------------------------------------------

    @gluon.jit
    def _store_key_rows(PTR, acc, off_b, kn0, off_hk, S_K, H_KV,
                        D: gl.constexpr, ROWS: gl.constexpr, acc_layout: gl.constexpr):  # fmt: skip
        """acc [ROWS, D] (this program's keys) into PTR [B, S_K, H_KV, D] of key head off_hk, rows past S_K left alone."""
        rows_k = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        base = ((off_b * S_K + kn0).to(gl.int64) * H_KV + off_hk) * D
        offs = gl.expand_dims(rows_k, 1) * (H_KV * D) + gl.expand_dims(cols, 0)
        gl.store(PTR + base + offs, acc.to(PTR.dtype.element_ty), mask=gl.expand_dims(rows_k < S_K - kn0, 1))

    @gluon.jit
    def _d256_dq(ds_tile, k_smem, empty_bar, DQACC, dq_smem, sm_scale, off_b, m, off_h, S_Q, H,
                 CONSUMER: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, DQ_TMA: gl.constexpr):  # fmt: skip
        """dQ rows [m, + BLOCK_M) of query head off_h, columns [CONSUMER D/2, + D/2): scale * dS K[:, cols]
        (A = dS, the exchange tile dS^T read transposed) added to the fp32 buffer, and the stage's empty
        barrier arrived on once its Q, dO, LSE / delta are read. By TMA bulk reduction one [BLOCK_M, D/2]
        tile (64 accumulator registers); by atomics two [BLOCK_M, D/4] pieces in turn (32 each: with 64
        and a row pointer per row the consumers spilled 52-56 bytes, ptxas sm_90a)."""
        HALF: gl.constexpr = D // 2
        PIECE: gl.constexpr = HALF if DQ_TMA else HALF // 2
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PIECE, 16]
        )
        dq_zero = gl.zeros([BLOCK_M, PIECE], gl.float32, dq_layout)
        dq_rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        dq_row_offs = gl.expand_dims(dq_rows0 * (H * D), 1)
        for p in gl.static_range(HALF // PIECE):
            dq_tok = warpgroup_mma(
                ds_tile.permute((1, 0)),
                k_smem.slice(CONSUMER * HALF + p * PIECE, PIECE, dim=1),
                dq_zero,
                use_acc=False,
                is_async=True,
            )
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            if p == HALF // PIECE - 1:
                mbarrier.arrive(empty_bar, count=1)
            dq_cols = CONSUMER * HALF + p * PIECE + gl.arange(0, PIECE, layout=gl.SliceLayout(0, dq_layout))
            _dq_add(DQACC, dq_smem.index(CONSUMER), dq, sm_scale, off_b, m, off_h, S_Q, H,
                    dq_row_offs, dq_cols, dq_rows0, CONSUMER, D, DQ_TMA)  # fmt: skip

    @gluon.jit
    def _d256_consume_dv(
        q_smem, do_smem, lse_smem, k_smem, p_smem, ds_smem, dq_smem,
        kv_ready, q_ready, do_ready, empty, p_ready, ds_ready,
        DQACC, DV, H, H_KV, GROUP, S_Q, S_K, qk_scale, sm_scale,
        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, DQ_TMA: gl.constexpr,
    ):  # fmt: skip
        """Consumer 0 at D = 256 (the default partition): per step S^T = K Q^T, P^T (masked), P^T to the
        exchange tile for consumer 1, dV += P^T dO, then, once consumer 1 has written dS^T, the dQ columns
        [0, D/2): dS K[:, :D/2]."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = q_smem.dtype

        # the program's indices from the grid and the kernel's arguments here, not passed in: values
        # computed before the partitions start stay live into this one (the default) and spilled
        n0 = gl.program_id(0) * BLOCK_N
        off_b = gl.program_id(1) // H_KV
        diag = S_K - S_Q
        if CAUSAL:
            m_lo = (gl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        else:
            m_lo = 0
        total = GROUP * gl.cdiv(S_Q - m_lo, BLOCK_M)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dv = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
        mbarrier.wait(kv_ready, 0)

        start_m = m_lo
        off_h = (gl.program_id(1) % H_KV) * GROUP
        for it in range(total):
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            buf = it % 2
            mbarrier.wait(q_ready.index(st), ph)
            q_tile = q_smem.index(st)
            s_tok = warpgroup_mma(k_smem, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sT = warpgroup_mma_wait(0, deps=(s_tok,))
            lse = lse_smem.index(st).load(col_s)  # after the wait: its 16 registers not beside the wgmma's
            pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
            # masked as in _bwd_consume: rows past S_Q hold the next batch's Q, keys past S_K the next
            # batch's keys; consumer 1's dS^T = P^T (dP^T - delta) is then 0 there too
            edge = (start_m + BLOCK_M > S_Q) | (n0 + BLOCK_N > S_K)
            if CAUSAL:
                edge = edge | (start_m + diag < n0 + BLOCK_N - 1)
            if edge:  # the indices made here, not held across the loop (registers)
                keys = n0 + gl.arange(0, BLOCK_N, layout=row_s)
                qs = start_m + gl.arange(0, BLOCK_M, layout=col_s)
                ok = gl.expand_dims(keys < S_K, 1) & gl.expand_dims(qs < S_Q, 0)
                if CAUSAL:
                    ok = ok & (gl.expand_dims(keys, 1) <= gl.expand_dims(qs + diag, 0))
                pT = gl.where(ok, pT, 0.0)
            pT16 = pT.to(dtype)
            # P^T for consumer 1 (read with ordinary loads: no proxy fence); the buffer's previous
            # contents (step it - 2) were read before consumer 1 arrived on ds_ready at step it - 2,
            # which this consumer waited for
            p_smem.index(buf).store(pT16)
            gl.thread_barrier()
            mbarrier.arrive(p_ready.index(buf), count=1)
            pT_op = gl.convert_layout(pT16, op_layout)
            mbarrier.wait(do_ready.index(st), ph)
            dv_tok = warpgroup_mma(pT_op, do_smem.index(st), dv, is_async=True)
            mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
            # dV (and P^T's registers) done before the dQ product takes its accumulator's: dV 128 +
            # P^T 16 + dQ 64 with the scalars spilled (ptxas, sm_90a)
            dv, _ = warpgroup_mma_wait(0, deps=(dv_tok, pT_op))
            _d256_dq(ds_smem.index(buf), k_smem, empty.index(st), DQACC, dq_smem, sm_scale, off_b, start_m,
                     off_h, S_Q, H, 0, D, BLOCK_M, DQ_TMA)  # fmt: skip
            start_m += BLOCK_M
            if start_m >= S_Q:
                start_m = m_lo
                off_h += 1

        if DQ_TMA:
            tma.store_wait(0)
        _store_key_rows(DV, dv, gl.program_id(1) // H_KV, gl.program_id(0) * BLOCK_N, gl.program_id(1) % H_KV,
                        S_K, H_KV, D, BLOCK_N, acc_layout)  # fmt: skip

    @gluon.jit
    def _d256_consume_dk(
        q_smem, do_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem,
        kv_ready, q_ready, do_ready, empty, p_ready, ds_ready,
        DQACC, DK, off_b, h0, off_hk, H, H_KV, S_Q, S_K, n0, m_lo, total, sm_scale,
        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        DQ_TMA: gl.constexpr,
    ):  # fmt: skip
        """Consumer 1 at D = 256 (a worker): per step dP^T = V dO^T, then with consumer 0's P^T
        dS^T = P^T (dP^T - delta), dS^T to the exchange tile, dK += dS^T Q and the dQ columns [D/2, D):
        dS K[:, D/2:]."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = q_smem.dtype

        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, D], gl.float32, acc_layout)
        mbarrier.wait(kv_ready, 0)

        start_m = m_lo
        off_h = h0
        for it in range(total):
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            buf = it % 2
            mbarrier.wait(do_ready.index(st), ph)
            dp_tok = warpgroup_mma(
                v_smem, do_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            dpT = warpgroup_mma_wait(0, deps=(dp_tok,))
            delta = delta_smem.index(st).load(col_s)
            mbarrier.wait(p_ready.index(buf), (it // 2) & 1)
            pT = p_smem.index(buf).load(s_layout).to(gl.float32)
            dsT = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
            # dS^T for both dQ products (tensor cores: the async proxy, hence the fence); the buffer's
            # previous contents (step it - 2) were read by consumer 0's dQ product, finished before it
            # arrived on p_ready at step it, which this consumer waited for
            ds_smem.index(buf).store(dsT)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dsT_op = gl.convert_layout(dsT, op_layout)
            mbarrier.wait(q_ready.index(st), ph)
            dk_tok = warpgroup_mma(dsT_op, q_smem.index(st), dk, is_async=True)
            dk, _ = warpgroup_mma_wait(0, deps=(dk_tok, dsT_op))  # as consumer 0's dV: registers
            _d256_dq(ds_smem.index(buf), k_smem, empty.index(st), DQACC, dq_smem, sm_scale, off_b, start_m,
                     off_h, S_Q, H, 1, D, BLOCK_M, DQ_TMA)  # fmt: skip
            start_m += BLOCK_M
            if start_m >= S_Q:
                start_m = m_lo
                off_h += 1

        if DQ_TMA:
            tma.store_wait(0)
        _store_key_rows(DK, dk * sm_scale, off_b, n0, off_hk, S_K, H_KV, D, BLOCK_N, acc_layout)

    # The sizes unspecialised (one compile for every S, H; Triton would otherwise compile a variant per
    # size divisible by 16 or not, ~10 s each): the launch then runs what the offline compile reports.
    @gluon.jit(do_not_specialize=["H", "H_KV", "GROUP", "S_Q", "S_K", "S_STAT"])
    def _gluon_bwd_d256_kernel(
        q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, DQACC, DK, DV,
        H, H_KV, GROUP, S_Q, S_K, S_STAT, qk_scale, sm_scale,
        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, LOAD_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, DQ_TMA: gl.constexpr,
    ):  # fmt: skip
        """The D = 256 backward: program = BLOCK_N = 64 keys of one KV head (batch b); the same
        arguments as _gluon_bwd_kernel."""
        n_block = gl.program_id(0)
        bhk = gl.program_id(1)
        off_b = bhk // H_KV
        off_hk = bhk % H_KV
        n0 = n_block * BLOCK_N
        if CAUSAL:
            m_lo = (gl.maximum(n0 - (S_K - S_Q), 0) // BLOCK_M) * BLOCK_M
        else:
            m_lo = 0
        n_tiles = gl.cdiv(S_Q - m_lo, BLOCK_M)
        total = GROUP * n_tiles

        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, D], do_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], delta_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, D], v_desc.layout)
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], x_layout)  # P^T: consumer 0 -> 1
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], x_layout)  # dS^T: 1 -> both
        if DQ_TMA:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, D // 2], DQACC.layout)
        else:
            dq_smem = ds_smem  # not used
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(ds_ready.index(i), count=1)
        fence_async_shared()

        gl.warp_specialize(
            [
                (_d256_consume_dv, (
                    q_smem, do_smem, lse_smem, k_smem, p_smem, ds_smem, dq_smem,
                    kv_ready, q_ready, do_ready, empty, p_ready, ds_ready,
                    DQACC, DV, H, H_KV, GROUP, S_Q, S_K,
                    qk_scale, sm_scale, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, DQ_TMA,
                )),
                (_bwd_load_partition, (
                    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc,
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
                    kv_ready, q_ready, do_ready, empty,
                    off_b * S_Q, off_b * S_K + n0, off_hk * D, off_b * H, off_hk * GROUP, m_lo, total, S_Q, S_STAT,
                    D, BLOCK_M, NUM_STAGES,
                )),
                (_d256_consume_dk, (
                    q_smem, do_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem,
                    kv_ready, q_ready, do_ready, empty, p_ready, ds_ready,
                    DQACC, DK, off_b, off_hk * GROUP, off_hk, H, H_KV, S_Q, S_K, n0, m_lo, total,
                    sm_scale, D, BLOCK_M, BLOCK_N, NUM_STAGES, DQ_TMA,
                )),
            ],
            [1, 4],
            [LOAD_REGS, CONSUMER_REGS],
        )  # fmt: skip


def _constexprs(
    d: int, causal: bool, block_m: int | None = None, num_stages: int | None = None, dq_tma: bool = DQ_TMA
) -> dict:
    """The kernel's constexpr arguments, shared by the launcher and the offline compile
    (``repro.fa4.lab.compile``)."""
    if d not in GLUON_BWD_DEFAULTS:
        raise ValueError(
            f"gluon backward: head dim D = {d} is not supported, expected one of {tuple(GLUON_BWD_DEFAULTS)} "
            "(q, k and v of one head size; others run the Triton backwards, bwd='fused' or 'fa2')"
        )
    bm, ns = GLUON_BWD_DEFAULTS[d]
    if d == 256 and dq_tma is True:
        ns = D256_TMA_STAGES
    bm = bm if block_m is None else int(block_m)
    ns = ns if num_stages is None else int(num_stages)
    if bm not in (64, 128):
        raise ValueError(f"gluon backward: block_m must be 64 or 128 (a wgmma N), got {bm}")
    if ns < 1:
        raise ValueError(f"gluon backward: num_stages must be >= 1, got {ns}")
    if not isinstance(dq_tma, bool):
        raise TypeError(f"gluon backward: dq_tma must be True or False, got {dq_tma!r}")
    if d == 256 and bm != 64:
        raise ValueError(f"gluon backward: D = 256 runs block_m = 64 only (registers), got {bm}")
    return dict(D=d, BLOCK_M=bm, BLOCK_N=BLOCK_N if d < 256 else BLOCK_N_D256, NUM_STAGES=ns, CAUSAL=bool(causal),
                LOAD_REGS=LOAD_REGS, CONSUMER_REGS=CONSUMER_REGS, DQ_TMA=dq_tma)  # fmt: skip


def kernel_for(d: int):
    """The kernel of head size ``d``: ``_gluon_bwd_kernel`` (D 64, 128) or ``_gluon_bwd_d256_kernel``."""
    return _gluon_bwd_d256_kernel if d == 256 else _gluon_bwd_kernel


def _dq_layout(d: int, block_m: int):
    """Shared-memory layout of a consumer's dQ staging tile [block_m, D/2] fp32 (DQ_TMA): the default
    NVMMA swizzle, 128 B (a row of D/2 fp32 is 128 B at D = 64, 256 B at D = 128)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, d // 2], gl.float32)


def _layouts(d: int, block_m: int, gdt):
    """Shared-memory layouts of the TMA tiles: Q / dO [block_m, D], K / V [BLOCK_N, D], LSE / delta [block_m]."""
    # K's swizzle spans D/2 columns (128 B at D = 128, 64 B at D = 64): Triton stores a swizzled tile
    # as column blocks of one swizzle width, so each consumer's column half of K (the B operand of
    # its dQ product) is one whole block, not a cut through a swizzle pattern; at D = 256 (128 B, the
    # widest swizzle) a half is two whole blocks
    return (
        gl.NVMMASharedLayout.get_default_for([block_m, d], gdt),
        gl.NVMMASharedLayout(swizzle_byte_width=min(d, 128), element_bitwidth=16, rank=2),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1),
    )


#: History: the first run on an H100 (2026-11-25, torch 2.11, Triton 3.6, CUDA 13) ended at the
#: first case of the GPU matrix in "CUDA error: an illegal instruction was encountered". A bisect
#: over parts of the kernel left out, and the per-process sweep of the matrix's shapes
#: (``repro.fa4.lab.gluon_bwd_sweep``, results/*-gluon-bwd-sweep.json), found every shape with S_q in
#: {1, 113} faulting and every one with S_q in {1000, 2048} right. The cause: the LSE and delta tiles
#: are 1-D TMA copies of BLOCK_M entries from [B * H * S_q] vectors, starting at (b H + h) S_q + m, so
#: with S_q * 4 bytes not a multiple of 16 the boxes of every head but the first start off 16-byte
#: alignment (a TMA load from an address that is not 16-byte aligned ends in an illegal instruction:
#: triton-lang/triton#7385). Tested both ways on the next H100 run (results/*-gluon-bwd-boundary-pad-
#: off.json / -pad-on.json, S_q in 1, 64, 65, 113, 127, 128, 129, 192, 255, 256, 257, 384, 511, 1000):
#: without padding exactly the shapes with S_q % 4 != 0 faulted; with :func:`pad_stats` (each head's
#: row padded to a multiple of BLOCK_M, copies of B * H * S_q floats, small beside the backward) every
#: one ran, and the GPU matrix passed (16 of 16) with compute-sanitizer clean. Should a new fault
#: appear, ``api.auto_backward`` is the one place that picks this kernel for ``bwd="auto"``.


def check_device(q: torch.Tensor) -> None:
    """Raise, saying why, where this kernel cannot run (no Gluon, not CUDA, not sm_90); else nothing."""
    if not HAS_GLUON:
        raise RuntimeError(f"gluon backward: this Triton has no Gluon ({GLUON_ERROR})")
    if q.device.type != "cuda":
        raise RuntimeError(
            f"gluon backward: needs a Hopper GPU (sm_90a); the tensors are on {q.device} (Gluon kernels "
            "do not run in Triton's CPU interpreter)"
        )
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"gluon backward: written for Hopper (sm_90a: wgmma, TMA, setmaxnreg); this GPU is sm_{major}{minor}"
        )


def pad_stats(lse: torch.Tensor, delta: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """LSE and delta [B, H, S_q] with each head's row zero-padded to a whole number of ``block_m``
    tiles, and that row length: every 1-D TMA box of ``block_m`` entries then starts 16-byte aligned
    and inside its own head's row (see the history above :func:`check_device`). Unchanged where S_q is already a
    multiple."""
    s_q = lse.shape[-1]
    s_stat = -(-s_q // block_m) * block_m
    if s_stat == s_q:
        return lse, delta, s_q
    return F.pad(lse, (0, s_stat - s_q)), F.pad(delta, (0, s_stat - s_q)), s_stat


def gluon_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    block_m: int | None = None,
    num_stages: int | None = None,
    dq_tma: bool = DQ_TMA,
    pad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attention from the forward's output ``o`` and base-2 log-sum-exp ``lse``.

    q, o, do: [B, S_q, H, D]; k, v: [B, S_k, H_kv, D], H_kv dividing H, D in {64, 128, 256}, bf16 or fp16;
    lse: [B, H, S_q] float32 (either forward's). Causal needs S_q <= S_k. Hopper (sm_90) only.
    delta = rowsum(dO * O) and the zeroed fp32 dQ buffer come from ``triton_bwd_fused``'s preprocess
    kernel. ``dq_tma``: dQ added by TMA bulk reductions from shared memory (the default), else by
    per-element atomics (the cross-check). ``pad``: LSE and delta padded per head (:func:`pad_stats`;
    False only to reproduce the fault it fixes, ``repro.fa4.lab.gluon_bwd_sweep``).
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from repro.fa4.triton_bwd_fused import preprocess

    check_device(q)
    if q.dtype not in GLUON_DTYPES:
        raise TypeError(f"gluon backward: q has dtype {q.dtype}, expected bfloat16 or float16")
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if causal and s_q > s_k:
        raise ValueError(f"gluon backward: causal needs S_q <= S_k, got S_q = {s_q}, S_k = {s_k}")
    cx = _constexprs(d, causal, block_m, num_stages, dq_tma)
    bm = cx["BLOCK_M"]
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    delta, dq_acc = preprocess(o, do)
    lse = lse.contiguous()
    lse, delta, s_stat = pad_stats(lse, delta, bm) if pad else (lse, delta, s_q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    qo_layout, kv_layout, vec_layout = _layouts(
        d, bm, {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    )

    def desc(t, block, layout):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    bn = cx["BLOCK_N"]
    q_desc, do_desc = (desc(t.view(b * s_q, h * d), [bm, d], qo_layout) for t in (q, do))
    k_desc, v_desc = (desc(t.view(b * s_k, h_kv * d), [bn, d], kv_layout) for t in (k, v))
    lse_desc, delta_desc = (desc(t.view(-1), [bm], vec_layout) for t in (lse, delta))
    # DQ_TMA: the fp32 dQ buffer [B, S_q, H, D] as [B * S_q, H * D], one consumer's part per box
    dq_arg = desc(dq_acc.view(b * s_q, h * d), [bm, d // 2], _dq_layout(d, bm)) if cx["DQ_TMA"] else dq_acc
    kernel_for(d)[(-(-s_k // bn), b * h_kv)](
        q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dq_arg, dk, dv,
        h, h_kv, h // h_kv, s_q, s_k, s_stat, scale / math.log(2.0), scale, **cx, num_warps=4,
    )  # fmt: skip
    return dq_acc.to(q.dtype), dk, dv
