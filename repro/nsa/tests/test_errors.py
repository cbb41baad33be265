"""Bad input raises an error naming the argument, what was given and what was expected."""

from __future__ import annotations

import pytest
import torch

from repro.nsa import (
    NSA,
    NSAConfig,
    Switches,
    compressed_attention,
    nsa_attention,
    nsa_decode,
    selected_attention,
    sliding_window_attention,
)
from repro.nsa.tests.helpers import DEVICE


def _qkv(t=32, hq=4, h=2, d=16, dtype=torch.float32):
    return (
        torch.randn(1, t, hq, d, dtype=dtype, device=DEVICE),
        torch.randn(1, t, h, d, dtype=dtype, device=DEVICE),
        torch.randn(1, t, h, d, dtype=dtype, device=DEVICE),
    )


def _idx(t=32, h=2, s=2):
    return torch.zeros(1, t, h, s, dtype=torch.int32, device=DEVICE) - 1


@pytest.mark.parametrize(
    "change, err, match",
    [
        (lambda a: a.update(q=a["q"][0]), ValueError, r"q must be \[B, T, HQ, Dk\] \(4 dims\)"),
        (
            lambda a: a.update(k=a["k"][:, :, :1].expand(1, 32, 3, 16)),
            ValueError,
            r"k and v must have one \[B, T, H\]",
        ),
        (
            lambda a: a.update(k=torch.randn(1, 32, 3, 16), v=torch.randn(1, 32, 3, 16)),
            ValueError,
            r"KV heads H = 3 must divide query heads HQ = 4",
        ),
        (
            lambda a: a.update(
                q=torch.randn(1, 32, 4, 200), k=torch.randn(1, 32, 2, 200), v=torch.randn(1, 32, 2, 16)
            ),
            ValueError,
            r"head dim Dk = 200 of q and k is not supported, expected 1 to 192",
        ),
        (
            lambda a: a.update(v=torch.randn(1, 32, 2, 130)),
            ValueError,
            r"head dim Dv = 130 of v is not supported, expected 1 to 128",
        ),
        (
            lambda a: a.update(k=torch.randn(1, 32, 2, 32)),
            ValueError,
            r"k must be \[B=1, T, H, Dk=16\] to match q",
        ),
        (lambda a: a.update(v=a["v"].double()), TypeError, r"v has dtype torch.float64"),
        (lambda a: a.update(v=a["v"].half()), TypeError, r"q, k, v must share one dtype"),
        (
            lambda a: a.update(k=a["k"][:, :16], v=a["v"][:, :16]),
            ValueError,
            r"k must have T = 32 positions like q, got 16",
        ),
        (lambda a: a.update(block_size=24), ValueError, r"block_size = 24 is not supported"),
        (
            lambda a: a.update(block_indices=_idx(s=2)[..., 0]),
            ValueError,
            r"block_indices must be \[B, T, H, S\] \(4 dims\)",
        ),
        (
            lambda a: a.update(block_indices=_idx(t=16)),
            ValueError,
            r"block_indices must be \[B, T, H, S\] = \[1, 32, 2, S\]",
        ),
        (
            lambda a: a.update(block_indices=_idx().float()),
            TypeError,
            r"block_indices must be int32 or int64",
        ),
    ],
)
def test_selected_attention_bad_input(change, err, match):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, block_indices=_idx(), block_size=16)
    change(args)
    with pytest.raises(err, match=match):
        selected_attention(**args)


def test_selected_attention_rejects_invalid_indices():
    q, k, v = _qkv()
    idx = _idx()
    idx[0, 5, 1, 0] = 2  # only 2 blocks of 16 in 32 tokens: 0 and 1
    with pytest.raises(ValueError, match=r"block_indices out of range: the largest is 2, blocks are 0..1"):
        selected_attention(q, k, v, idx, 16)
    idx = _idx()
    idx[0, 5, 1, 0] = 1  # block 1 starts at 16 > 5: a future block
    with pytest.raises(
        ValueError, match=r"selects a future block: query t = 5 .* picks block 1, which starts at 16 > t"
    ):
        selected_attention(q, k, v, idx, 16)
    idx = _idx()
    idx[0, 20, 0] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match=r"repeats a block"):
        selected_attention(q, k, v, idx, 16)


def test_head_size_errors():
    """Head sizes the kernels do not run are refused by name before any launch: the query-major
    backward with Dk != Dv (it has no split path), branches whose values differ in size (Eq. 5 adds
    them), and the layer's sizes."""
    q, k, v = _qkv(d=32)
    with pytest.raises(
        ValueError, match=r"slc_backward = 'query-major' takes Dk = Dv, got Dk = 32 .* Dv = 16"
    ):
        selected_attention(q, k, v[..., :16], _idx(), 16, switches=Switches(slc_backward="query-major"))
    g = torch.rand(1, 32, 4, 3, device=DEVICE)
    kc = k[:, :3]
    with pytest.raises(
        ValueError, match=r"the branches' values must share one head size Dv, got \[16, 32, 32\]"
    ):
        nsa_attention(q, kc, v[:, :3, :, :16], k, v, k, v, g, NSAConfig(block_len=16, stride=8, select_len=16,
                                                                        n_select=2, n_local=1, window=8))  # fmt: skip
    with pytest.raises(ValueError, match=r"head sizes must be >= 1, got head_dim 16, value_head_dim 0"):
        NSA(dim=8, n_heads=4, n_kv_heads=2, head_dim=16, value_head_dim=0)


def test_branch_argument_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"window must be >= 1, got 0"):
        sliding_window_attention(q, k, v, 0)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number, got -1.0"):
        sliding_window_attention(q, k, v, 4, scale=-1.0)
    with pytest.raises(ValueError, match=r"block_len and stride must be >= 1"):
        compressed_attention(q, k, v, 0, 0)


def test_decode_and_module_errors():
    q, k, v = _qkv()
    g = torch.rand(1, 1, 4, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"q must be one token, \[B, 1, HQ, Dk\], got \(1, 32, 4, 16\)"):
        nsa_decode(q, k, v, k, v, k, v, g)
    cfg = NSAConfig(block_len=16, stride=8, select_len=16, n_select=2, n_local=1, window=8)
    with pytest.raises(ValueError, match=r"compressed cache holds 1 tokens, a cache of 32 needs 3"):
        nsa_decode(q[:, :1], k[:, :1], v[:, :1], k, v, k, v, g, cfg)
    with pytest.raises(ValueError, match=r"gates must be \[B, 1, HQ, 3\]"):
        nsa_decode(q[:, :1], k, v, k, v, k, v, g[..., :2], cfg)
    with pytest.raises(ValueError, match=r"n_kv_heads = 3 must divide n_heads = 4"):
        NSA(dim=8, n_heads=4, n_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=r"x must be \[B, T, dim\]"):
        NSA(dim=8, n_heads=4, n_kv_heads=2, head_dim=16, config=cfg)(torch.randn(4, 8))
