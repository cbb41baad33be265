"""Shared test helpers: random inputs and random valid block indices."""

from __future__ import annotations

import contextlib

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp32 kernels against the fp64 reference: a few ulp per accumulation over at most a few hundred
# keys, so about 1e-6 relative; 2e-5 leaves room for the softmax's exp and the backward's two matmuls.
FP32_TOL = 2e-5


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def random_block_indices(gen: torch.Generator, b: int, t: int, h: int, s: int, block: int) -> torch.Tensor:
    """[B, T, H, S] int32: for each query a random set of distinct blocks that start at or before it
    (its own block always among them, in random order), padded with -1 at random places."""
    out = torch.full((b, t, h, s), -1, dtype=torch.int32)
    for bi in range(b):
        for ti in range(t):
            own = ti // block
            for hi in range(h):
                others = torch.randperm(own, generator=gen)[: max(0, s - 1)]
                keep = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
                row = torch.cat([torch.tensor([own]), others[:keep]])
                slots = torch.randperm(s, generator=gen)[: len(row)]
                out[bi, ti, hi, slots] = row.to(torch.int32)
    return out


def grads(out: torch.Tensor, do: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, xs, do))


def leaf(x: torch.Tensor, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    return x.to(device, dtype).requires_grad_()


#: aten ops that only allocate or view: what a step may dispatch besides its kernels and topk
FREE_OPS = {
    "empty.memory_format", "empty_like.default", "empty_strided.default", "view.default",
    "unsqueeze.default", "alias.default", "slice.Tensor", "select.int", "detach.default",
}  # fmt: skip


@contextlib.contextmanager
def dispatched(kernel_module, kernel_names):
    """Within the block: the aten ops dispatched outside Triton launches (``ops``, names without
    ``aten.``) and the launches of ``kernel_names`` of ``kernel_module`` in order (``launches``).
    Yields ``(ops, launches)``; the kernels are restored afterwards. (The CPU interpreter runs a
    kernel with torch ops of its own: those are not recorded.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.in_kernel = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.in_kernel:
                self.ops.append(str(func).removeprefix("aten."))
            return func(*args, **(kwargs or {}))

    record, launches = Record(), []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*a, **kw):
                launches.append(self.name)
                record.in_kernel = True
                try:
                    return self.kernel[grid](*a, **kw)
                finally:
                    record.in_kernel = False

            return launch

    originals = {name: getattr(kernel_module, name) for name in kernel_names}
    for name, kernel in originals.items():
        setattr(kernel_module, name, Counted(name, kernel))
    try:
        with record:
            yield record.ops, launches
    finally:
        for name, kernel in originals.items():
            setattr(kernel_module, name, kernel)
