"""GPU: the CUDA-graph engine, in-flight reloads at lr = 0, and a short real run with both threads.

Tolerances: the graph replays the eager step's kernels on buffers of the same shapes, so tokens
and log-probs agree exactly (checked to 1e-6); against cache-free generation 1e-3 on log-probs
(fp32, TF32 off, two attention code paths)."""

from __future__ import annotations

import pytest
import torch

from repro.pipelinerl.actor import Engine
from repro.pipelinerl.bench import drive
from repro.pipelinerl.model import Policy, load_flat_weights
from repro.pipelinerl.pipeline import Config, run
from repro.pipelinerl.reference import check_version_log, generate_reference
from repro.pipelinerl.task import make_prompt, sampling_uniforms
from repro.pipelinerl.tests.conftest import MODEL, TASK

SECTION = "Method: in-flight weight updates"
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _engine(weights, slots, graph):
    m = Policy(MODEL).cuda().eval()
    load_flat_weights(m, weights)
    e = Engine(m, TASK, slots, seed=3, attempts=2)
    if graph:
        assert e.capture()
    return e


@pytest.mark.claim("pipelinerl/inflight-invisible-at-lr0", section=SECTION)
@pytest.mark.parametrize("slots", [1, 7, 32])
def test_graph_engine_with_inflight_reloads_equals_eager(pretrained, slots):
    n = 3 * slots + 2
    base = drive(_engine(pretrained, slots, graph=False), n)
    swaps = {k: (pretrained.clone(), k) for k in range(1, 40, 2)}
    mixed = drive(_engine(pretrained, slots, graph=True), n, swaps)
    assert sum(len(set(s.versions)) > 1 for s in mixed.values()) > 0
    for i in base:
        assert mixed[i].tokens == base[i].tokens
        assert max(abs(a - b) for a, b in zip(mixed[i].logprobs, base[i].logprobs, strict=True)) <= 1e-6
        assert mixed[i].versions == sorted(mixed[i].versions)
    ref = Policy(MODEL).cuda().eval()
    load_flat_weights(ref, pretrained)
    for i in range(min(n, 6)):
        toks, lps = generate_reference(
            ref, make_prompt(TASK, 3, i // 2), sampling_uniforms(TASK, 3, i), TASK.max_new_tokens
        )
        assert toks == base[i].tokens
        assert max(abs(a - b) for a, b in zip(lps, base[i].logprobs, strict=True)) <= 1e-3


@pytest.mark.claim("pipelinerl/version-bookkeeping", section=SECTION)
@pytest.mark.parametrize("mode", ["pipeline", "conventional"])
def test_gpu_run_bookkeeping(pretrained, mode):
    cfg = Config(
        mode=mode, steps=6, batch_size=4, attempts=2, max_lag=8, slots=8, lr=1e-2, task=TASK, model=MODEL,
        init_weights=pretrained, device="cuda",
    )  # fmt: skip
    res = run(cfg)
    assert res.summary["cuda_graph"] is True
    assert res.summary["steps"] == 6
    check_version_log(res.used, cfg.max_lag, mode, cfg.batch_size)
