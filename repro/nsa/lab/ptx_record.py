"""``python -m repro.nsa.lab.ptx_record OUT.json [--compare BEFORE.json]``: the PTX of every kernel launch
the fast path makes, compiled offline for sm_90a (no GPU), to show that a change of files left the
kernels as they were.

How: the public entry points run on CPU tensors at representative shapes and switch settings (the
forward, and the backward where there is one) while every Triton kernel is replaced by a recorder, and
the launchers are made to take their GPU launch shapes (``interpreting()`` answers False to them, True
to the input checks that refuse CPU tensors otherwise). Each recorded launch is then compiled by
Triton's own launch path (``JITFunction.warmup``: the same argument specialisation, constexprs and
options as a launch on an H100) under a stand-in driver that names an sm_90 target; an autotuned
launch is compiled once per config. Recorded per distinct launch: the kernel's name, its constexprs,
warps, stages, the specialised signature, and two hashes of the PTX: ``ptx_sha`` of the text as it is
and ``code_sha`` with the source-location lines (``.loc``, ``.file``, the debug sections: they name
the file and line of each instruction's source, which moving a kernel changes) removed and the
kernel's name replaced, so a kernel moved or renamed keeps its ``code_sha``.

``--compare`` matches the launches of two records by scenario and launch number and prints every
difference. The record of the code before the stage split (main at ef90b20) was made with the
launchers of that layout (``ops``/``kernels``, settings as module globals); :class:`LegacyApi`
drives it, :class:`Api` the current one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _Sm90Driver:
    """What ``JITFunction.run(warmup=True)`` asks of a driver, answered for one sm_90 device."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@dataclass
class Launch:
    scenario: str
    kernel: object  # JITFunction or Autotuner
    args: tuple
    kwargs: dict


@dataclass
class Recorder:
    launches: list[Launch] = field(default_factory=list)
    scenario: str = ""

    def stub(self, kernel):
        rec = self

        class Stub:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    rec.launches.append(Launch(rec.scenario, kernel, args, kwargs))

                return launch

        return Stub()


class _Toggle:
    """``interpreting()`` for the launchers: False (GPU shapes), True inside the input checks."""

    def __init__(self):
        self.value = False

    def __call__(self) -> bool:
        return self.value


@contextlib.contextmanager
def gpu_launchers(modules: list, checks: list[tuple[object, str]], recorder: Recorder):
    """Within the block: every kernel of ``modules`` replaced by a recorder, each module's
    ``interpreting``/``_interp`` by :class:`_Toggle` (False), and each ``(module, name)`` of ``checks``
    wrapped so that the toggle reads True while it runs."""
    toggle = _Toggle()
    saved = []

    def patch(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    for mod in modules:
        for name, value in list(vars(mod).items()):
            if isinstance(value, (JITFunction, Autotuner)) and name.endswith(("_kernel", "_tuned")):
                patch(mod, name, recorder.stub(value))
            elif name in ("interpreting", "_interp") and callable(value):
                patch(mod, name, toggle)
    for mod, name in checks:
        original = getattr(mod, name)

        def checked(*a, _original=original, **k):
            toggle.value = True
            try:
                return _original(*a, **k)
            finally:
                toggle.value = False

        patch(mod, name, checked)
    try:
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


# ----------------------------------------------------------------------------------------------
# The two layouts' entry points


class Api:
    """The stage modules, settings as ``repro.nsa.config.Switches``."""

    def __init__(self):
        from repro.nsa import (
            common,
            compression,
            config,
            decode,
            gate,
            layer,
            reference,
            selected,
            selection,
            window,
        )

        self.ref = reference
        self.Switches = config.Switches
        self.modules = [common, compression, selection, selected, window, gate, decode, layer]
        self.checks = [(m, n) for m in self.modules for n in ("check_qkv", "check_scores") if hasattr(m, n)]
        self.m = dict(compression=compression, selection=selection, selected=selected, window=window,
                      gate=gate, decode=decode, layer=layer)  # fmt: skip

    def sw(self, **kw):
        return self.Switches(**kw)

    def nsa_attention(self, args, cfg, **kw):
        return self.m["layer"].nsa_attention(*args, cfg, switches=self.sw(**kw))

    def selected(self, q, k, v, bi, block, **kw):
        return self.m["selected"].selected_attention(
            q, k, v, bi, block, check_indices=False, switches=self.sw(**kw)
        )

    def compressed(self, q, kc, vc, l, d, **kw):
        return self.m["compression"].compressed_attention(q, kc, vc, l, d, switches=self.sw(**kw))

    def window(self, q, k, v, w, **kw):
        return self.m["window"].sliding_window_attention(q, k, v, w, switches=self.sw(**kw))

    def strided_fwd(self, q, k, v, stride, offset, window, split):
        d, size = q.shape[-1], q.element_size()
        tile = (
            self.m["window"].window_tile(d, size) if window else self.m["compression"].forward_tile(d, size)
        )
        return self.m["compression"].strided_forward(q, k, v, d**-0.5, stride, offset, window, tile, self.sw(),
                                                     split=split)  # fmt: skip

    def masked_scores(self, q, kc, lse, cfg):
        return self.m["selection"].masked_selection_scores(q, kc, lse, cfg)

    def scores(self, q, kc, lse, ns, l, d, lp):
        return self.m["selection"].selection_scores(q, kc, lse, ns, l, d, lp)

    def topk(self, masked, n, **kw):
        return self.m["selection"].topk_blocks(masked, n, switches=self.sw(**kw))

    def gated_sum_fused(self, g, a, b, c):
        return self.m["gate"].gated_sum_fused(g, a, b, c)

    def decode(self, args, cfg):
        return self.m["decode"].nsa_decode(*args, cfg)


class LegacyApi:
    """main before the stage split: ``repro.nsa.ops`` launching ``repro.nsa.kernels``, kernel choices as
    ops' module globals (set here for one call, then restored)."""

    NAMES = dict(strided_split="STRIDED_SPLIT", fused_topk="FUSED_TOPK", fused_gate="FUSED_GATE",
                 slc_bwd_rows="SLC_TILED_ROWS", slc_bwd_stages="SLC_TILED_STAGES")  # fmt: skip

    def __init__(self):
        ops = importlib.import_module("repro.nsa.ops")
        kn = importlib.import_module("repro.nsa.kernels")
        from repro.nsa import reference

        self.ops, self.ref = ops, reference
        self.modules = [ops, kn]
        self.checks = [(ops, "check_qkv"), (ops, "_check_topk")]

    @contextlib.contextmanager
    def settings(self, **kw):
        values = {}
        for key, value in kw.items():
            if key == "slc_backward":
                values["TILED_SLC_BWD"] = value == "block-major"
            elif key == "strided_fwd_tile":
                bm, bn, w, s = value
                values["STRIDED_FWD_TILE"] = {"BM": bm, "BN": bn, "num_warps": w, "num_stages": s}
            else:
                values[self.NAMES[key]] = value
        saved = {name: getattr(self.ops, name) for name in values}
        for name, value in values.items():
            setattr(self.ops, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self.ops, name, value)

    def nsa_attention(self, args, cfg, **kw):
        with self.settings(**kw):
            return self.ops.nsa_attention(*args, cfg)

    def selected(self, q, k, v, bi, block, **kw):
        with self.settings(**kw):
            return self.ops.selected_attention(q, k, v, bi, block, check_indices=False)

    def compressed(self, q, kc, vc, l, d, **kw):
        with self.settings(**kw):
            return self.ops.compressed_attention(q, kc, vc, l, d)

    def window(self, q, k, v, w, **kw):
        with self.settings(**kw):
            return self.ops.sliding_window_attention(q, k, v, w)

    def strided_fwd(self, q, k, v, stride, offset, window, split):
        return self.ops._strided_fwd(q, k, v, q.shape[-1] ** -0.5, stride, offset, window, split=split)

    def masked_scores(self, q, kc, lse, cfg):
        return self.ops.masked_selection_scores(q, kc, lse, cfg)

    def scores(self, q, kc, lse, ns, l, d, lp):
        return self.ops.selection_scores(q, kc, lse, ns, l, d, lp)

    def topk(self, masked, n, **kw):
        with self.settings(**kw):
            return self.ops.topk_blocks(masked, n)

    def gated_sum_fused(self, g, a, b, c):
        return self.ops.gated_sum_fused(g, a, b, c)

    def decode(self, args, cfg):
        return self.ops.nsa_decode(*args, cfg)


# ----------------------------------------------------------------------------------------------
# Scenarios: representative shapes (the bench's and the GPU tests') and the switch settings the
# tests, the bench and the lab sweeps use


@dataclass(frozen=True)
class Shape:
    b: int
    t: int
    hq: int
    h: int
    d: int
    dtype: torch.dtype

    def name(self) -> str:
        return f"B{self.b}-T{self.t}-HQ{self.hq}-H{self.h}-D{self.d}-{str(self.dtype).removeprefix('torch.')}"


PAPER = Shape(1, 4096, 64, 4, 128, torch.bfloat16)  # the bench's head shape, T a multiple of 16
SHAPES = [
    PAPER,
    Shape(1, 1000, 64, 4, 128, torch.float16),  # GPU tests: T off the tiles, fp16
    Shape(1, 1500, 16, 1, 64, torch.float32),  # test_gpu_nsa_layer_fp32
    Shape(2, 333, 16, 1, 64, torch.bfloat16),  # B = 2, D = 64, G = 16
    Shape(1, 200, 3, 1, 128, torch.bfloat16),  # G = 3
]


def _zeros(*shape, dtype):
    return torch.zeros(*shape, dtype=dtype)


def _grad(out, leaves):
    torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)


def scenarios(api) -> list[tuple[str, Callable[[], None]]]:
    ref = api.ref
    cfg = ref.NSAConfig()
    out = []
    for s in SHAPES:
        dt = s.dtype

        def layer(s=s, dt=dt, **kw):
            q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
            kv = [_zeros(s.b, s.t, s.h, s.d, dtype=dt) for _ in range(6)]
            kc = ref.compress(kv[0], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
            vc = ref.compress(kv[1], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
            gates = _zeros(s.b, s.t, s.hq, 3, dtype=dt)
            leaves = [x.requires_grad_() for x in (q, kc, vc, *kv[2:], gates)]
            o, _ = api.nsa_attention(leaves, cfg, **kw)
            if isinstance(api, LegacyApi):
                with api.settings(**kw):
                    _grad(o, leaves)
            else:
                _grad(o, leaves)

        out.append((f"layer[{s.name()}]", layer))
        if s == PAPER:
            for kw in (dict(strided_split=False), dict(fused_topk=False), dict(slc_backward="query-major"),
                       dict(slc_bwd_rows=64, slc_bwd_stages=1), dict(slc_bwd_rows=32, slc_bwd_stages=1),
                       dict(fused_gate=False)):  # fmt: skip
                label = ",".join(f"{k}={v}" for k, v in kw.items())
                out.append((f"layer[{s.name()},{label}]", lambda kw=kw: layer(**kw)))
            fla = ref.NSAConfig(block_len=64, stride=64, select_len=64, n_select=16, n_initial=1, n_local=2)

            def fla_setting(s=s, dt=dt, fla=fla):  # the bench's cmp+slc rows: l = d = l' = 64, no window
                q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt).requires_grad_()
                k = _zeros(s.b, s.t, s.h, s.d, dtype=dt).requires_grad_()
                kc = ref.compress(k, ref.mean_pool, 64, 64)
                o_c, lse = api.compressed(q, kc, kc, 64, 64)
                bi = api.topk(api.masked_scores(q.detach(), kc.detach(), lse, fla), 16)
                o_s = api.selected(q, k, k, bi, 64)
                _grad(o_c + o_s, [q, k])

            out.append((f"cmp+slc_fla_setting[{s.name()}]", fla_setting))
            for tile in ((128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3)):  # the strided sweep's tiles

                def cmp_tile(s=s, dt=dt, tile=tile):
                    q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
                    k = _zeros(s.b, s.t // 16 - 1, s.h, s.d, dtype=dt)
                    api.compressed(q, k, k.clone(), 32, 16, strided_fwd_tile=tile)
                    api.window(q, _zeros(s.b, s.t, s.h, s.d, dtype=dt), _zeros(s.b, s.t, s.h, s.d, dtype=dt), 512,
                               strided_fwd_tile=tile)  # fmt: skip

                out.append((f"strided_tile[{s.name()},{tile}]", cmp_tile))
        if s.t == 1000:  # the GPU tests' strided forward with the split forced either way, both branches

            def split(s=s, dt=dt):
                q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
                k = _zeros(s.b, s.t, s.h, s.d, dtype=dt)
                for sp in (False, True):
                    api.strided_fwd(q, k, k.clone(), 16, 31, 0, sp)
                    api.strided_fwd(q, k, k.clone(), 1, 0, 512, sp)

            out.append((f"strided_split[{s.name()}]", split))

            def unmasked_scores(s=s, dt=dt):
                q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
                kc = _zeros(s.b, s.t // 16, s.h, s.d, dtype=dt)
                lse = torch.zeros(s.b, s.t, s.hq)
                api.scores(q, kc, lse, -(-s.t // 64), 32, 16, 64)
                masked = torch.zeros(s.b, s.t, s.h, 5000)  # Ns above the one-pass top-n's limit
                api.topk(masked, 16)

            out.append((f"scores_unmasked_topk_fallback[{s.name()}]", unmasked_scores))

    def gate():
        xs = [_zeros(1, 1000, 64, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        g = _zeros(1, 1000, 64, 3, dtype=torch.bfloat16).requires_grad_()
        _grad(api.gated_sum_fused(g, *xs), [g, *xs])

    out.append(("gated_sum_fused[T1000]", gate))
    for b, t, dt in ((4, 8192, torch.bfloat16), (16, 8192, torch.bfloat16), (1, 65536, torch.bfloat16),
                     (2, 300, torch.float32)):  # fmt: skip
        hq, h, d = (64, 4, 128) if dt != torch.float32 else (4, 2, 16)

        def dec(b=b, t=t, dt=dt, hq=hq, h=h, d=d):
            q = _zeros(b, 1, hq, d, dtype=dt)
            caches = [_zeros(b, t, h, d, dtype=dt) for _ in range(4)]
            nc = ref.num_compressed(t, cfg.block_len, cfg.stride)
            kc = _zeros(b, max(nc, 1), h, d, dtype=dt)
            gates = _zeros(b, 1, hq, 3, dtype=dt)
            api.decode((q, kc, kc.clone(), *caches, gates), cfg)

        out.append((f"decode[B{b}-T{t}-{str(dt).removeprefix('torch.')}]", dec))
    return out


# ----------------------------------------------------------------------------------------------
# Compiling the recorded launches


_LOC = re.compile(r"^\s*\.(loc|file)\b.*$", re.M)
_DEBUG = re.compile(r"^\s*\.section\s+\.debug_\w+.*?^\s*\}", re.M | re.S)
_COMMENT = re.compile(r"\s*//.*$", re.M)


def code_of(ptx: str, name: str) -> str:
    """The PTX with its source locations removed and the kernel's name replaced by ``KERNEL``."""
    text = _DEBUG.sub("", ptx)
    text = _LOC.sub("", text)
    text = _COMMENT.sub("", text)
    text = text.replace(name, "KERNEL")
    return "\n".join(line for line in text.splitlines() if line.strip())


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _options(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}


def _variants(launch: Launch):
    """(JITFunction, kwargs) to compile for one launch: itself, or an autotuner's every config."""
    k = launch.kernel
    if isinstance(k, Autotuner):
        for c in k.configs:
            yield k.fn, {**launch.kwargs, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
    else:
        yield k, dict(launch.kwargs)


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"*{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return "1" if value == 1 else ("i%16" if value % 16 == 0 else "i")
    if isinstance(value, float):
        return "f32"
    return repr(value)


def compile_all(launches: list[Launch], verbose: bool = True) -> list[dict]:
    driver.set_active(_Sm90Driver())
    rows, cache = [], {}
    counter: dict[str, int] = {}
    for launch in launches:
        for fn, kwargs in _variants(launch):
            name = fn.fn.__name__
            constexprs = {p.name: kwargs[p.name] for p in fn.params if p.is_constexpr and p.name in kwargs}
            sig = [_describe(a) for a in launch.args]
            key = (
                name,
                json.dumps(sig),
                json.dumps(constexprs, sort_keys=True),
                json.dumps(_options(kwargs)),
            )
            n = counter.get(launch.scenario, 0)
            counter[launch.scenario] = n + 1
            if key not in cache:
                compiled = fn.warmup(*launch.args, grid=(1,), **kwargs)
                ptx = compiled.asm["ptx"]
                cache[key] = {"ptx_sha": _sha(ptx), "code_sha": _sha(code_of(ptx, compiled.metadata.name)),
                              "shared": compiled.metadata.shared}  # fmt: skip
                if verbose:
                    print(
                        f"compiled {name} {constexprs} {_options(kwargs)}: {cache[key]['code_sha']}",
                        flush=True,
                    )
            rows.append({"scenario": launch.scenario, "launch": n, "kernel": name, "constexprs": constexprs,
                         "options": _options(kwargs), "signature": sig, **cache[key]})  # fmt: skip
    return rows


def record(api) -> list[dict]:
    rec = Recorder()
    with gpu_launchers(api.modules, api.checks, rec):
        for name, run in scenarios(api):
            rec.scenario = name
            run()
            print(f"ran {name}: {sum(1 for x in rec.launches if x.scenario == name)} launches", flush=True)
    return compile_all(rec.launches)


def compare(before: list[dict], after: list[dict]) -> int:
    """Print each launch whose kernel, constexprs, options, signature or code differ; return their count."""
    key = lambda r: (r["scenario"], r["launch"])  # noqa: E731
    a, b = {key(r): r for r in before}, {key(r): r for r in after}
    diffs = 0
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            diffs += 1
            print(f"{k}: only {'after' if k in b else 'before'}")
            continue
        fields = [
            f for f in ("kernel", "constexprs", "options", "signature", "code_sha") if a[k][f] != b[k][f]
        ]
        if fields:
            diffs += 1
            print(f"{k}: {', '.join(f'{f} {a[k][f]} -> {b[k][f]}' for f in fields)}")
    same_text = sum(1 for k in set(a) & set(b) if a[k]["ptx_sha"] == b[k]["ptx_sha"])
    print(f"{len(set(a) & set(b))} launches in both, {diffs} differ; PTX text identical (source lines "
          f"included) for {same_text}; distinct kernels compiled: {len({r['code_sha'] for r in after})}")  # fmt: skip
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the record to write (JSON)")
    ap.add_argument("--compare", help="a record to compare the new one with")
    ap.add_argument("--legacy", action="store_true", help="drive the layout before the stage split")
    args = ap.parse_args()
    api = LegacyApi() if args.legacy else Api()
    rows = record(api)
    with open(args.out, "w") as f:
        json.dump({"triton": triton.__version__, "torch": torch.__version__, "launches": rows}, f, indent=1)
    print(f"wrote {args.out}: {len(rows)} launches")
    if args.compare:
        with open(args.compare) as f:
            return 1 if compare(json.load(f)["launches"], rows) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
