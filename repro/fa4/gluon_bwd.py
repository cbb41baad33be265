"""A warp-specialised attention backward for Hopper (sm_90a) in Gluon: FA3's schedule (``bwd="gluon"``).

The Triton one-pass backward (``repro.fa4.bwd_fused``) runs FA3's 5-matmul schedule as one
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

dQ accumulation, into the fp32 buffer that ``bwd_fused``'s preprocess kernel zeroes (cast by the
caller), each consumer for its own [BLOCK_M, D/2] half, no two consumers adding the same element:
by TMA bulk reductions (DQ_TMA, the default since its H100 run of 2026-11-27: the 16-case GPU
matrix passed, compute-sanitizer clean, fwd+bwd 0.97x / 1.00x cuDNN at S = 8k non-causal / causal
where the atomic adds gave 0.76x / 0.85x), or by fp32 atomic adds (``gl.atomic_add``, relaxed:
``red.global.add``; DQ_TMA off, the cross-check).

The two dQ variants (DQ_TMA on; DQ_DEFER off: on the H100 its results were wrong, relative error
1.3 against FA2 at D = 128 fp16, every shape of the sweep):

* DQ_TMA, FA3's way: each consumer writes its scaled dQ half into a [BLOCK_M, D/2] fp32 staging tile
  in shared memory and one thread adds the tile to the dQ buffer with a TMA bulk reduction
  (``cp.reduce.async.bulk.tensor.2d.global.shared::cta.add``), which bought 10% in the Triton kernel
  (``bwd_dq_tma``). Gluon's public ``hopper.tma`` in Triton 3.6 has copies and stores only, but the
  op exists below it (``ttng.async_tma_reduce``, which ``tl`` descriptors' ``atomic_add`` lowers to)
  and the Gluon IR builder exposes it (``create_async_tma_reduce``): ``_tma_reduce_add`` is a
  ten-line ``@builtin`` over it, written as Gluon's own ``async_copy_shared_to_global`` is. Before the
  tile is rewritten the next step waits for the reduction's reads (``tma.store_wait(0)``, i.e.
  ``cp.async.bulk.wait_group.read 0``) and a warpgroup barrier; after writing it, a
  ``fence.proxy.async`` and a barrier, then the reduction and its bulk-group commit. At D = 128 the
  box's 64 fp32 columns exceed the 128-byte swizzle, so Triton issues two [64, 32] reductions per
  tile from two warps (the host descriptor gets the same box from the compiled metadata). The
  staging tiles add 32 KiB of shared memory (D = 128: 193 KiB in all).
* DQ_DEFER: the dQ product of step it waits for the other consumer's dS^T half at the start of step
  it + 1 (before that step's S^T), not right after this consumer's own arrival, so the exchange's
  mbarrier is off the step's critical path (by then the other consumer has normally arrived). The
  deferred dQ tile is taken out of the registers (staged or added) before dP^T is issued; held longer,
  beside S^T, dP^T, dK and dV, it spilled about 1 KB at D = 128. As it is, D = 128 still spills
  360-660 bytes (offline compile; 360-372 with DQ_TMA), against 44-92 for the default: the GPU decides whether the
  barrier it hides is worth more.

Causal (bottom-right aligned, diag = S_K - S_Q): query tiles before the first row that sees key n0
are skipped (the load warp never loads them); a consumer masks a tile only where its keys cross the
diagonal, the keys end (S_K) or the queries end (S_Q). TMA reads past a batch's last query row
return the next batch's rows (and the LSE / delta of the next head): those columns are masked to
P = 0, so they add nothing to dK, dV, and no dQ is added for them. Causal needs S_Q <= S_K (the
public entry point splits off the rows that see no key).

Layout: q, do, dq [B, S_Q, H, D]; k, v, dk, dv [B, S_K, H_KV, D]; TMA descriptors view q and do as
[B * S_Q, H * D], k and v as [B * S_K, H_KV * D], lse and delta ([B, H, S_Q] fp32) as one vector.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from repro.fa4.gluon_fwd import GLUON_DTYPES, GLUON_ERROR, GLUON_HEAD_DIMS, HAS_GLUON

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
    "GLUON_BWD_DEFAULTS",
    "check_device",
    "compile_for_sm90",
    "compile_report",
    "gluon_attention_backward",
]

#: D -> (BLOCK_M query rows per step, NUM_STAGES of the Q/dO ring). BLOCK_N = 128 keys per program
#: (64 per consumer warpgroup), FA3's tile at D = 128 (its 64 x 128 causal tile). Shared memory at
#: D = 128: K + V 64 KiB, 2 stages x (Q + dO) 64 KiB, dS 2 x 16 KiB = 160 KiB; at D = 64: 96 KiB.
#: Registers per consumer thread at D = 128: dK + dV 128, S^T and dP^T 32 each, the dQ half 32.
GLUON_BWD_DEFAULTS = {64: (64, 2), 128: (64, 2)}
BLOCK_N = 128
NUM_CONSUMERS = 2
#: Registers per thread (setmaxnreg) of the load warp and of the worker consumer, as in the forward.
LOAD_REGS = 24
CONSUMER_REGS = 240

#: The dQ variants. DQ_TMA (on: GPU-tested on an H100, 2026-11-27; FA4_GLUON_BWD_DQ_TMA=0 turns it
#: off for the atomic adds); DQ_DEFER (off: wrong on the H100, see the module docstring). DQ_TMA: each consumer stages its [BLOCK_M, D/2] part of a step's dQ in shared memory and adds it to
#: the fp32 buffer with one TMA bulk reduction (``cp.reduce.async.bulk.tensor ... add``), FA3's way,
#: instead of BLOCK_M * D/2 per-element ``red.global.add``. DQ_DEFER: a step's dQ product waits for
#: the other consumer's dS^T half one step later (software pipelining), so the ds_ready barrier is
#: no longer on each step's critical path. ``gluon_attention_backward(dq_tma=, dq_defer=)`` and
#: ``attention(bwd="gluon", bwd_dq_tma=, bwd_dq_defer=)`` choose per call; None there takes these
#: (environment FA4_GLUON_BWD_DQ_TMA / FA4_GLUON_BWD_DQ_DEFER = 0 or 1, for the per-process GPU sweeps).
DQ_TMA = os.environ.get("FA4_GLUON_BWD_DQ_TMA", "1") == "1"
DQ_DEFER = os.environ.get("FA4_GLUON_BWD_DQ_DEFER", "") == "1"


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
        D: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, SKIP: gl.constexpr,
    ):  # fmt: skip
        """One warp: K and V of the key block once, then (Q, LSE) and (dO, delta) of every step
        (SKIP & 16: Q and dO only, no LSE / delta copies; for locating a fault, see BISECT)."""
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
            if SKIP & 16 == 0:
                mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            else:
                mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [q_row0 + start_m, q_col], q_ready.index(st), q_smem.index(st)
            )
            if SKIP & 16 == 0:
                tma.async_copy_global_to_shared(lse_desc, [stat], q_ready.index(st), lse_smem.index(st))
                mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            else:
                mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                do_desc, [q_row0 + start_m, q_col], do_ready.index(st), do_smem.index(st)
            )
            if SKIP & 16 == 0:
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
        NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, SKIP: gl.constexpr,
        DQ_TMA: gl.constexpr, DQ_DEFER: gl.constexpr,
    ):  # fmt: skip
        """Consumer warpgroup CONSUMER: keys [n0 + CONSUMER * HALF, + HALF) of the block, and columns
        [CONSUMER * D/2, + D/2) of each step's dQ tile. SKIP (0 in use) leaves parts out, to locate a
        fault on the GPU (results then wrong): 1 the dQ atomics, 2 the dS^T exchange and the dQ
        product, 4 the dK product, 8 the dV product (see BISECT).

        DQ_TMA: DQACC is a tensor descriptor of the fp32 dQ buffer viewed as [B * S_Q, H * D] with box
        [BLOCK_M, D/2]; this consumer's dQ part goes through its staging tile dq_smem[CONSUMER] and one
        bulk reduction (``_dq_bulk_add``). Rows past S_Q in a tile hold exact zeros (P^T was masked to 0
        there, so dS^T is 0): the reduction adds +-0 to the next batch's rows, which changes nothing,
        and the TMA unit drops rows past the buffer's end.
        DQ_DEFER: step it issues the dQ product of step it - 1 first (its dS^T tile, buffer (it - 1) % 2,
        was completed by both consumers during step it - 1), then this step's S^T and dP^T; the dQ of
        the last step follows the loop. Step 0 issues one on the never-written buffer 1 (a fresh
        mbarrier passes parity 1 at once) and drops its result. Buffer reuse stays safe: a consumer
        writes buffer it % 2 at step it only after waiting for the other's dS^T of step it - 1, which
        the other stored after its dQ product of step it - 2 (the last reader of that buffer) had
        completed. SKIP must be 0, 1 or 16 (the dQ products move; the other bits stay default-only)."""
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
        prev_m = m_lo  # DQ_DEFER: the query tile and head of the step before
        prev_h = h0
        for it in range(total):
            st = it % NUM_STAGES
            ph = (it // NUM_STAGES) & 1
            buf = it % 2
            if DQ_DEFER:
                # dS^T of step it - 1 complete (both halves): its buffer's ((it - 1) // 2)-th completion,
                # parity ((it + 1) // 2 + 1) & 1, which for it = 0 is 1 and passes at once
                mbarrier.wait(ds_ready.index((it + 1) % 2), ((it + 1) // 2 + 1) & 1)
                dq_tok = warpgroup_mma(
                    ds_smem.index((it + 1) % 2).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
                )
            mbarrier.wait(q_ready.index(st), ph)
            q_tile = q_smem.index(st)
            s_tok = warpgroup_mma(k_mine, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if DQ_DEFER:
                # dQ of the step before and this S^T land together; dQ leaves the registers (to shared
                # memory or as atomics) before dP^T is issued: with dQ, S^T and dP^T in flight at once
                # beside dK and dV, D = 128 spilled about 1 KB (offline compile)
                sT, dq = warpgroup_mma_wait(0, deps=(s_tok, dq_tok))
                if it > 0:
                    if SKIP & 1 == 0:
                        _dq_add(DQACC, dq_stage, dq, sm_scale, off_b, prev_m, prev_h, S_Q, H,
                                dq_row_offs, dq_cols, dq_rows0, CONSUMER, D, DQ_TMA)  # fmt: skip
            mbarrier.wait(do_ready.index(st), ph)
            do_tile = do_smem.index(st)
            dp_tok = warpgroup_mma(v_mine, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse = lse_smem.index(st).load(col_s)
            if not DQ_DEFER:
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
            if SKIP & 8 == 0:
                dv_tok = warpgroup_mma(pT_op, do_tile, dv, is_async=True)
                delta = delta_smem.index(st).load(col_s)
                dpT = warpgroup_mma_wait(1, deps=(dp_tok,))  # dP^T has landed; dV += P^T dO may still run
            else:
                delta = delta_smem.index(st).load(col_s)
                dpT = warpgroup_mma_wait(0, deps=(dp_tok,))
            dsT = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
            if SKIP & 2 == 0:
                # dS^T of this consumer's keys into the shared tile, visible to the other consumer and
                # to the tensor cores (async proxy) before the arrival
                ds_smem.index(buf).slice(CONSUMER * HALF, HALF, dim=0).store(dsT)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ds_ready.index(buf), count=1)
            if SKIP & 4 == 0:
                dsT_op = gl.convert_layout(dsT, op_layout)
                dk_tok = warpgroup_mma(dsT_op, q_tile, dk, is_async=True)
                if SKIP & 8 == 0:
                    dv, _ = warpgroup_mma_wait(
                        1, deps=(dv_tok, pT_op)
                    )  # P^T's registers are free once dV lands
            elif SKIP & 8 == 0:
                dv, _ = warpgroup_mma_wait(0, deps=(dv_tok, pT_op))
            if DQ_DEFER:  # this step's dQ product waits for the next step (or the loop's end)
                dk, _ = warpgroup_mma_wait(0, deps=(dk_tok, dsT_op))
            elif SKIP & 2 == 0:
                mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)  # both halves of dS^T written
                dq_tok = warpgroup_mma(
                    ds_smem.index(buf).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
                )
                if SKIP & 4 == 0:
                    dk, dq, _ = warpgroup_mma_wait(0, deps=(dk_tok, dq_tok, dsT_op))
                else:
                    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            else:
                dq = dq_zero
                if SKIP & 4 == 0:
                    dk, _ = warpgroup_mma_wait(0, deps=(dk_tok, dsT_op))
            mbarrier.arrive(empty.index(st), count=1)  # Q, dO, LSE, delta of this stage are free
            # this step's part of dQ rows [start_m, + BLOCK_M) of query head off_h (DQ_DEFER: next step)
            if DQ_DEFER:
                prev_m = start_m
                prev_h = off_h
            elif SKIP & 1 == 0:
                _dq_add(DQACC, dq_stage, dq, sm_scale, off_b, start_m, off_h, S_Q, H,
                        dq_row_offs, dq_cols, dq_rows0, CONSUMER, D, DQ_TMA)  # fmt: skip
            start_m += BLOCK_M
            if start_m >= S_Q:
                start_m = m_lo
                off_h += 1

        if DQ_DEFER:  # the last step's dQ
            last = total - 1
            mbarrier.wait(ds_ready.index(last % 2), (last // 2) & 1)
            dq_tok = warpgroup_mma(
                ds_smem.index(last % 2).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
            )
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            if SKIP & 1 == 0:
                _dq_add(DQACC, dq_stage, dq, sm_scale, off_b, prev_m, prev_h, S_Q, H,
                        dq_row_offs, dq_cols, dq_rows0, CONSUMER, D, DQ_TMA)  # fmt: skip
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
        CAUSAL: gl.constexpr, LOAD_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, SKIP: gl.constexpr = 0,
        DQ_TMA: gl.constexpr = False, DQ_DEFER: gl.constexpr = False,
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
                    qk_scale, sm_scale, 0, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, SKIP, DQ_TMA, DQ_DEFER,
                )),
                (_bwd_load_partition, (
                    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc,
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
                    kv_ready, q_ready, do_ready, empty,
                    off_b * S_Q, off_b * S_K + n0, off_hk * D, off_b * H, off_hk * GROUP, m_lo, total, S_Q, S_STAT,
                    D, BLOCK_M, NUM_STAGES, SKIP,
                )),
                (_bwd_consume, (
                    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                    kv_ready, q_ready, do_ready, empty, ds_ready,
                    DQACC, DK, DV, off_b, off_hk * GROUP, off_hk, H, H_KV, S_Q, S_K, n0, m_lo, total,
                    qk_scale, sm_scale, 1, D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, SKIP, DQ_TMA, DQ_DEFER,
                )),
            ],
            [1, 4],
            [LOAD_REGS, CONSUMER_REGS],
        )  # fmt: skip


def _constexprs(
    d: int,
    causal: bool,
    block_m: int | None = None,
    num_stages: int | None = None,
    skip: int = 0,
    dq_tma: bool = False,
    dq_defer: bool = False,
) -> dict:
    """The kernel's constexpr arguments, shared by the launcher and the offline compile."""
    if d not in GLUON_BWD_DEFAULTS:
        raise ValueError(
            f"gluon backward: head dim D = {d} is not supported, expected one of {GLUON_HEAD_DIMS}"
        )
    bm, ns = GLUON_BWD_DEFAULTS[d]
    bm = bm if block_m is None else int(block_m)
    ns = ns if num_stages is None else int(num_stages)
    if bm not in (64, 128):
        raise ValueError(f"gluon backward: block_m must be 64 or 128 (a wgmma N), got {bm}")
    if ns < 1:
        raise ValueError(f"gluon backward: num_stages must be >= 1, got {ns}")
    if not 0 <= skip < 32:
        raise ValueError(f"gluon backward: skip is a bit mask of 1, 2, 4, 8, 16 (see BISECT), got {skip}")
    for name, flag in (("dq_tma", dq_tma), ("dq_defer", dq_defer)):
        if not isinstance(flag, bool):
            raise TypeError(f"gluon backward: {name} must be True or False, got {flag!r}")
    if dq_defer and skip not in DEFER_SKIPS:
        raise ValueError(
            f"gluon backward: with dq_defer, skip must be one of {DEFER_SKIPS} (1 the dQ adds, 16 the "
            f"LSE / delta copies; the dQ product moves, so the other bits are the default's only), got {skip}"
        )
    return dict(D=d, BLOCK_M=bm, BLOCK_N=BLOCK_N, NUM_STAGES=ns, CAUSAL=bool(causal),
                LOAD_REGS=LOAD_REGS, CONSUMER_REGS=CONSUMER_REGS, SKIP=int(skip),
                DQ_TMA=dq_tma, DQ_DEFER=dq_defer)  # fmt: skip


#: SKIP bits the deferred-dQ variant takes (BISECT's subset for it).
DEFER_SKIPS = (0, 1, 16, 17)

#: The dQ variants by name: (dq_tma, dq_defer). "atomic" is the default kernel (per-element atomics,
#: dQ product right after the dS^T exchange); the others are off by default, not yet run on a GPU.
DQ_VARIANTS = {
    "atomic": (False, False),
    "tma": (True, False),
    "defer": (False, True),
    "tma-defer": (True, True),
}


def variant_env(variant: str) -> dict:
    """The environment that makes ``attention(bwd="gluon")`` run dQ variant ``variant`` in a fresh
    process (the module flags DQ_TMA / DQ_DEFER are read at import)."""
    if variant not in DQ_VARIANTS:
        raise ValueError(f"gluon backward: dQ variant must be one of {list(DQ_VARIANTS)}, got {variant!r}")
    tma_on, defer_on = DQ_VARIANTS[variant]
    return {"FA4_GLUON_BWD_DQ_TMA": str(int(tma_on)), "FA4_GLUON_BWD_DQ_DEFER": str(int(defer_on))}


def _dq_layout(d: int, block_m: int):
    """Shared-memory layout of a consumer's dQ staging tile [block_m, D/2] fp32 (DQ_TMA): the default
    NVMMA swizzle, 128 B (a row of D/2 fp32 is 128 B at D = 64, 256 B at D = 128)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, d // 2], gl.float32)


def _layouts(d: int, block_m: int, gdt):
    """Shared-memory layouts of the TMA tiles: Q / dO [block_m, D], K / V [BLOCK_N, D], LSE / delta [block_m]."""
    # K's swizzle spans D/2 columns (128 B at D = 128, 64 B at D = 64): Triton stores a swizzled tile
    # as column blocks of one swizzle width, so each consumer's column half of K (the B operand of
    # its dQ product) is one whole block, not a cut through a swizzle pattern
    return (
        gl.NVMMASharedLayout.get_default_for([block_m, d], gdt),
        gl.NVMMASharedLayout(swizzle_byte_width=d, element_bitwidth=16, rank=2),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1),
    )


#: History: the first run on an H100 (2026-11-25, torch 2.11, Triton 3.6, CUDA 13) ended at the
#: first case of the GPU matrix in "CUDA error: an illegal instruction was encountered". The bisect
#: ran every variant at S = 512; ``sweep`` found every shape with S_q in {1, 113} faulting and every
#: one with S_q in {1000, 2048} right. The cause: the LSE and delta tiles are 1-D TMA copies of
#: BLOCK_M entries from [B * H * S_q] vectors, starting at (b H + h) S_q + m, so with S_q * 4 bytes
#: not a multiple of 16 the boxes of every head but the first start off 16-byte alignment (a TMA
#: load from an address that is not 16-byte aligned ends in an illegal instruction:
#: triton-lang/triton#7385). Tested both ways on the next H100 run (results/*-gluon-bwd-boundary-pad-
#: off.json / -pad-on.json, S_q in 1, 64, 65, 113, 127, 128, 129, 192, 255, 256, 257, 384, 511, 1000):
#: without padding exactly the shapes with S_q % 4 != 0 faulted; with PAD_STATS (each head's row
#: padded to a multiple of BLOCK_M, copies of B * H * S_q floats, small beside the backward) every
#: one ran, and the GPU matrix passed (16 of 16) with compute-sanitizer clean. KNOWN_BROKEN_ON_GPU
#: (FA4_GLUON_BWD_BROKEN=1) refuses it again, should a new fault appear.
KNOWN_BROKEN_ON_GPU = os.environ.get("FA4_GLUON_BWD_BROKEN", "") == "1"

#: FA4_GLUON_BWD_PAD_STATS=0 turns the padding off (to reproduce the fault: ``sweep`` boundary).
PAD_STATS = os.environ.get("FA4_GLUON_BWD_PAD_STATS", "1") != "0"


def check_device(q: torch.Tensor) -> None:
    """Raise, saying why, where this kernel cannot run (no Gluon, not CUDA, not sm_90, or
    KNOWN_BROKEN_ON_GPU); else nothing."""
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
    if KNOWN_BROKEN_ON_GPU:
        raise RuntimeError(
            "gluon backward: refused (KNOWN_BROKEN_ON_GPU, set by FA4_GLUON_BWD_BROKEN=1); use bwd='fused' "
            "or 'fa2', or unset it"
        )


def pad_stats(lse: torch.Tensor, delta: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """LSE and delta [B, H, S_q] with each head's row zero-padded to a whole number of ``block_m``
    tiles, and that row length: every 1-D TMA box of ``block_m`` entries then starts 16-byte aligned
    and inside its own head's row (see PAD_STATS). Unchanged where S_q is already a multiple."""
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
    skip: int = 0,
    dq_tma: bool | None = None,
    dq_defer: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of attention from the forward's output ``o`` and base-2 log-sum-exp ``lse``.

    q, o, do: [B, S_q, H, D]; k, v: [B, S_k, H_kv, D], H_kv dividing H, D in {64, 128}, bf16 or fp16;
    lse: [B, H, S_q] float32 (either forward's). Causal needs S_q <= S_k. Hopper (sm_90) only.
    delta = rowsum(dO * O) and the zeroed fp32 dQ buffer come from ``bwd_fused``'s preprocess kernel.
    ``skip``: parts left out to locate a fault (BISECT; the gradients are then wrong), 0 in use.
    ``dq_tma``: dQ added by TMA bulk reductions from shared memory instead of per-element atomics;
    ``dq_defer``: each step's dQ product one step later, off the dS^T exchange's barrier (module flags
    DQ_TMA / DQ_DEFER when None; both off by default, not yet run on a GPU).
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from repro.fa4.bwd_fused import preprocess

    check_device(q)
    if q.dtype not in GLUON_DTYPES:
        raise TypeError(f"gluon backward: q has dtype {q.dtype}, expected bfloat16 or float16")
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    if causal and s_q > s_k:
        raise ValueError(f"gluon backward: causal needs S_q <= S_k, got S_q = {s_q}, S_k = {s_k}")
    cx = _constexprs(
        d, causal, block_m, num_stages, skip,
        DQ_TMA if dq_tma is None else dq_tma, DQ_DEFER if dq_defer is None else dq_defer,
    )  # fmt: skip
    bm = cx["BLOCK_M"]
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    delta, dq_acc = preprocess(o, do)
    lse = lse.contiguous()
    lse, delta, s_stat = pad_stats(lse, delta, bm) if PAD_STATS else (lse, delta, s_q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    qo_layout, kv_layout, vec_layout = _layouts(
        d, bm, {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    )

    def desc(t, block, layout):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    q_desc, do_desc = (desc(t.view(b * s_q, h * d), [bm, d], qo_layout) for t in (q, do))
    k_desc, v_desc = (desc(t.view(b * s_k, h_kv * d), [BLOCK_N, d], kv_layout) for t in (k, v))
    lse_desc, delta_desc = (desc(t.view(-1), [bm], vec_layout) for t in (lse, delta))
    # DQ_TMA: the fp32 dQ buffer [B, S_q, H, D] as [B * S_q, H * D], one consumer's part per box
    dq_arg = desc(dq_acc.view(b * s_q, h * d), [bm, d // 2], _dq_layout(d, bm)) if cx["DQ_TMA"] else dq_acc
    _gluon_bwd_kernel[(-(-s_k // BLOCK_N), b * h_kv)](
        q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, dq_arg, dk, dv,
        h, h_kv, h // h_kv, s_q, s_k, s_stat, scale / math.log(2.0), scale, **cx, num_warps=4,
    )  # fmt: skip
    return dq_acc.to(q.dtype), dk, dv


# ---------------------------------------------------------------------------------------------
# Offline compile for sm_90a (no GPU): shared memory, registers, spills, wgmma / TMA / atomics in PTX
# ---------------------------------------------------------------------------------------------


def compile_for_sm90(d: int, causal: bool, dtype: str = "bf16", block_m: int | None = None,
                     num_stages: int | None = None, skip: int = 0, dq_tma: bool = False,
                     dq_defer: bool = False):  # fmt: skip
    """The kernel compiled for sm_90a without a GPU; returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cx = _constexprs(d, causal, block_m, num_stages, skip, dq_tma, dq_defer)
    bm = cx["BLOCK_M"]
    qo_layout, kv_layout, vec_layout = _layouts(d, bm, {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    signature = {
        "q_desc": f"tensordesc<{dtype}[{bm}, {d}],{qo_layout!r}>",
        "do_desc": f"tensordesc<{dtype}[{bm}, {d}],{qo_layout!r}>",
        "lse_desc": f"tensordesc<fp32[{bm}],{vec_layout!r}>",
        "delta_desc": f"tensordesc<fp32[{bm}],{vec_layout!r}>",
        "k_desc": f"tensordesc<{dtype}[{BLOCK_N}, {d}],{kv_layout!r}>",
        "v_desc": f"tensordesc<{dtype}[{BLOCK_N}, {d}],{kv_layout!r}>",
        "DQACC": f"tensordesc<fp32[{bm}, {d // 2}],{_dq_layout(d, bm)!r}>" if dq_tma else "*fp32",
        "DK": f"*{dtype}", "DV": f"*{dtype}",
        "H": "i32", "H_KV": "i32", "GROUP": "i32", "S_Q": "i32", "S_K": "i32", "S_STAT": "i32",
        "qk_scale": "fp32", "sm_scale": "fp32",
        **{name: "constexpr" for name in cx},
    }  # fmt: skip
    src = GluonASTSource(_gluon_bwd_kernel, signature, constexprs=cx)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4))


def compile_report(cases) -> list[dict]:
    """Offline sm_90a compile of each (d, causal, dtype[, block_m, num_stages[, skip[, dq_tma[, dq_defer]]]]):
    shared memory (bytes), warps, ptxas registers and spills (the launch allocation; setmaxnreg then
    gives the load warp 24 and the consumers 240), setmaxnreg values, and counts in the PTX of wgmma,
    TMA loads, atomics, TMA bulk reductions (``cp.reduce.async.bulk``, each with its reduce kind and
    type), bulk-group commits and waits, mbarrier waits and named-barrier syncs."""
    import re

    from paperclub.triton_compat import ptxas_usage

    rows = []
    for case in cases:
        d, causal, dtype = case[:3]
        bm, ns = (list(case[3:5]) + [None, None])[:2]
        skip = int(case[5]) if len(case) > 5 else 0
        dq_tma, dq_defer = (bool(x) for x in (list(case[6:8]) + [False, False])[:2])
        row = dict(d=d, causal=causal, dtype=dtype, block_m=bm, num_stages=ns, skip=skip,
                   dq_tma=dq_tma, dq_defer=dq_defer)  # fmt: skip
        try:
            c = compile_for_sm90(d, causal, dtype, bm, ns, skip, dq_tma, dq_defer)
            ptx = c.asm["ptx"]
            row.update(
                shared=c.metadata.shared,
                num_warps=c.metadata.num_warps,
                target_ok=".target sm_90a" in ptx,
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                atomics=sorted(set(re.findall(r"\b(?:red|atom)\.global[\w.]*", ptx))),
                atomic_count=len(re.findall(r"\b(?:red|atom)\.global", ptx)),
                bulk_reduce=len(re.findall(r"cp\.reduce\.async\.bulk", ptx)),
                bulk_reduce_kinds=sorted(set(re.findall(r"cp\.reduce\.async\.bulk[\w.:]*", ptx))),
                bulk_commit=len(re.findall(r"cp\.async\.bulk\.commit_group", ptx)),
                bulk_wait=len(re.findall(r"cp\.async\.bulk\.wait_group", ptx)),
                mbarrier_waits=len(re.findall(r"mbarrier\.try_wait", ptx)),
                bar_syncs=len(re.findall(r"\bbar(?:rier)?\.sync", ptx)),
                ptx_sha=__import__("hashlib").sha256(ptx.encode()).hexdigest()[:16],
                setmaxnreg=sorted(
                    {int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
                ),
                **ptxas_usage(ptx),
            )
        except Exception as exc:  # report it: the caller decides
            row["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        rows.append(row)
    return rows


#: The variants compiled by ``python -m repro.fa4.gluon_bwd`` and tests/test_gluon_bwd.py.
COMPILE_CASES = [[d, c, t] for d in GLUON_HEAD_DIMS for c in (False, True) for t in ("bf16", "fp16")]
#: The dQ variants' offline compiles in tests/test_gluon_bwd.py: "tma-defer" (FA3's way, both changes)
#: at every head dim, causality and dtype; each change alone at D = 128, causal, bf16 and D = 64, fp16.
VARIANT_COMPILE_CASES = [
    *[[d, c, t, None, None, 0, True, True] for d, c, t in COMPILE_CASES],
    *[[d, c, t, None, None, 0, *DQ_VARIANTS[v]] for v in ("tma", "defer")
      for d, c, t in ((128, True, "bf16"), (64, False, "fp16"))],
]  # fmt: skip

#: Parts left out, one run each, to find which one ends the kernel in "an illegal instruction" (the
#: first H100 run): bits of SKIP, 1 the dQ atomics, 2 the dS^T exchange between the consumers and
#: the dQ product, 4 the dK product, 8 the dV product, 16 the LSE / delta TMA copies. A variant
#: that runs where 0 does not points at what it left out.
BISECT = (0, 1, 2, 3, 4, 8, 16, 2 | 4, 2 | 4 | 8, 1 | 2 | 4 | 8 | 16)
#: The bisect of a dQ variant other than "atomic": the variant whole, without its dQ adds (1: the bulk
#: reductions or atomics), without the LSE / delta copies (16), and the default kernel (variant
#: "atomic", skip 0) run in the same way beside it.
VARIANT_BISECT = (0, 1, 16)


def max_rel_err(got, ref) -> float:
    """The largest of ||a - r|| / ||r|| over matching gradients (fp32): the bisect's and sweep's measure."""
    return max(
        float((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
        for a, r in zip(got, ref, strict=True)
    )


def bisect_one(
    skip: int,
    d: int = 128,
    causal: bool = False,
    shape: tuple[int, ...] = (1, 512, 512, 2, 2),
    variant: str = "atomic",
) -> dict:
    """Run the kernel once with ``skip`` and dQ variant ``variant`` (DQ_VARIANTS) on the GPU at ``shape``
    (B, S_q, S_k, H, H_kv; bf16); report whether it finished and its gradients' largest relative
    error against the FA2 Triton backward (meaningful for skip 0)."""
    from repro.fa4 import attention

    b, s_q, s_k, h, h_kv = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv), (s_q, h))
    )
    scale = d**-0.5
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o = attention(*leaves, causal=causal, bwd="fa2")
    ref = torch.autograd.grad(o, leaves, do)
    # the forward's base-2 log-sum-exp [B, H, S_q], from the reference softmax (fp32)
    kk = k.float().repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    if causal:  # bottom-right aligned, as attention() does for S_q < S_k
        s = s.masked_fill(torch.ones(s_q, s_k, device="cuda").triu(s_k - s_q + 1).bool(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1) / math.log(2.0)
    dq_tma, dq_defer = DQ_VARIANTS[variant]
    got = gluon_attention_backward(
        do, q, k, v, o.detach(), lse.contiguous(), causal, scale, skip=skip, dq_tma=dq_tma, dq_defer=dq_defer
    )
    torch.cuda.synchronize()
    err = max_rel_err(got, ref)
    return {"skip": skip, "dq": variant, "status": "ran", "rel_err": err}


def bisect_plan(variants=("atomic",)) -> list[tuple[str, int]]:
    """(variant, skip) runs of ``bisect``: BISECT for "atomic", VARIANT_BISECT for any other, each
    other variant's runs after a plain run of the default kernel."""
    plan = []
    for v in variants:
        if v not in DQ_VARIANTS:
            raise ValueError(f"gluon backward: dQ variant must be one of {list(DQ_VARIANTS)}, got {v!r}")
        if v == "atomic":
            plan += [("atomic", s) for s in BISECT]
        else:
            plan += [("atomic", 0)] * (("atomic", 0) not in plan) + [(v, s) for s in VARIANT_BISECT]
    return plan


def bisect(
    out: str | None = None, timeout_s: float = 120.0, shape: str = "1,512,512,2,2", variants=("atomic",)
) -> list[dict]:
    """Each (variant, skip) of ``bisect_plan(variants)`` in its own process (a fault leaves the CUDA
    context unusable), with a time limit (a hang is a result too), at ``shape`` "B,S_q,S_k,H,H_kv"."""
    import subprocess
    import sys

    rows = []
    for variant, skip in bisect_plan(variants):
        cmd = [sys.executable, "-m", "repro.fa4.gluon_bwd", "--bisect-one", str(skip), shape, variant]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            row = (
                json.loads(lines[-1])
                if r.returncode == 0 and lines
                else {
                    "skip": skip,
                    "dq": variant,
                    "status": f"failed (exit {r.returncode})",
                    "error": (r.stderr or r.stdout)[-600:],
                }
            )
        except subprocess.TimeoutExpired:
            row = {"skip": skip, "dq": variant, "status": f"timeout after {timeout_s:.0f} s (a hang)"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def sweep_one(d: int, causal: bool, dtype: str, fwd: str, start: int, shapes: list | None = None) -> None:
    """The GPU matrix's shapes (tests/test_gpu_bwd.SHAPES, or ``shapes``) from index ``start`` on, through the public
    ``attention(..., bwd="gluon")``, one JSON line per shape as soon as it finishes: gradients'
    largest relative error against the FA2 Triton backward on the same forward. A fault kills the
    process after the last line it printed, which names the shape before the one that faulted."""
    from repro.fa4 import attention
    from repro.fa4.tests.test_gpu_bwd import SHAPES

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for i, (b, s_q, s_k, h, h_kv) in enumerate(shapes or SHAPES):
        if i < start or (causal and s_q > s_k):
            continue
        g = torch.Generator().manual_seed(i)
        q, k, v = (
            torch.randn(b, s, n, d, generator=g).to("cuda", dt)
            for s, n in ((s_q, h), (s_k, h_kv), (s_k, h_kv))
        )
        do = torch.randn(b, s_q, h, d, generator=g).to("cuda", dt)
        grads = []
        for bwd in ("fa2", "gluon"):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = attention(*leaves, causal=causal, bwd=bwd, gluon=fwd == "gluon")
            grads.append(torch.autograd.grad(out, leaves, do))
            torch.cuda.synchronize()
        err = max_rel_err(grads[1], grads[0])
        row = {
            "d": d,
            "causal": causal,
            "dtype": dtype,
            "fwd": fwd,
            "dq": _variant_name(),
            "shape": i,
            "B_Sq_Sk_H_Hkv": [b, s_q, s_k, h, h_kv],
        }
        print(json.dumps({**row, "status": "ran", "rel_err_vs_fa2": err}), flush=True)


def _variant_name() -> str:
    """The DQ_VARIANTS name of this process's module flags (what attention(bwd="gluon") runs)."""
    return next(n for n, flags in DQ_VARIANTS.items() if flags == (DQ_TMA, DQ_DEFER))


#: behind the Gluon forward first (the pairing that faulted, and the one the benchmark times), D = 128 first
SWEEP_GROUPS = [
    (d, c, t, f)
    for f in ("gluon", "triton")
    for d in (128, 64)
    for c in (False, True)
    for t in ("bf16", "fp16")
]


#: The H100 sweep of 2026-11-25 (D = 128, behind the Gluon forward, bf16 and fp16, causal or not):
#: every matrix shape with S_q in {1, 113} faulted ("an illegal instruction"), every one with S_q in
#: {1000, 2048} ran (1e-5 to 1e-4 from the FA2 backward), whatever S_k, B and the GQA group. These
#: shapes (B, S_q, S_k, H, H_kv) find the S_q boundary and whether the group size matters.
BOUNDARY_SHAPES = [
    *[(1, s, s, 2, 2) for s in (1, 64, 65, 113, 127, 128, 129, 192, 255, 256, 257, 384, 511)],
    (1, 113, 113, 8, 2), (1, 256, 256, 8, 2), (1, 1000, 1000, 2, 2),
]  # fmt: skip


def sweep(
    out: str | None = None,
    timeout_s: float = 90.0,
    budget_s: float = 300.0,
    shapes: list | None = None,
    variant: str = "atomic",
) -> list[dict]:
    """Every (head dim, causal, dtype, forward) group of the GPU matrix in its own process, shape by
    shape (``sweep_one``); where a process dies or hangs, the shape after its last line is recorded as
    the one that faulted and the group goes on from the next shape in a new process. With ``shapes``,
    those shapes in the first group only (D = 128, not causal, bf16, Gluon forward). ``variant``: the
    dQ variant (DQ_VARIANTS) the processes run, by their environment (``variant_env``). ``out``: a
    directory for the Report (``<device>-gluon-bwd-sweep.json`` or ``-boundary.json``; other variants
    ``-sweep-<variant>.json``)."""
    import subprocess
    import sys
    import time

    from repro.fa4.tests.test_gpu_bwd import SHAPES as MATRIX

    env = {**os.environ, **variant_env(variant)}
    SHAPES = [list(x) for x in shapes] if shapes else MATRIX
    rows, t_end = [], time.monotonic() + budget_s
    for d, causal, dtype, fwd in SWEEP_GROUPS[:1] if shapes else SWEEP_GROUPS:
        start = 0
        while start < len(SHAPES):
            if time.monotonic() > t_end:
                rows.append(
                    {
                        "d": d,
                        "causal": causal,
                        "dtype": dtype,
                        "fwd": fwd,
                        "dq": variant,
                        "status": "not run: budget",
                    }
                )
                break
            args = ["--sweep-one", str(d), str(int(causal)), dtype, fwd, str(start), json.dumps(SHAPES)]
            cmd = [sys.executable, "-m", "repro.fa4.gluon_bwd", *args]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
                text, failed, status = r.stdout, r.returncode != 0, f"failed (exit {r.returncode})"
                err = (r.stderr or "")[-600:]
            except subprocess.TimeoutExpired as exc:
                text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                failed, status, err = True, f"timeout after {timeout_s:.0f} s", ""
            done = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
            rows.extend(done)
            for row in done:
                print(json.dumps(row), flush=True)
            if not failed:
                break
            last = done[-1]["shape"] if done else start - 1
            nxt = next(
                (i for i in range(last + 1, len(SHAPES)) if not (causal and SHAPES[i][1] > SHAPES[i][2])),
                None,
            )
            if nxt is None:
                break
            bad = {"d": d, "causal": causal, "dtype": dtype, "fwd": fwd, "dq": variant, "shape": nxt,
                   "B_Sq_Sk_H_Hkv": list(SHAPES[nxt]), "status": status, "error": err}  # fmt: skip
            print(json.dumps(bad), flush=True)
            rows.append(bad)
            start = nxt + 1
    if out:
        tag = ("gluon-bwd-boundary" if shapes else "gluon-bwd-sweep") + (
            "" if variant == "atomic" else f"-{variant}"
        )
        sweep_report(rows, tag).write(tag=tag, out_dir=Path(out))
    return rows


SWEEP_COLUMNS = [
    "d",
    "causal",
    "dtype",
    "fwd",
    "dq",
    "shape",
    "B",
    "S_q",
    "S_k",
    "H",
    "H_kv",
    "status",
    "rel_err_vs_fa2",
]


def sweep_report(rows: list[dict], what: str, measure_ceilings: bool = True):
    """``sweep``'s rows as a paperclub Report (one row per shape: ran with its error against the FA2
    backward, or the process's fault; groups the budget did not reach as one row each)."""
    from paperclub.bench import Report

    rep = Report(
        package="fa4",
        title=f"Gluon backward on the GPU matrix's shapes, one process per group ({what})",
        columns=SWEEP_COLUMNS,
        peer="the FA2 Triton backward on the same forward (rel_err_vs_fa2: largest over dq, dk, dv)",
        notes="status 'failed (exit 1): an illegal instruction': the kernel faulted at that shape (the "
        "process's stderr says so); 'not run: budget': the call's budget ended before that group",
        measure_ceilings=measure_ceilings,
    )
    for r in rows:
        b, s_q, s_k, h, h_kv = r.get("B_Sq_Sk_H_Hkv") or [None] * 5
        status = r["status"]
        err = r.get("error", "").lower().replace(" ", "")
        if status.startswith("failed") and "illegalinstruction" in err:
            status += ": an illegal instruction"
        rep.add(
            d=r["d"], causal=r["causal"], dtype=r["dtype"], fwd=r["fwd"], dq=r.get("dq", "atomic"), shape=r.get("shape"),
            B=b, S_q=s_q, S_k=s_k, H=h, H_kv=h_kv, status=status, rel_err_vs_fa2=r.get("rel_err_vs_fa2"),
        )  # fmt: skip
    return rep


if __name__ == "__main__":
    import sys

    if (
        len(sys.argv) > 1 and sys.argv[1] == "--bisect"
    ):  # on an H100: python -m repro.fa4.gluon_bwd --bisect [OUT [B,S_q,S_k,H,H_kv [VARIANT,...]]]
        KNOWN_BROKEN_ON_GPU = False
        bisect(
            sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None,
            shape=sys.argv[3] if len(sys.argv) > 3 else "1,512,512,2,2",
            variants=tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ("atomic",),
        )
    elif (
        len(sys.argv) > 1 and sys.argv[1] == "--sweep"
    ):  # on an H100: --sweep [OUT_DIR [BUDGET_S [boundary|matrix [VARIANT]]]]
        KNOWN_BROKEN_ON_GPU = False
        sweep(
            sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None,
            budget_s=float(sys.argv[3]) if len(sys.argv) > 3 else 300.0,
            shapes=BOUNDARY_SHAPES if len(sys.argv) > 4 and sys.argv[4] == "boundary" else None,
            variant=sys.argv[5] if len(sys.argv) > 5 else "atomic",
        )
    elif len(sys.argv) > 6 and sys.argv[1] == "--sweep-one":
        import repro.fa4.gluon_bwd as dispatched  # the module attention(bwd="gluon") calls, not __main__

        dispatched.KNOWN_BROKEN_ON_GPU = False
        a = sys.argv[2:]
        sweep_one(int(a[0]), bool(int(a[1])), a[2], a[3], int(a[4]), json.loads(a[5]) if len(a) > 5 else None)
    elif len(sys.argv) > 2 and sys.argv[1] == "--bisect-one":
        KNOWN_BROKEN_ON_GPU = False
        shp = tuple(int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,512,512,2,2").split(","))
        var = sys.argv[4] if len(sys.argv) > 4 else "atomic"
        print(
            json.dumps({**bisect_one(int(sys.argv[2]), shape=shp, variant=var), "shape": list(shp)}),
            flush=True,
        )
    else:
        # python -m repro.fa4.gluon_bwd [JSON list of [d, causal, dtype(, block_m, num_stages)]]: offline report
        cases = json.loads(sys.argv[1]) if len(sys.argv) > 1 else COMPILE_CASES
        print(json.dumps(compile_report(cases)))
