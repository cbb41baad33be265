"""Bad input raises an error that names the argument and the expected value."""

from __future__ import annotations

import pytest
import torch

from repro.usp import shard, unshard, usp_attention
from repro.usp.tests import worker


def _qkv(s=4, h=2, h_kv=2, d=4):
    return (torch.zeros(1, s, h, d), torch.zeros(1, s, h_kv, d), torch.zeros(1, s, h_kv, d))


def test_shard_errors():
    x = torch.zeros(1, 10, 2, 4)
    with pytest.raises(ValueError, match=r"multiple of 8 \(2 x world_size chunks\)"):
        shard(x, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="multiple of 4"):
        shard(x, 4, 0, "contiguous")
    with pytest.raises(ValueError, match=r"shard: rank must be an int in \[0, 2\)"):
        shard(torch.zeros(1, 12, 2, 4), 2, 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(x, 2, 0, "striped")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        shard(x, 0, 0)
    with pytest.raises(ValueError, match="one shape"):
        unshard([torch.zeros(1, 2, 1), torch.zeros(1, 3, 1)])
    with pytest.raises(ValueError, match="empty"):
        unshard([])


def test_usp_attention_errors_single_rank():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="layout must be one of"):
        usp_attention(q, k, v, layout="ring")
    with pytest.raises(ValueError, match="even local sequence length"):
        usp_attention(*_qkv(s=3), layout="zigzag")
    with pytest.raises(ValueError, match="H_kv = 3 key/value heads must divide H = 2"):
        usp_attention(*_qkv(h=2, h_kv=3))
    with pytest.raises(ValueError, match=r"k must be \[B=1, S_local=4, H_kv, D=4\]"):
        usp_attention(q, torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="q must be a local shard"):
        usp_attention(q[0], k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        usp_attention(q, k.double(), v.double())
    with pytest.raises(ValueError, match="backend must be one of"):
        usp_attention(q, k, v, backend="flash3")
    with pytest.raises(TypeError, match="causal must be a bool"):
        usp_attention(q, k, v, causal=1)


def test_single_rank_is_plain_attention():
    """No groups: one rank holding the whole sequence, plain attention (with the LSE path)."""
    from paperclub.testing import assert_rel_close
    from repro.usp.reference import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        for backend in ("math", "sdpa"):
            got = usp_attention(q, k[:, :, :2], v[:, :, :2], causal=causal, backend=backend)
            assert_rel_close(got, attention(q, k[:, :, :2], v[:, :, :2], causal), 1e-12)


def test_group_errors(world4):
    msgs = world4.run(
        worker.run_errors,
        [
            ("make_groups", {"ulysses_degree": 3, "ring_degree": 1}),
            ("make_groups", {"ulysses_degree": 0, "ring_degree": 2}),
        ],
    )[0]
    assert "ulysses_degree x ring_degree = 3 x 1 = 3 must divide the number of ranks 4" in msgs[0]
    assert "ulysses_degree must be an int >= 1, got 0" in msgs[1]
    msgs = world4.run(worker.run_usp_heads_error, 4, 6)
    assert all("Ulysses degree 4 must divide the H = 6 query heads" in m for m in msgs), msgs


def test_new_arguments_refuse_bad_values(tmp_path):
    """head_groups, the fa4 Gluon backend off a GPU, the benchmark's modes and the ingest of nothing."""
    from repro.usp.ingest import ingest
    from repro.usp.local import get_backend
    from repro.usp.ulysses import head_groups_for

    q, k, v = _qkv()
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="head_groups must be an int >= 1"):
            usp_attention(q, k, v, head_groups=bad)
    with pytest.raises(ValueError, match="head_groups must be an int >= 1, got 0"):
        head_groups_for(0, 8, 2)
    assert head_groups_for(4, 8, 2) == 4 and head_groups_for(3, 8, 2) == 2 and head_groups_for(4, 2, 2) == 1
    with pytest.raises(RuntimeError, match="'fa4_gluon' is a Hopper GPU kernel"):
        get_backend("fa4_gluon").forward(q, k, v, False, 0.5)
    with pytest.raises(ValueError, match="backend must be one of"):
        usp_attention(q, k, v, backend="fa4_gluonn")
    assert ingest(tmp_path) == []  # no result files: nothing written, no error
