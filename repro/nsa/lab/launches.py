"""The kernel launches of the NSA fast path, recorded without a GPU and compiled offline for sm_90a.

:func:`record` runs the public entry points (:func:`scenarios`: representative shapes and switch
settings; the forward, and the backward where there is one) on CPU tensors while every Triton kernel
is replaced by a recorder and the launchers take their GPU launch shapes (``interpreting()`` answers
False to them, True to the input checks, which refuse CPU tensors otherwise). The kernels do not run;
each recorded :class:`Launch` holds the kernel and the arguments it was given. :func:`compile_launch`
then compiles one through Triton's own launch path (``JITFunction.warmup``: the argument
specialisation, constexprs and options of a launch on an H100) under a stand-in driver that names an
sm_90 target; an autotuned launch gives one kernel per config.

What this is for: ``fingerprints.py`` (do the kernels compile to the same code after a change of
files?) and ``sm90_check.py`` (registers, spills and shared memory of what the GPU would run). It must
run in a process without ``TRITON_INTERPRET`` (importing this module removes it, before Triton is
imported, so run it as ``python -m``). :class:`Api` drives the current layout; :class:`LegacyApi`
the one before the stage split (``ops``/``kernels``, switches as module globals), for the record
of main's code.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted ones

import torch  # noqa: E402
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

    @contextlib.contextmanager
    def backward(self, **kw):
        """The switches reach the backward through the autograd context: nothing to set."""
        yield

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

    def backward(self, **kw):
        """The backward reads ops' globals when it runs: the same settings around it."""
        return self.settings(**kw)

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
# tests, the bench and the lab's sweeps use


@dataclass(frozen=True)
class Shape:
    b: int
    t: int
    hq: int
    h: int
    d: int  # queries' and keys' head size
    dtype: torch.dtype
    dv: int | None = None  # values' head size (None: d)

    @property
    def d_v(self) -> int:
        return self.d if self.dv is None else self.dv

    def name(self) -> str:
        heads = f"D{self.d}" if self.dv is None else f"Dk{self.d}-Dv{self.dv}"
        return f"B{self.b}-T{self.t}-HQ{self.hq}-H{self.h}-{heads}-{str(self.dtype).removeprefix('torch.')}"


#: the bench's head shape (T a multiple of 16), then the GPU tests' shapes: T off the tiles in fp16, the
#: fp32 layer test, B = 2 with D = 64 and G = 16, and G = 3
SHAPES = [
    Shape(1, 4096, 64, 4, 128, torch.bfloat16),
    Shape(1, 1000, 64, 4, 128, torch.float16),
    Shape(1, 1500, 16, 1, 64, torch.float32),
    Shape(2, 333, 16, 1, 64, torch.bfloat16),
    Shape(1, 200, 3, 1, 128, torch.bfloat16),
]
#: decode caches (B, T, dtype, HQ, H, D): the GPU tests' and the bench's, and a tiny fp32 one
DECODES = [
    (4, 8192, torch.bfloat16, 64, 4, 128),
    (16, 8192, torch.bfloat16, 64, 4, 128),
    (1, 65536, torch.bfloat16, 64, 4, 128),
    (2, 300, torch.float32, 4, 2, 16),
]
#: the head sizes of issue #39 (no launch of these existed before it): the paper's Dk = 192, Dv = 128
#: (§4.1) at the bench's shape, off the tiles in fp16, in fp32; Dk != Dv without the key split; sizes
#: that are not tile sizes (60, 100: padded on the host to 64 and 128, the verified kernels)
HEAD_SIZE_SHAPES = [
    Shape(1, 4096, 64, 4, 192, torch.bfloat16, dv=128),
    Shape(1, 1000, 64, 4, 192, torch.float16, dv=128),
    Shape(1, 300, 16, 1, 192, torch.float32, dv=128),
    Shape(1, 1000, 64, 4, 128, torch.bfloat16, dv=64),
    Shape(1, 333, 16, 1, 60, torch.bfloat16, dv=100),
]
#: decode caches at those head sizes (B, T, dtype, HQ, H, Dk, Dv)
HEAD_SIZE_DECODES = [(4, 8192, torch.bfloat16, 64, 4, 192, 128), (2, 300, torch.float32, 4, 2, 60, 100)]
#: the non-default switch settings timed by the bench or the lab, each run at the first shape
VARIANTS = [
    dict(strided_split=False),
    dict(strided_bwd_split=False),
    dict(fused_topk=False),
    dict(slc_backward="query-major"),
    dict(slc_bwd_rows=64, slc_bwd_stages=1),
    dict(slc_bwd_rows=32, slc_bwd_stages=1),
    dict(fused_gate=False),
]
#: the strided sweep's other forward tiles (BM, BN, warps, stages; results/*-strided-sweep.json), at the
#: first shape
TILES = [(128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)]


def _zeros(*shape, dtype):
    return torch.zeros(*shape, dtype=dtype)


def _grad(out, leaves):
    torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)


def scenarios(api, shapes: list[Shape] = SHAPES, decodes=DECODES) -> list[tuple[str, Callable[[], None]]]:
    """(name, run) of every scenario: the layer forward + backward at each shape; at the first, each
    of :data:`VARIANTS`, the bench's cmp+slc setting (l = d = l' = 64) and :data:`TILES`; at the first
    two, the strided forward with the split forced either way on both branches, the unmasked scores
    and the top-n fallback (Ns above the one-pass kernel's limit); the fused gate; decode at each of
    ``decodes``."""
    ref = api.ref
    cfg = ref.NSAConfig()
    fla = ref.NSAConfig(block_len=64, stride=64, select_len=64, n_select=16, n_initial=1, n_local=2)
    out = []
    for i, s in enumerate(shapes):
        dt = s.dtype

        def layer(s=s, dt=dt, **kw):
            q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
            kv = [_zeros(s.b, s.t, s.h, s.d, dtype=dt) for _ in range(6)]
            kc = ref.compress(kv[0], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
            vc = ref.compress(kv[1], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
            gates = _zeros(s.b, s.t, s.hq, 3, dtype=dt)
            leaves = [x.requires_grad_() for x in (q, kc, vc, *kv[2:], gates)]
            o, _ = api.nsa_attention(leaves, cfg, **kw)
            with api.backward(**kw):
                _grad(o, leaves)

        out.append((f"layer[{s.name()}]", layer))
        if i == 0:
            for kw in VARIANTS:
                label = ",".join(f"{k}={v}" for k, v in kw.items())
                out.append((f"layer[{s.name()},{label}]", lambda kw=kw: layer(**kw)))

            def fla_setting(s=s, dt=dt):  # the bench's cmp+slc rows: l = d = l' = 64, no window
                q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt).requires_grad_()
                k = _zeros(s.b, s.t, s.h, s.d, dtype=dt).requires_grad_()
                kc = ref.compress(k, ref.mean_pool, 64, 64)
                o_c, lse = api.compressed(q, kc, kc, 64, 64)
                bi = api.topk(api.masked_scores(q.detach(), kc.detach(), lse, fla), 16)
                o_s = api.selected(q, k, k, bi, 64)
                _grad(o_c + o_s, [q, k])

            out.append((f"cmp+slc_fla_setting[{s.name()}]", fla_setting))
            for tile in TILES:

                def cmp_tile(s=s, dt=dt, tile=tile):
                    q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
                    k = _zeros(s.b, s.t // 16 - 1, s.h, s.d, dtype=dt)
                    api.compressed(q, k, k.clone(), 32, 16, strided_fwd_tile=tile)
                    kw = _zeros(s.b, s.t, s.h, s.d, dtype=dt)
                    api.window(q, kw, kw.clone(), 512, strided_fwd_tile=tile)

                out.append((f"strided_tile[{s.name()},{tile}]", cmp_tile))
        if i <= 1:

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

    def gate(s=shapes[0]):
        xs = [_zeros(s.b, s.t, s.hq, s.d, dtype=s.dtype).requires_grad_() for _ in range(3)]
        g = _zeros(s.b, s.t, s.hq, 3, dtype=s.dtype).requires_grad_()
        _grad(api.gated_sum_fused(g, *xs), [g, *xs])

    out.append((f"gated_sum_fused[{shapes[0].name()}]", gate))
    for b, t, dt, hq, h, d in decodes:

        def dec(b=b, t=t, dt=dt, hq=hq, h=h, d=d):
            q = _zeros(b, 1, hq, d, dtype=dt)
            caches = [_zeros(b, t, h, d, dtype=dt) for _ in range(4)]
            nc = ref.num_compressed(t, cfg.block_len, cfg.stride)
            kc = _zeros(b, max(nc, 1), h, d, dtype=dt)
            gates = _zeros(b, 1, hq, 3, dtype=dt)
            api.decode((q, kc, kc.clone(), *caches, gates), cfg)

        out.append((f"decode[B{b}-T{t}-HQ{hq}-H{h}-D{d}-{str(dt).removeprefix('torch.')}]", dec))
    return out


def head_size_scenarios(api, shapes: list[Shape] = HEAD_SIZE_SHAPES, decodes=HEAD_SIZE_DECODES):
    """(name, run) of the launches of issue #39's head sizes: the layer forward + backward at each of
    ``shapes`` (Dk = ``d``, Dv = ``dv``), the bench's cmp + slc setting (l = d = l' = 64), the
    block-major backward's other launch shapes and the split strided backward at the first, and decode
    at each of ``decodes``. Kept apart from :func:`scenarios`, whose launches are the record compared
    with main's."""
    ref = api.ref
    cfg = ref.NSAConfig()
    fla = ref.NSAConfig(block_len=64, stride=64, select_len=64, n_select=16, n_initial=1, n_local=2)
    out = []
    for i, s in enumerate(shapes):
        dt = s.dtype

        def layer(s=s, dt=dt, **kw):
            q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt)
            ks = [_zeros(s.b, s.t, s.h, s.d, dtype=dt) for _ in range(3)]
            vs = [_zeros(s.b, s.t, s.h, s.d_v, dtype=dt) for _ in range(3)]
            kc = ref.compress(ks[0], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
            vc = ref.compress(vs[0], ref.mean_pool, cfg.block_len, cfg.stride).contiguous()
            gates = _zeros(s.b, s.t, s.hq, 3, dtype=dt)
            leaves = [x.requires_grad_() for x in (q, kc, vc, ks[1], vs[1], ks[2], vs[2], gates)]
            o, _ = api.nsa_attention(leaves, cfg, **kw)
            with api.backward(**kw):
                _grad(o, leaves)

        out.append((f"layer[{s.name()}]", layer))
        if i == 0:
            for kw in (
                dict(slc_bwd_rows=64, slc_bwd_stages=2),
                dict(slc_bwd_rows=32, slc_bwd_stages=1),
                dict(strided_bwd_split=False),
            ):
                label = ",".join(f"{k}={v}" for k, v in kw.items())
                out.append((f"layer[{s.name()},{label}]", lambda kw=kw: layer(**kw)))

            def fla_setting(s=s, dt=dt):
                q = _zeros(s.b, s.t, s.hq, s.d, dtype=dt).requires_grad_()
                k = _zeros(s.b, s.t, s.h, s.d, dtype=dt).requires_grad_()
                v = _zeros(s.b, s.t, s.h, s.d_v, dtype=dt).requires_grad_()
                kc, vc = ref.compress(k, ref.mean_pool, 64, 64), ref.compress(v, ref.mean_pool, 64, 64)
                o_c, lse = api.compressed(q, kc, vc, 64, 64)
                bi = api.topk(api.masked_scores(q.detach(), kc.detach(), lse, fla), 16)
                o_s = api.selected(q, k, v, bi, 64)
                _grad(o_c + o_s, [q, k, v])

            out.append((f"cmp+slc_fla_setting[{s.name()}]", fla_setting))
    for b, t, dt, hq, h, dk, dv in decodes:

        def dec(b=b, t=t, dt=dt, hq=hq, h=h, dk=dk, dv=dv):
            q = _zeros(b, 1, hq, dk, dtype=dt)
            ks = [_zeros(b, t, h, dk, dtype=dt) for _ in range(2)]
            vs = [_zeros(b, t, h, dv, dtype=dt) for _ in range(2)]
            nc = max(ref.num_compressed(t, cfg.block_len, cfg.stride), 1)
            kc, vc = _zeros(b, nc, h, dk, dtype=dt), _zeros(b, nc, h, dv, dtype=dt)
            gates = _zeros(b, 1, hq, 3, dtype=dt)
            api.decode((q, kc, vc, ks[0], vs[0], ks[1], vs[1], gates), cfg)

        out.append((f"decode[B{b}-T{t}-HQ{hq}-H{h}-Dk{dk}-Dv{dv}-{str(dt).removeprefix('torch.')}]", dec))
    return out


# ----------------------------------------------------------------------------------------------
# Recording and compiling


def record(api, scenarios_: list[tuple[str, Callable[[], None]]]) -> list[Launch]:
    """Every kernel launch the scenarios make, in order, with the GPU launch shapes."""
    rec = Recorder()
    with gpu_launchers(api.modules, api.checks, rec):
        for name, run in scenarios_:
            rec.scenario = name
            run()
    return rec.launches


def describe(value):
    """How an argument specialises a launch: a pointer's dtype, an int's 1 / multiple of 16 / other."""
    if isinstance(value, torch.Tensor):
        return f"*{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return "1" if value == 1 else ("i%16" if value % 16 == 0 else "i")
    if isinstance(value, float):
        return "f32"
    return repr(value)


def compile_launch(launch: Launch) -> Iterator[dict]:
    """The kernels one launch compiles to (one per config of an autotuned launch), each as
    ``{"kernel", "constexprs", "options", "signature", "compiled"}``: compiled for sm_90a by
    ``JITFunction.warmup`` with the launch's own arguments."""
    driver.set_active(_Sm90Driver())
    variants = (
        [(launch.kernel.fn, {**launch.kwargs, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages})
         for c in launch.kernel.configs]
        if isinstance(launch.kernel, Autotuner)
        else [(launch.kernel, dict(launch.kwargs))]
    )  # fmt: skip
    for fn, kwargs in variants:
        yield {
            "kernel": fn.fn.__name__,
            "constexprs": {p.name: kwargs[p.name] for p in fn.params if p.is_constexpr and p.name in kwargs},
            "options": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs},
            "signature": [describe(a) for a in launch.args],
            "compiled": fn.warmup(*launch.args, grid=(1,), **kwargs),
        }
