"""Shared test helpers: random inputs and random valid block indices."""

from __future__ import annotations

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
