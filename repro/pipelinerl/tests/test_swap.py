"""The cheap in-flight swap: one flat parameter buffer, one copy into it, and the receiver's buffers.

* The engine's parameters are views of one buffer laid out as :func:`flat_weights` (same
  ``Parameter`` objects, dtype, shape, ``requires_grad``); a swap is one copy into it, so every
  parameter keeps its address (what a captured CUDA graph needs) and equals the sent weights
  exactly (a copy, no arithmetic).
* The receiver never writes the host buffer a pending engine copy reads: a stand-in engine whose
  "copy" runs only when the receiver synchronizes on its event sees the version it was handed, even
  while the trainer sends two newer ones.
* End to end through gloo: :func:`trainer.broadcast_weights` with and without the persistent host
  buffer, :meth:`WeightReceiver.load_into`, versions bookkept.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from repro.pipelinerl.actor import Engine, WeightReceiver
from repro.pipelinerl.model import Policy, flat_buffer, flat_weights, flatten_parameters_, load_flat_weights
from repro.pipelinerl.pipeline import make_groups
from repro.pipelinerl.tests.conftest import MODEL, TASK
from repro.pipelinerl.trainer import broadcast_stop, broadcast_weights


def _weights(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return flat_weights(Policy(MODEL))


def test_flat_buffer_layout_is_flat_weights_order():
    model = Policy(MODEL)
    model.head.weight.requires_grad_(False)
    before = [(p, p.shape, p.dtype, p.requires_grad) for p in model.parameters()]
    expected = flat_weights(model)
    buf = flatten_parameters_(model)
    assert torch.equal(buf, expected)
    assert flatten_parameters_(model) is buf  # idempotent
    offset = 0
    for (p0, shape, dtype, grad), p in zip(before, model.parameters(), strict=True):
        assert p is p0 and p.shape == shape and p.dtype == dtype and p.requires_grad == grad
        assert p.data_ptr() == buf.data_ptr() + offset * buf.element_size()
        assert torch.equal(p.detach().flatten(), buf[offset : offset + p.numel()])
        offset += p.numel()
    assert offset == buf.numel()
    with torch.no_grad():
        buf[0] = 123.0  # the parameters see the buffer
    assert float(next(model.parameters()).detach().flatten()[0]) == 123.0


def test_unflat_models_still_load_parameter_by_parameter():
    model = Policy(MODEL)
    flatten_parameters_(model)
    model.double()  # new storage: no longer flat
    assert flat_buffer(model) is None
    w = _weights(1)
    load_flat_weights(model, w)
    assert torch.equal(flat_weights(model), w.double().float())
    with pytest.raises(ValueError, match=r"one dtype and device"):
        m = Policy(MODEL)
        m.head.weight.data = m.head.weight.data.double()
        flatten_parameters_(m)


def test_swaps_keep_addresses_and_equal_the_sent_weights():
    model = Policy(MODEL).eval()
    engine = Engine(model, TASK, 3, seed=0)
    ptrs = [p.data_ptr() for p in model.parameters()]
    for v, seed in enumerate([1, 2, 3], start=1):
        w = _weights(seed)
        assert engine.load_weights(w, 10 * v) is None  # CPU: the copy is done on return
        w_sent = w.clone()
        w.zero_()  # the caller may reuse its vector at once on the CPU
        assert torch.equal(flat_weights(model), w_sent)
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        assert engine.version == 10 * v and int(engine.version_t) == 10 * v
        engine.add(v)
        engine.step()  # generation in between runs on the same storage
    assert [p.data_ptr() for p in model.parameters()] == ptrs


class _PendingCopy:
    """A CUDA event stand-in: the engine's copy runs when the receiver synchronizes on it."""

    def __init__(self, engine: _SlowEngine):
        self.engine = engine

    def synchronize(self) -> None:
        self.engine.copied = self.engine.source.clone()


class _SlowEngine:
    """Takes the receiver's buffer and copies it only later, as a GPU stream would.

    While it holds the buffer (inside ``load_weights``) it lets the trainer send two more versions
    and checks the buffer is untouched."""

    def __init__(self, pg0, weights: dict[int, torch.Tensor], receiver: WeightReceiver):
        self.pg0, self.weights, self.receiver = pg0, weights, receiver
        self.version, self.source, self.copied, self.while_held = -1, None, None, None
        self.sender: threading.Thread | None = None

    def load_weights(self, flat: torch.Tensor, version: int) -> _PendingCopy:
        self.version, self.source = version, flat
        model = Policy(MODEL)

        def send() -> None:
            for v in (2, 3):
                load_flat_weights(model, self.weights[v])
                broadcast_weights(self.pg0, model, v)

        self.sender = threading.Thread(target=send, daemon=True)
        self.sender.start()
        deadline = time.monotonic() + 30
        while self.receiver.newest_version() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.receiver.newest_version() == 2  # version 2 went into the other buffer
        time.sleep(0.2)  # version 3 has arrived by now, or is about to; it must not land here
        self.while_held = flat.clone()
        return _PendingCopy(self)


def test_receiver_waits_for_the_pending_copy_before_reusing_a_buffer():
    pg0, pg1 = make_groups(2)
    weights = {v: _weights(v) for v in (1, 2, 3)}
    receiver = WeightReceiver(pg1, weights[1].numel()).start()
    try:
        model = Policy(MODEL)
        load_flat_weights(model, weights[1])
        broadcast_weights(pg0, model, 1)
        receiver.received.wait(30)
        engine = _SlowEngine(pg0, weights, receiver)
        assert receiver.load_into(engine) == 1
        engine.sender.join(30)
        assert not engine.sender.is_alive()
        deadline = time.monotonic() + 30  # the root's send can complete before the receiver flips
        while receiver.newest_version() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert torch.equal(engine.while_held, weights[1])  # untouched while held
        assert torch.equal(engine.copied, weights[1])  # and until the copy had run
        got = receiver.take(1)
        assert got is not None and got[1] == 3 and torch.equal(got[0], weights[3])
    finally:
        broadcast_stop(pg0)
        receiver.thread.join(30)


@pytest.mark.parametrize("staged", [False, True])
def test_broadcast_and_swap_end_to_end(staged):
    pg0, pg1 = make_groups(2)
    trainer = Policy(MODEL)
    n = flat_weights(trainer).numel()
    host = torch.zeros(n) if staged else None
    receiver = WeightReceiver(pg1, n).start()
    engine = Engine(Policy(MODEL).eval(), TASK, 2)
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    try:
        assert receiver.load_into(engine) is None  # nothing received yet
        for version in (8, 16, 24):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            broadcast_weights(pg0, trainer, version, host)
            deadline = time.monotonic() + 30
            while receiver.newest_version() < version and time.monotonic() < deadline:
                time.sleep(0.001)
            assert receiver.load_into(engine) == version
            assert receiver.load_into(engine) is None  # nothing newer
            assert engine.version == version and int(engine.version_t) == version
            assert torch.equal(flat_weights(engine.model), flat_weights(trainer))
            assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
        if staged:
            with pytest.raises(ValueError, match=r"host must be a CPU float32 tensor of shape"):
                broadcast_weights(pg0, trainer, 32, torch.zeros(n - 1))
    finally:
        broadcast_stop(pg0)
        receiver.thread.join(30)
