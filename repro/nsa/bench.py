"""``python -m repro.nsa.bench --out DIR --budget-s N [--quick]``: NSA on one GPU at the paper's shape.

The paper's attention shape (yuan2025nsa §5: 64 query heads in 4 GQA groups, head dim 128, bf16),
B = 1, T = 8k .. 64k. Rows (``section``):

* ``train``: forward and forward + backward of
  - ``sdpa-*``: full causal attention, SDPA's backends (flash, cuDNN) at the first length, then the
    faster one; ``fa4``: repro.fa4's Triton attention (up to 16k);
  - ``nsa``: our three branches at the paper's l = 32, d = 16, l' = 64, n = 16, w = 512 (compressed
    keys given: the compression MLP is a small GEMM, left out of both);
  - ``ours-cmp+slc`` and ``fla-cmp+slc``: flash-linear-attention's setting, compression by mean
    pooling with l = d = l' = 64, n = 16, compressed + selected branches with gates, no window (fla's
    window calls flash-attn, absent here), both computing their own top-n;
  - ``ours-slc`` and ``fla-slc``: the selected branch alone on the same block indices.
* ``decode``: one token against caches of T tokens, B = 16: ``nsa-decode`` (our two kernels, top-n in
  PyTorch) against ``sdpa-decode`` (full attention, GQA); ``tokens`` is what the decode kernels
  counted per group, ``paper_tokens`` Table 4's number.

Every candidate is checked first (``paperclub.bench.measure``): against the PyTorch reference on a
sample of query rows, and fla against our output on the same indices.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from paperclub.bench import Candidate, Report, measure
from paperclub.testing import assert_rel_close
from repro.nsa import ops
from repro.nsa import reference as ref

HQ, H, D = 64, 4, 128
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU smoke run changes these (and HQ, H, D)
PAPER = ref.NSAConfig()
FLA_SETUP = ref.NSAConfig(block_len=64, stride=64, select_len=64, n_select=16, n_initial=1, n_local=2)
TABLE4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}
TOL = 2e-2  # bf16 output against an fp32 reference: a few bf16 roundings (2^-8 each)
COLUMNS = ["section", "impl", "pass", "B", "T", "ms", "ms_min", "ms_max", "check", "speedup_vs_full"]
COLUMNS += ["tokens", "paper_tokens"]


def load_fla():
    """fla's parallel_nsa, or (None, why) when it cannot be imported."""
    try:
        from fla.ops.nsa.parallel import parallel_nsa

        return parallel_nsa, ""
    except Exception as exc:  # optional peer
        return None, f"import fla.ops.nsa failed: {type(exc).__name__}: {exc}"


def sample_rows(t: int, gen: torch.Generator, n: int = 24) -> torch.Tensor:
    return torch.cat([torch.randint(0, t, (n,), generator=gen), torch.tensor([t - 1])]).unique().to(DEVICE)


def full_rows(q, k, v, pos):
    return ref.full_causal_attention(q[:, pos], k, v, q_pos=pos)


def train_inputs(t: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, device=DEVICE, dtype=DTYPE, generator=g)

    q = rn(1, t, HQ, D)
    kv = [rn(1, t, H, D) for _ in range(6)]
    gates = torch.rand(1, t, HQ, 3, device=DEVICE, generator=g).to(DTYPE)
    return q, kv, gates


def fwd_bwd(f, leaves):
    """A closure running f's forward and the backward of a random cotangent (drawn on the first call)."""
    state = {}

    def run():
        o = f()
        if "do" not in state:
            state["do"] = torch.randn_like(o)
        torch.autograd.grad(o, leaves, state["do"], allow_unused=True)

    return run


def sdpa_fn(q, k, v, backend):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o

    return run


def train_candidates(t: int, fla, sdpa_backends: dict, with_fa4: bool, gen: torch.Generator):
    """{(impl, pass): Candidate} for one length."""
    q, (kc_raw, vc_raw, ks, vs, kw, vw), gates = train_inputs(t)
    pos = sample_rows(t, gen)
    cands = {}

    # full attention: [B, HQ, T, D] with the KV heads repeated for SDPA's kernels
    qt = q.transpose(1, 2).contiguous().requires_grad_()
    kt = ks.repeat_interleave(HQ // H, 2).transpose(1, 2).contiguous().requires_grad_()
    vt = vs.repeat_interleave(HQ // H, 2).transpose(1, 2).contiguous().requires_grad_()
    ref_full = full_rows(q, ks, vs, pos)
    for name, backend in sdpa_backends.items():
        f = sdpa_fn(qt, kt, vt, backend)

        def check(f=f):
            assert_rel_close(f().transpose(1, 2)[:, pos].float(), ref_full, TOL, "sdpa rows")

        cands[(name, "fwd")] = Candidate(fn=f, check=check)
        cands[(name, "fwd+bwd")] = Candidate(fn=fwd_bwd(f, (qt, kt, vt)), check=check)
    if with_fa4:
        try:
            from repro.fa4 import attention

            ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, ks, vs))

            def f4():
                return attention(ql, kl, vl, causal=True)

            def check4():
                assert_rel_close(f4()[:, pos].float(), ref_full, TOL, "fa4 rows")

            cands[("fa4", "fwd")] = Candidate(fn=f4, check=check4)
            cands[("fa4", "fwd+bwd")] = Candidate(fn=fwd_bwd(f4, (ql, kl, vl)), check=check4)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"

            def fail(err=err):
                raise RuntimeError(err)

            cands[("fa4", "fwd")] = Candidate(fn=fail, check=fail)

    # NSA at the paper's configuration
    cfg = PAPER
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)]

    def nsa():
        return ops.nsa_attention(*leaves, cfg)[0]

    def check_nsa():
        o, idx = ops.nsa_attention(*leaves, cfg)
        ql, kcl, vcl, ksl, vsl, kwl, vwl, gl = (x.detach() for x in leaves)
        o_c, _ = ref.compressed_attention(ql[:, pos], kcl, vcl, cfg.block_len, cfg.stride, q_pos=pos)
        o_s = ref.selected_attention(ql[:, pos], ksl, vsl, idx[:, pos], cfg.select_len, q_pos=pos)
        o_w = ref.sliding_window_attention(ql[:, pos], kwl, vwl, cfg.window, q_pos=pos)
        g = gl[:, pos].float()
        want = g[..., 0:1] * o_c + g[..., 1:2] * o_s + g[..., 2:3] * o_w
        assert_rel_close(o[:, pos].float(), want, TOL, "nsa rows")

    cands[("nsa", "fwd")] = Candidate(fn=nsa, check=check_nsa)
    cands[("nsa", "fwd+bwd")] = Candidate(fn=fwd_bwd(nsa, leaves), check=check_nsa)

    # flash-linear-attention's setting: mean-pooled compression, l = d = l' = 64, no window
    fs = FLA_SETUP
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, ks, vs))
    g_cmp = gates[..., 0].detach().clone().requires_grad_()
    g_slc = gates[..., 1].detach().clone().requires_grad_()
    state = {}

    def ours_cs():
        kc = ref.compress(kl, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vl, ref.mean_pool, fs.block_len, fs.stride)
        o_c, lse = ops.compressed_attention(ql, kc, vc, fs.block_len, fs.stride)
        with torch.no_grad():
            ns = -(-t // fs.select_len)
            sc = ops.selection_scores(ql, kc, lse, ns, fs.block_len, fs.stride, fs.select_len)
            idx = ref.select_blocks(sc, fs.n_select, fs.select_len, fs.n_initial, fs.n_local)
        state["idx"] = idx
        o_s = ops.selected_attention(ql, kl, vl, idx, fs.select_len, check_indices=False)
        return g_cmp[..., None] * o_c + g_slc[..., None] * o_s

    def check_ours_cs():
        o = ours_cs()
        qd, kd, vd = ql.detach(), kl.detach(), vl.detach()
        kc = ref.compress(kd, ref.mean_pool, fs.block_len, fs.stride)
        vc = ref.compress(vd, ref.mean_pool, fs.block_len, fs.stride)
        o_c, _ = ref.compressed_attention(qd[:, pos], kc, vc, fs.block_len, fs.stride, q_pos=pos)
        o_s = ref.selected_attention(qd[:, pos], kd, vd, state["idx"][:, pos], fs.select_len, q_pos=pos)
        want = g_cmp[:, pos, :, None].float() * o_c + g_slc[:, pos, :, None].float() * o_s
        assert_rel_close(o[:, pos].detach().float(), want, TOL, "ours cmp+slc rows")

    cs_leaves = (ql, kl, vl, g_cmp, g_slc)
    cands[("ours-cmp+slc", "fwd")] = Candidate(fn=ours_cs, check=check_ours_cs)
    cands[("ours-cmp+slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(ours_cs, cs_leaves), check=check_ours_cs)

    # the selected branch alone, on the indices the paper configuration selects for these inputs
    # (computed on first use, so that a failing kernel fails this row's check, not the whole run)
    sl = (ql, kl, vl)

    def indices():
        if "slc_idx" not in state:
            with torch.no_grad():
                state["slc_idx"] = ops.nsa_attention(*[x.detach() for x in leaves], cfg)[1]
        return state["slc_idx"]

    def ours_slc():
        return ops.selected_attention(ql, kl, vl, indices(), cfg.select_len, check_indices=False)

    def check_ours_slc():
        want = ref.selected_attention(
            ql.detach()[:, pos], kl.detach(), vl.detach(), indices()[:, pos], cfg.select_len, q_pos=pos
        )
        assert_rel_close(ours_slc()[:, pos].detach().float(), want, TOL, "ours slc rows")

    cands[("ours-slc", "fwd")] = Candidate(fn=ours_slc, check=check_ours_slc)
    cands[("ours-slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(ours_slc, sl), check=check_ours_slc)

    parallel_nsa, why = fla
    if parallel_nsa is None:

        def missing(why=why):
            raise RuntimeError(why)

        for name in ("fla-cmp+slc", "fla-slc"):
            for p in ("fwd", "fwd+bwd"):
                cands[(name, p)] = Candidate(fn=missing, check=missing)
    else:

        def fla_cs():
            return parallel_nsa(ql, kl, vl, g_cmp=g_cmp, g_slc=g_slc, block_counts=fs.n_select,
                                block_size=fs.select_len, window_size=0)  # fmt: skip

        def check_fla_cs():
            # fla picks its own blocks from its own bf16 scores, so a few rows may select differently
            # near ties: 90% of the (query, head) rows must agree with ours to bf16 precision.
            a, b = fla_cs().float(), ours_cs().float()
            row_err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
            flat = row_err.flatten()
            q90 = torch.quantile(flat[:: max(1, flat.numel() // 1_000_000)], 0.9).item()
            assert torch.isfinite(a).all(), "fla cmp+slc: non-finite output"
            assert q90 <= TOL, f"fla cmp+slc vs ours: 90th percentile of row errors {q90:.3e} > {TOL}"

        def fla_slc():
            return parallel_nsa(ql, kl, vl, block_indices=indices(), block_counts=cfg.n_select,
                                block_size=cfg.select_len, window_size=0)  # fmt: skip

        def check_fla_slc():
            assert_rel_close(fla_slc().float(), ours_slc().float(), TOL, "fla slc vs ours")

        cands[("fla-cmp+slc", "fwd")] = Candidate(fn=fla_cs, check=check_fla_cs)
        cands[("fla-cmp+slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(fla_cs, cs_leaves), check=check_fla_cs)
        cands[("fla-slc", "fwd")] = Candidate(fn=fla_slc, check=check_fla_slc)
        cands[("fla-slc", "fwd+bwd")] = Candidate(fn=fwd_bwd(fla_slc, sl), check=check_fla_slc)
    return cands


def decode_candidates(t: int, b: int, gen: torch.Generator):
    cfg = PAPER
    g = torch.Generator(device=DEVICE).manual_seed(t)

    def rn(*s):
        return torch.randn(*s, device=DEVICE, dtype=DTYPE, generator=g)

    q = rn(b, 1, HQ, D)
    kc_raw, vc_raw, ks, vs, kw, vw = (rn(b, t, H, D) for _ in range(6))
    k_cmp = ref.compress(kc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    v_cmp = ref.compress(vc_raw, ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
    del kc_raw, vc_raw
    gates = torch.rand(b, 1, HQ, 3, device=DEVICE, generator=g).to(DTYPE)
    args = (q, k_cmp, v_cmp, ks, vs, kw, vw, gates)
    counted = {}

    def ours():
        return ops.nsa_decode(*args, cfg)[0]

    def check_ours():
        o, idx, counts = ops.nsa_decode(*args, cfg)
        counted["tokens"] = int(counts[0, 0].sum())
        pos = torch.tensor([t - 1], device=DEVICE)
        a1 = [x[:1] for x in args]
        o_c, _ = ref.compressed_attention(a1[0], a1[1], a1[2], cfg.block_len, cfg.stride, q_pos=pos)
        o_s = ref.selected_attention(a1[0], a1[3], a1[4], idx[:1], cfg.select_len, q_pos=pos)
        o_w = ref.sliding_window_attention(a1[0], a1[5], a1[6], cfg.window, q_pos=pos)
        gg = a1[7].float()
        want = gg[..., 0:1] * o_c + gg[..., 1:2] * o_s + gg[..., 2:3] * o_w
        assert_rel_close(o[:1].float(), want, TOL, "decode row")

    qt, kt, vt = q.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)

    def full():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    def check_full():
        want = ref.full_causal_attention(q[:1], ks[:1], vs[:1], q_pos=torch.tensor([t - 1], device=DEVICE))
        assert_rel_close(full()[:1].transpose(1, 2).float(), want, TOL, "sdpa decode row")

    return {
        "nsa-decode": Candidate(fn=ours, check=check_ours),
        "sdpa-decode": Candidate(fn=full, check=check_full),
    }, counted


def warm_up(fla, backends: dict, t: int = 1024) -> None:
    """Run every candidate once at a small length: Triton compiles (and fla autotunes) here."""
    try:
        cands = train_candidates(t, fla, backends, with_fa4=True, gen=torch.Generator().manual_seed(1))
    except Exception:
        return
    for cand in cands.values():
        try:
            cand.fn()
        except Exception:  # the real run records the failure
            pass
    torch.cuda.synchronize()


def run(out: str | None, budget_s: float, quick: bool, lengths: list[int], decode_batch: int) -> Path:
    from torch.nn.attention import SDPBackend

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    fla = load_fla()
    report = Report(
        package="nsa",
        title="NSA forward, backward and decode (64 query heads, 4 KV heads, D = 128, bf16)",
        columns=COLUMNS,
        peer="flash-linear-attention (fla-core) 0.6.0, parallel_nsa",
        packages=["fla-core", "flash-linear-attention"],
    )
    notes = []
    if fla[0] is None:
        notes.append(fla[1])
    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    skipped, last_cost = [], 0.0
    for t in lengths:
        if time.perf_counter() - start > budget_s / 4:  # decode first, a quarter of the budget
            skipped.append(f"decode T={t}")
            continue
        try:
            cands, counted = decode_candidates(t, decode_batch, gen)
            res = measure(cands, rounds=3, warmup=5, rep=20)
        except Exception as exc:
            report.add(
                section="decode",
                impl="all",
                B=decode_batch,
                T=t,
                check=f"failed: {type(exc).__name__}: {exc}"[:300],
            )
            torch.cuda.empty_cache()
            continue
        full = res["sdpa-decode"].median_ms
        for impl, m in res.items():
            sp = full / m.median_ms if full and m.median_ms else None
            tokens = counted.get("tokens") if impl == "nsa-decode" else t
            report.add(section="decode", impl=impl, B=decode_batch, T=t, speedup_vs_full=sp, tokens=tokens,
                       paper_tokens=TABLE4.get(t) if impl == "nsa-decode" else t, **{"pass": "decode"}, **m.row())  # fmt: skip
        del cands, res
        torch.cuda.empty_cache()
    warm_up(fla, backends)  # compile every kernel once, so that a length's cost predicts the next one's
    for i, t in enumerate(lengths):
        elapsed = time.perf_counter() - start
        # a length costs about 4x the previous one (full attention is quadratic)
        if i > 0 and elapsed + 4 * last_cost > budget_s:
            skipped += [f"train T={x}" for x in lengths[i:]]
            break
        t0 = time.perf_counter()
        rounds = 3 if t <= 16384 else 2
        try:
            cands = train_candidates(t, fla, backends, with_fa4=t <= 16384, gen=gen)
            res = measure(cands, rounds=rounds, warmup=5, rep=20)
        except Exception as exc:  # e.g. out of memory while building the inputs: record it, go on
            report.add(
                section="train", impl="all", B=1, T=t, check=f"failed: {type(exc).__name__}: {exc}"[:300]
            )
            last_cost = time.perf_counter() - t0
            torch.cuda.empty_cache()
            continue
        full_ms = {}
        for (impl, p), m in res.items():
            if impl.startswith("sdpa") and m.median_ms is not None:
                full_ms[p] = min(full_ms.get(p, math.inf), m.median_ms)
        for (impl, p), m in res.items():
            sp = full_ms.get(p) / m.median_ms if m.median_ms and p in full_ms else None
            report.add(section="train", impl=impl, B=1, T=t, speedup_vs_full=sp, **{"pass": p}, **m.row())
        if i == 0:  # keep SDPA's faster backend for the longer lengths
            fwd = {n: res[(n, "fwd+bwd")].median_ms for n in backends if res[(n, "fwd+bwd")].median_ms}
            if fwd:
                best = min(fwd, key=fwd.get)
                backends = {best: backends[best]}
                notes.append(f"SDPA backend kept after T={t}: {best} (fastest forward + backward there)")
        last_cost = time.perf_counter() - t0
        del cands, res  # free this length's tensors before the next length builds its own
        torch.cuda.empty_cache()
    if skipped:
        notes.append("Not measured (time budget of the run): " + ", ".join(skipped))
    notes.append(
        "nsa: paper configuration l=32, d=16, l'=64, n=16 (1 initial + 2 local), w=512, compressed keys "
        "given (mean-pooled here; the compression MLP is outside the timing). cmp+slc rows: fla's setting "
        "(mean pooling, l=d=l'=64, n=16, no window). slc rows: the selected branch alone on one set of "
        "indices. speedup_vs_full: the fastest full-attention (SDPA) time over this row's, same pass."
    )
    report.notes = " ".join(notes)
    report.measure_ceilings = not quick and time.perf_counter() - start < budget_s
    for p in ("fwd", "fwd+bwd"):
        report.plot(title=f"{p} time", x="T", y="ms", series="impl", where={"section": "train", "pass": p},
                    logx=True, logy=True)  # fmt: skip
    report.plot(
        title="decode step time", x="T", y="ms", series="impl", where={"section": "decode"}, logx=True
    )
    return report.write(out_dir=Path(out) if out else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for the result JSON (default repro/nsa/results)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new lengths after this")
    ap.add_argument("--quick", action="store_true", help="T = 8k only")
    ap.add_argument("--lengths", default="", help="comma-separated T values (default 8k,16k,32k,64k)")
    ap.add_argument("--decode-batch", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("repro.nsa.bench needs a CUDA GPU")
    lengths = [int(x) for x in args.lengths.split(",") if x] or ([8192] if args.quick else sorted(TABLE4))
    run(args.out, args.budget_s, args.quick, lengths, args.decode_batch)


if __name__ == "__main__":
    main()
