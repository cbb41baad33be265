"""Tree algorithms: NCCL's double binary tree all-reduce, and binomial-tree broadcast and reduce.

Double binary tree (hu2025demystifying, "Tree AllReduce"): a single binary tree wastes half the
links, because leaves only send once. NCCL builds two trees so that (for an even rank count) every
rank is a leaf in one and an interior node in the other, and sends half of the buffer through each.
Each tree first reduces its half upwards (a node waits for chunk k from its children, adds it to
its own and passes the sum to its parent) and then broadcasts the result downwards. Both phases
are pipelined chunk by chunk, so the latency is about 2 * depth hops plus the transfer, and the
depth is logarithmic in the rank count.

Tree shape (our construction, the same property as NCCL's): number ranks 1..n (v = rank + 1) and
take the in-order binary tree in which the node's level is its lowest set bit: odd v are leaves,
the root is the largest power of two <= n. The second tree is the first with every rank shifted
by one, which turns the first tree's leaves (even ranks) into the second's interior nodes.
"""

from __future__ import annotations

import torch

from nanoparallel.algorithms.common import channel_split
from nanoparallel.transport.base import Recv, Reducer, Send, Transport


def binary_tree(n: int) -> tuple[list[int | None], list[list[int]]]:
    """(parent, children) of every rank in the in-order binary tree over ranks 0..n-1."""
    parent: list[int | None] = [None] * n
    children: list[list[int]] = [[] for _ in range(n)]
    if n <= 1:
        return parent, children
    root = 1 << (n.bit_length() - 1)
    for v in range(1, n + 1):
        if v == root:
            continue
        b = v & -v
        p = v
        while True:
            p = p + b if (p & (2 * b)) == 0 else p - b
            b *= 2
            if 1 <= p <= n:
                break
        parent[v - 1] = p - 1
        children[p - 1].append(v - 1)
    for c in children:
        c.sort()
    return parent, children


def double_binary_trees(n: int) -> list[tuple[list[int | None], list[list[int]]]]:
    """The two complementary trees: the in-order tree and the same tree shifted by one rank."""
    p0, c0 = binary_tree(n)
    shift = lambda r: (r + 1) % n
    p1: list[int | None] = [None] * n
    c1: list[list[int]] = [[] for _ in range(n)]
    for r in range(n):
        p1[shift(r)] = None if p0[r] is None else shift(p0[r])
        c1[shift(r)] = sorted(shift(c) for c in c0[r])
    return [(p0, c0), (p1, c1)]


def tree_depth(parent: list[int | None]) -> int:
    """Number of edges on the longest leaf-to-root path."""
    depth = 0
    for r in range(len(parent)):
        d, p = 0, parent[r]
        while p is not None:
            d, p = d + 1, parent[p]
            if d > len(parent):
                raise ValueError("not a tree: cycle")
        depth = max(depth, d)
    return depth


def _tree_all_reduce_ops(tp: Transport, h: torch.Tensor, parent, children, reduce: Reducer, ch, name) -> list:
    r = tp.rank
    ops: list = []
    prev = None
    for c in children[r]:
        # chained so that children are always added in the same order: bitwise deterministic
        prev = Recv(c, h, reduce, ch, after=(prev,) if prev else (), label=f"{name} reduce from child {c}")
        ops.append(prev)
    ready = (prev,) if prev else ()
    if parent[r] is not None:
        up = Send(parent[r], h, ch, after=ready, label=f"{name} reduce to parent")
        down = Recv(parent[r], h, None, ch, after=(up,), label=f"{name} broadcast from parent")
        ops += [up, down]
        ready = (down,)
    for c in children[r]:
        ops.append(Send(c, h, ch, after=ready, label=f"{name} broadcast to child {c}"))
    return ops


def all_reduce_tree(tp: Transport, x: torch.Tensor, reduce: Reducer) -> None:
    """Double binary tree all-reduce, in place on 1-D ``x`` [count]: half the buffer per tree."""
    n = tp.world_size
    m = (x.numel() + 1) // 2
    halves = (x[:m], x[m:])
    chans = channel_split(tuple(range(tp.n_channels)), 2)
    ops: list = []
    for t, (parent, children) in enumerate(double_binary_trees(n)):
        ops += _tree_all_reduce_ops(tp, halves[t], parent, children, reduce, chans[t], f"tree {t}")
    tp.run(ops, "all_reduce(tree)")


def binomial_tree(n: int, root: int) -> tuple[list[int | None], list[list[int]]]:
    """Binomial tree rooted at ``root``: ceil(log2 n) levels, children listed farthest first."""
    parent: list[int | None] = [None] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for v in range(1, n):
        low = v & -v
        p = v - low
        parent[(v + root) % n] = (p + root) % n
    for v in range(n):
        low = (v & -v) if v else 1 << max(n - 1, 1).bit_length()
        k = low >> 1
        while k >= 1:
            if v + k < n:
                children[(v + root) % n].append((v + k + root) % n)
            k >>= 1
    return parent, children


def broadcast_tree(tp: Transport, x: torch.Tensor, root: int) -> None:
    """Binomial-tree broadcast, pipelined: a node forwards chunk k as soon as it has it."""
    parent, children = binomial_tree(tp.world_size, root)
    ch = tuple(range(tp.n_channels))
    ops: list = []
    ready: tuple = ()
    if parent[tp.rank] is not None:
        recv = Recv(parent[tp.rank], x, None, ch, label="tree broadcast from parent")
        ops.append(recv)
        ready = (recv,)
    for c in children[tp.rank]:
        ops.append(Send(c, x, ch, after=ready, label=f"tree broadcast to child {c}"))
    tp.run(ops, "broadcast(tree)")


def reduce_tree(tp: Transport, x: torch.Tensor, root: int, reduce: Reducer) -> None:
    """Binomial-tree reduce into ``x`` on ``root``; ``x`` is used as scratch on the other ranks."""
    parent, children = binomial_tree(tp.world_size, root)
    ch = tuple(range(tp.n_channels))
    ops: list = []
    prev = None
    for c in reversed(children[tp.rank]):  # nearest child first; fixed order keeps it deterministic
        prev = Recv(c, x, reduce, ch, after=(prev,) if prev else (), label=f"tree reduce from child {c}")
        ops.append(prev)
    if parent[tp.rank] is not None:
        ops.append(Send(parent[tp.rank], x, ch, after=(prev,) if prev else (), label="tree reduce to parent"))
    tp.run(ops, "reduce(tree)")
