"""The peers of :mod:`repro.usp.dist_bench`: PyTorch's context parallel and yunchang (the authors' USP
library), checked against the same reference and timed in the same interleaved rounds as ours.

* :func:`cp_entry`: ``torch.distributed.tensor.experimental.context_parallel`` (ring attention over
  SDPA, torchtitan's), load balancing on for causal masks and off otherwise (it refuses non-causal
  with it on); K/V expanded to H heads (its SDPA path has no GQA).
* :func:`yunchang_entry`: ``yunchang.LongContextAttention`` on a P_u x P_r mesh, forward only
  (without flash-attn its PyTorch attention types have no backward), with yunchang's own sharding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paperclub.testing import rel_error
from repro.usp.dist_harness import (
    Ctx,
    Entry,
    _expand,
    _free,
    _grad,
    _importable,
    _ref_cache,
    _report,
    _say,
    _write,
    attention_flops,
    full_reference,
    lazy,
    make_inputs,
    run_block,
    splits,
    usp_entry,
)  # fmt: skip

__all__ = ["cp_entry", "mode_peers", "yunchang_entry"]


def cp_entry(ctx, full, fullref, *, P, causal, rotate="allgather", backend="cudnn") -> Entry:
    """torch.distributed.tensor.experimental.context_parallel over a replica of P ranks (ring attention
    over SDPA; load balancing on for causal, off otherwise: it refuses non-causal with it on)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (
        _cp_options,
        context_parallel_unshard,
        set_rotate_method,
    )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = ("cp", P)
    if key not in ctx._groups:
        mesh = init_device_mesh(ctx.device.type, (ctx.world // P, P), mesh_dim_names=("dp", "cp"))
        ctx._groups[key] = mesh["cp"]
    mesh = ctx._groups[key]
    q, k, v, do = full
    B, S = q.shape[:2]
    # its SDPA has no GQA here: K/V expanded to H heads (outside the timed call), as a model would
    pristine = [t.transpose(1, 2).contiguous() for t in (q, _expand(k, ctx.H), _expand(v, ctx.H), do)]
    kernel = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    state = {}

    class _Ctx:
        def __enter__(self):
            _cp_options.enable_load_balance = causal
            set_rotate_method(rotate)
            bufs = [t.clone() for t in pristine]
            self.k = sdpa_kernel(kernel)
            self.c = context_parallel(
                mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)
            )
            self.k.__enter__()
            self.c.__enter__()
            state["leaves"] = [b.detach().requires_grad_(True) for b in bufs[:3]]
            state["do"] = bufs[3]
            return self

        def __exit__(self, *exc):
            self.c.__exit__(*exc)
            self.k.__exit__(*exc)
            state.clear()
            return False

    def fwd():
        return F.scaled_dot_product_attention(*state["leaves"], is_causal=causal)

    def run():
        _grad(fwd(), state["leaves"], state["do"])

    def check():
        with _Ctx():
            o = fwd()
            grads = _grad(o, state["leaves"], state["do"])
            got = context_parallel_unshard(mesh, [o.detach(), *grads], [2] * 4)
        o_f, dq_f, dk_f, dv_f = (t.transpose(1, 2).float() for t in got)
        h_kv = full[1].shape[2]
        fold = lambda g: g.reshape(B, S, h_kv, ctx.H // h_kv, ctx.D).sum(3)  # noqa: E731
        return max(rel_error(o_f, fullref["o"].float()), rel_error(dq_f, fullref["dq"].float()),
                   rel_error(fold(dk_f), fullref["dk"].float()), rel_error(fold(dv_f), fullref["dv"].float()))  # fmt: skip

    row = dict(impl=f"torch context_parallel ({rotate}, {backend})", gpus=P, ulysses=1, ring=P,
               layout="zigzag" if causal else "contiguous", backend=backend, head_groups=1, S=S, S_per_gpu=S // P,
               B=B, note="K/V expanded to H heads; load balancing " + ("on" if causal else "off"))  # fmt: skip
    return Entry(
        row, run, check, attention_flops(B, S, ctx.H, ctx.D, causal, "fwd+bwd") / P, B * S, context=_Ctx
    )


_YC_PG: dict = {}


def yunchang_entry(ctx, full, fullref, *, P, pu, pr, causal, attn="torch_cudnn") -> Entry:
    """yunchang's LongContextAttention (the authors' USP) on a P_u x P_r mesh, forward only (its
    PyTorch attention types have no backward); zigzag ring for causal, basic otherwise; its own
    sharding (yunchang's extract functions), checked against the reference at those positions."""
    import yunchang
    from yunchang import EXTRACT_FUNC_DICT, LongContextAttention, set_seq_parallel_pg
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType

    if (pu, pr) not in _YC_PG:
        set_seq_parallel_pg(pu, pr, ctx.rank, ctx.world)
        _YC_PG[pu, pr] = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _YC_PG[pu, pr]
    impl_type = "zigzag" if causal else "basic"
    attn_mod = LongContextAttention(ring_impl_type=impl_type, attn_type=AttnType.from_string(attn))
    extract = EXTRACT_FUNC_DICT[impl_type]
    sp = ctx.rank % P
    q, k, v, _ = full
    B, S = q.shape[:2]
    loc = [extract(t, sp, P, rd=pr, ud=pu).contiguous() for t in (q, _expand(k, ctx.H), _expand(v, ctx.H))]
    pos = extract(torch.arange(S, device=ctx.device).view(1, S, 1), sp, P, rd=pr, ud=pu).view(-1)

    def run():
        with torch.no_grad():
            attn_mod(*loc, causal=causal)

    def check():
        with torch.no_grad():
            o = attn_mod(*loc, causal=causal)
        return rel_error(o.float(), fullref["o"][:, pos].float())

    row = dict(impl=f"yunchang {yunchang.__version__} {attn} {pu}x{pr}", gpus=P, ulysses=pu, ring=pr,
               layout=impl_type, backend=attn, head_groups=1, S=S, S_per_gpu=S // P, B=B,
               note="forward only; K/V expanded to H heads")  # fmt: skip
    return Entry(row, run, check, attention_flops(B, S, ctx.H, ctx.D, causal, "fwd") / P, B * S)


def mode_peers(ctx: Ctx, args) -> None:
    """Ours, torch CP and yunchang at the same shapes, in the same interleaved rounds."""
    report = _report(
        ctx,
        "peers",
        notes=(
            f"bf16, B = 1, H = {ctx.H}, H_kv = {ctx.H_kv}, D = {ctx.D}. Ours, torch's context_parallel (fwd+bwd) and "
            "yunchang (forward only: without flash-attn its PyTorch attention types have no backward) at the same "
            "shapes, checked against one-device SDPA, in interleaved rounds (pass says fwd+bwd or fwd). torch CP "
            "runs with load balancing on for causal masks and off otherwise (it refuses non-causal with it on). "
            "yunchang's torch_cudnn type returns a zero LSE, so its ring merge is only right at ring degree 1; "
            "its torch_flash type returns the real LSE."
        ),
    )
    world = ctx.world
    s_list = args.s_per_gpu or ([1024] if ctx.smoke else [16384, 32768])
    ps = [p for p in (world, 2) if p <= world and world % p == 0 and (p > 1)]
    ps = list(dict.fromkeys(ps))
    have_yc = _importable("yunchang")
    for i, s in enumerate(s_list):
        for p in ps if i == 0 else ps[:1]:
            S = s * p
            for causal in (True, False):
                est = attention_flops(1, S, ctx.H, ctx.D, causal, "fwd+bwd") / p * 60 / 300e12
                if ctx.left() < est:
                    _say(ctx, f"[peers] skip S={S} gpus={p} causal={causal}: {est:.0f} s estimated")
                    continue
                _say(ctx, f"[peers] S={S} gpus={p} causal={causal}")
                full = make_inputs(ctx, 1, S)
                ref_for = _ref_cache(ctx, full, p, causal)
                fullref_box: dict = {}

                def fullref(ref_for=ref_for, p=p, box=fullref_box):
                    if not box:
                        box.update(full_reference(ctx, ref_for("zigzag"), p, "zigzag"))
                    return box

                for passes in ("fwd+bwd", "fwd"):
                    specs = []
                    for pu, pr in splits(ctx, p):
                        specs.append(lazy(lambda full=full, ref_for=ref_for, p=p, pu=pu, pr=pr, passes=passes, causal=causal: usp_entry(
                            ctx, full, ref_for("zigzag"), P=p, pu=pu, pr=pr, layout="zigzag", causal=causal,
                            passes=passes), impl=f"usp {pu}x{pr}", gpus=p, S=S))  # fmt: skip
                    if passes == "fwd+bwd" and ctx.cuda:
                        rotates = ["allgather", "alltoall"] if i == 0 else ["allgather"]
                        for rot in rotates:
                            for be in ["cudnn", "flash"] if i == 0 and rot == "allgather" else ["cudnn"]:
                                specs.append(lazy(lambda full=full, p=p, rot=rot, be=be, causal=causal, fullref=fullref: cp_entry(
                                    ctx, full, fullref(), P=p, causal=causal, rotate=rot, backend=be),
                                    impl=f"torch context_parallel ({rot}, {be})", gpus=p, S=S))  # fmt: skip
                    if passes == "fwd" and have_yc and ctx.cuda:
                        for pu, pr in splits(ctx, p):
                            for attn in ("torch_cudnn", "torch_flash") if pr > 1 else ("torch_cudnn",):
                                specs.append(lazy(lambda full=full, p=p, pu=pu, pr=pr, attn=attn, causal=causal, fullref=fullref: yunchang_entry(
                                    ctx, full, fullref(), P=p, pu=pu, pr=pr, causal=causal, attn=attn),
                                    impl=f"yunchang {attn} {pu}x{pr}", gpus=p, S=S))  # fmt: skip
                    run_block(ctx, report, specs, causal=causal, passes=passes,
                              base=dict(H=ctx.H, H_kv=ctx.H_kv, D=ctx.D), target_s=0.05 if ctx.smoke else 0.25)  # fmt: skip
                    if passes == "fwd" and not have_yc:
                        report.add(impl="yunchang", causal=causal, **{"pass": "fwd"}, gpus=p, S=S,
                                   check="failed: yunchang is not installed")  # fmt: skip
                del full, fullref_box
                _free(ctx)
                _write(ctx, report, "peers")
