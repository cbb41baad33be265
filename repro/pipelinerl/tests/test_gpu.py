"""GPU: the CUDA-graph engine, in-flight reloads at lr = 0, and a short real run with both threads.

Also the cheap swap: different weights swapped mid-sequence into the graph engine's flat parameter
buffer, from pinned memory with one asynchronous copy, give what an eager engine given the same
swaps gives; and the receiver does not overwrite a pinned buffer while a copy out of it is still
queued on the stream.

Tolerances: the graph replays the eager step's kernels on buffers of the same shapes, so tokens
and log-probs agree exactly (checked to 1e-6); against cache-free generation 1e-3 on log-probs
(fp32, TF32 off, two attention code paths)."""

from __future__ import annotations

import time

import pytest
import torch

from repro.pipelinerl.actor import Engine, WeightReceiver
from repro.pipelinerl.bench import drive
from repro.pipelinerl.model import Policy, load_flat_weights
from repro.pipelinerl.pipeline import Config, make_groups, run
from repro.pipelinerl.reference import check_version_log, generate_reference
from repro.pipelinerl.task import make_prompt, sampling_uniforms
from repro.pipelinerl.tests.conftest import MODEL, TASK
from repro.pipelinerl.trainer import broadcast_stop, broadcast_weights

SECTION = "Abstract (arXiv v1)"
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


def _perturbed(weights: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return weights + 0.05 * torch.randn(weights.shape, generator=g)


@pytest.mark.parametrize("slots", [1, 7, 32])
def test_graph_engine_with_different_weights_swapped_in_equals_eager(pretrained, slots):
    """Four different weight vectors swapped in mid-sequence, every 3 steps: the captured graph reads
    the flat buffer the pinned copies land in, so it samples what the eager engine samples."""
    n = 3 * slots + 2
    versions = [_perturbed(pretrained, k) for k in range(4)]
    pinned = {3 * k + 1: (versions[k % 4].pin_memory(), k + 1) for k in range(15)}
    pageable = {step: (w.clone(), v) for step, (w, v) in pinned.items()}
    graph = _engine(pretrained, slots, graph=True)
    ptrs = [p.data_ptr() for p in graph.model.parameters()]
    assert graph.flat.data_ptr() == ptrs[0]
    mixed = drive(graph, n, pinned)
    eager = drive(_engine(pretrained, slots, graph=False), n, pageable)
    unswapped = drive(_engine(pretrained, slots, graph=False), n)
    assert [p.data_ptr() for p in graph.model.parameters()] == ptrs
    assert sum(len(set(s.versions)) > 1 for s in mixed.values()) > 0
    assert any(
        mixed[i].tokens != unswapped[i].tokens or mixed[i].logprobs != unswapped[i].logprobs for i in mixed
    )
    for i in eager:
        assert mixed[i].tokens == eager[i].tokens, f"sample {i}"
        assert mixed[i].versions == eager[i].versions
        assert max(abs(a - b) for a, b in zip(mixed[i].logprobs, eager[i].logprobs, strict=True)) <= 1e-6
    torch.cuda.synchronize()
    assert graph.version >= 2
    assert torch.equal(graph.flat.cpu(), versions[(graph.version - 1) % 4])


def test_receiver_keeps_a_pinned_buffer_until_the_copy_out_of_it_has_run(pretrained):
    """The engine's copy is queued behind a ~0.25 s GPU sleep; meanwhile the trainer sends two newer
    versions (on its own stream). The second would land in the buffer the queued copy reads: the
    receiver must wait for the copy's event, so the engine ends up with version 1's weights."""
    pg0, pg1 = make_groups(2)
    weights = {v: _perturbed(pretrained, 10 + v) for v in (1, 2, 3)}
    n = pretrained.numel()
    receiver = WeightReceiver(pg1, n, pin=True).start()
    assert all(b.is_pinned() for b in receiver.bufs)
    trainers = {}  # one model per version, loaded before the GPU is kept busy
    for v, w in weights.items():
        trainers[v] = Policy(MODEL).cuda()
        load_flat_weights(trainers[v], w)
    host = torch.zeros(n, pin_memory=True)
    engine = _engine(pretrained, 4, graph=True)
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    side = torch.cuda.Stream()

    def send(v: int) -> None:
        with torch.cuda.stream(side):  # not behind the sleep on the current stream
            broadcast_weights(pg0, trainers[v], v, host)
        deadline = time.monotonic() + 30
        while receiver.newest_version() < v and time.monotonic() < deadline:
            time.sleep(0.001)
        assert receiver.newest_version() == v

    try:
        send(1)
        torch.cuda._sleep(500_000_000)  # the current stream is busy for a while
        assert receiver.load_into(engine) == 1  # returns at once; the copy waits behind the sleep
        send(2)  # into the other buffer
        with receiver.cond:
            pending = receiver.events[1 - receiver.latest]  # the buffer version 1 came in
        assert pending is not None and not pending.query(), "the copy was not pending: test too weak"
        send(3)  # into the buffer of version 1: only after the copy out of it has run
        torch.cuda.synchronize()
        assert torch.equal(engine.flat.cpu(), weights[1])
        assert receiver.load_into(engine) == 3
        torch.cuda.synchronize()
        assert torch.equal(engine.flat.cpu(), weights[3])
        assert engine.version == 3 and int(engine.version_t) == 3
        assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
    finally:
        broadcast_stop(pg0)
        receiver.thread.join(30)


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
