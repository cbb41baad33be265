"""The actor: a slot-batched KV-cache engine that takes new weights in flight, and its loop.

:class:`Engine` decodes one token per slot per step (each slot holds one sequence at its own
position; a prompt is fed token by token through the same step). Every generated token records the
weight version that sampled it and its behaviour log-prob. :meth:`Engine.load_weights` replaces
the weights between two steps and keeps the KV cache: the in-flight weight update of
piche2025pipelinerl ("in-flight weight updates"). Sequences in the middle of generation continue with the new weights on top
of keys and values the old weights computed.

:func:`actor_loop` is the thread that owns an engine. What distinguishes the three modes is only
when it admits new sequences and when it takes new weights (the paper's comparison of the three schedules):

* ``pipeline``: admit while fewer than ``B + max_lag`` samples are ahead of the trainer; take new
  weights at the next step, mid-sequence.
* ``async``: same admission, but weights change only between sequences: once newer weights exist,
  stop admitting, let the batch drain, swap, resume.
* ``conventional``: generate a round of ``G * B`` samples (``G = max_lag / B + 1``), wait until the
  trainer has taken ``G`` steps on them, swap, start the next round.

One rule is the same in every mode and is ours, not the released code's (``abort_stale``, on by
default): a sequence whose oldest token is more than ``max_lag`` samples behind the engine's weights
is *doomed* (the trainer's version only grows, so ``take_batch`` would drop its group), and the
actor stops decoding it and the rest of its group at once (:func:`abort_doomed`); the truncated
samples go to the trainer, which drops the group on its usual stale path. Only pipeline mode ever
triggers it: async and conventional engines change weights with every slot idle.

Weights arrive through :class:`WeightReceiver`, a thread that joins the trainer's
``torch.distributed`` broadcasts and keeps the newest version in a host buffer (pinned on a GPU).
The swap is one copy from that buffer into the engine's flat parameter buffer: on a GPU a single
asynchronous host-to-device copy on the actor's stream, ordered before the next engine step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from repro.pipelinerl.model import Policy, flatten_parameters_, load_flat_weights
from repro.pipelinerl.reference import sample_token
from repro.pipelinerl.task import EOS, PAD, TaskConfig, make_prompt, reward, sampling_uniforms


@dataclass
class Sample:
    """One finished rollout: completion tokens, their behaviour log-probs and weight versions."""

    index: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    actor: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    truncated: bool = False  # aborted as doomed (abort_doomed): never trained on, always dropped


def doomed(oldest: int | None, engine_version: int, max_lag: int) -> bool:
    """True when a sample whose oldest token has version ``oldest`` can no longer be trained on.

    The trainer drops a group whose oldest token is more than ``max_lag`` behind ``trained``
    (``take_batch``). An engine's version is weights the trainer has already made, so ``trained >=
    engine_version`` now and forever after: once ``engine_version - oldest > max_lag`` the drop is
    certain. ``oldest`` None: no completion token yet (its first will carry a current version)."""
    return oldest is not None and engine_version - oldest > max_lag


class Engine:
    """Slot-batched generation with a KV cache; weights can change between any two steps.

    ``slots`` sequences decode together; :meth:`step` feeds one token for every slot (a fixed
    ``[slots]`` batch, idle slots included, so the step's cost does not depend on how many are
    busy, like a static-batch engine) and returns the sequences that finished. Every tensor the
    step touches is allocated once and updated in place, so on a GPU the step can be captured as a
    CUDA graph (:meth:`capture`) and replayed with one launch. The model's parameters are made views
    of one flat buffer here, before any capture (:func:`model.flatten_parameters_`): new weights are
    one copy into that buffer, the same storage the captured graph reads, so it runs them too.
    :meth:`abort` stops sequences before they finish (doomed ones, :func:`abort_doomed`), judged by
    the host-side :attr:`oldest` version per slot."""

    def __init__(
        self,
        model: Policy,
        task: TaskConfig,
        slots: int,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        attempts: int = 1,
        actor_id: int = 0,
    ):
        if slots < 1:
            raise ValueError(f"Engine: slots must be >= 1, got {slots}")
        if task.max_seq_len > model.cfg.max_len:
            raise ValueError(
                f"Engine: the task needs {task.max_seq_len} positions, the model's max_len is {model.cfg.max_len}"
            )
        self.model, self.task, self.slots = model, task, slots
        self.flat = flatten_parameters_(model)  # [N], flat_weights' layout; before capture()
        self.seed, self.temperature, self.attempts, self.actor_id = seed, temperature, attempts, actor_id
        dev = next(model.parameters()).device
        self.device = dev
        self.cache = model.new_cache(slots, dev)
        self.buf = torch.full((slots, model.cfg.max_len), PAD, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.prompt_len = torch.ones(slots, dtype=torch.long, device=dev)
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.uniforms = torch.zeros(slots, task.max_new_tokens, dtype=torch.float64, device=dev)
        self.logp = torch.zeros(slots, task.max_new_tokens, device=dev)
        self.vers = torch.zeros(slots, task.max_new_tokens, dtype=torch.long, device=dev)
        self.version_t = torch.zeros((), dtype=torch.long, device=dev)
        self._done = torch.zeros(slots, dtype=torch.bool, device=dev)
        self._j = torch.zeros(slots, dtype=torch.long, device=dev)
        self._ar = torch.arange(slots, device=dev)
        self.meta: list[tuple[int, list[int], float] | None] = [None] * slots
        self.free: list[int] = list(range(slots))
        self.version = 0
        self.graph = None
        # Host-side copies of what the step writes on the device, so that the doomed check needs no
        # device read: the step count, and per slot the step it was filled at and the version of its
        # first completion token (its oldest: versions never decrease along a sequence).
        self.n_steps = 0
        self.added_at = [0] * slots
        self.oldest: list[int | None] = [None] * slots
        self._first_due: dict[int, list[tuple[int, int]]] = {}  # step -> (slot, sample index)

    @property
    def n_active(self) -> int:
        return self.slots - len(self.free)

    def free_slot(self) -> int | None:
        return self.free[0] if self.free else None

    def add(self, sample_index: int) -> None:
        """Start sample ``sample_index`` (its prompt is problem ``sample_index // attempts``)."""
        self.add_many([sample_index])

    def add_many(self, indices: list[int]) -> None:
        """Start several samples at once (one host-to-device copy per tensor, not per sample)."""
        if len(indices) > len(self.free):
            raise RuntimeError(
                f"Engine.add: {len(indices)} samples but only {len(self.free)} free slots (every slot is busy)"
            )
        if not indices:
            return
        slots = [self.free.pop(0) for _ in indices]
        rows = torch.full((len(indices), self.buf.shape[1]), PAD, dtype=torch.long)
        lens = torch.zeros(len(indices), dtype=torch.long)
        us = torch.zeros(len(indices), self.task.max_new_tokens, dtype=torch.float64)
        now = time.perf_counter()
        for k, (s, i) in enumerate(zip(slots, indices, strict=True)):
            prompt = make_prompt(self.task, self.seed, i // self.attempts)
            rows[k, : len(prompt)] = torch.tensor(prompt)
            lens[k] = len(prompt)
            us[k] = sampling_uniforms(self.task, self.seed, i)
            self.meta[s] = (i, prompt, now)
            self.added_at[s], self.oldest[s] = self.n_steps, None
            # the prompt is fed one token per step: step n_steps + len(prompt) - 1 samples the first token
            self._first_due.setdefault(self.n_steps + len(prompt) - 1, []).append((s, i))
        idx = torch.tensor(slots, device=self.device)
        self.buf[idx] = rows.to(self.device)
        self.prompt_len[idx] = lens.to(self.device)
        self.uniforms[idx] = us.to(self.device)
        self.pos[idx] = 0
        self.active[idx] = True

    def load_weights(self, flat: torch.Tensor, version: int) -> torch.cuda.Event | None:
        """In-flight update: new weights from the next step on; the KV cache is kept as it is.

        ``flat [N]``: a vector in :func:`model.flat_weights`' layout. On a GPU this is one
        ``non_blocking`` copy into :attr:`flat` on the current stream (the actor's): from pinned
        host memory a DMA that runs in stream order before the next step, so the actor does not wait
        for it. Returns an event recorded after the copy: ``flat`` may be changed once it has
        completed (:class:`WeightReceiver` waits on it). On the CPU the copy is done on return and
        the result is None."""
        if version < self.version:  # before the copy: the weights must not change
            raise ValueError(
                f"Engine.load_weights: version {version} is older than the current {self.version}"
            )
        cuda = self.device.type == "cuda"
        load_flat_weights(self.model, flat, non_blocking=cuda)
        self.mark_loaded(version)
        if not cuda:
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def mark_loaded(self, version: int) -> None:
        """Record that the weights in :attr:`flat` are now ``version`` (from the next step on).

        For a caller that wrote :attr:`flat` itself, e.g. a ``torch.distributed`` broadcast straight
        into it on the engine's stream (``launch.py``); :meth:`load_weights` calls it after its copy.
        The device-side version tag is written on the current stream, so it is ordered after that
        write as well."""
        if version < self.version:
            raise ValueError(f"Engine: version {version} is older than the current {self.version}")
        self.version = version
        self.version_t.fill_(version)

    def _compute(self) -> None:
        """The step's tensor work, in place on the engine's buffers (capturable as a CUDA graph)."""
        ar, pos = self._ar, self.pos
        logits = self.model.decode(self.buf[ar, pos], pos, self.cache)
        gen_idx = pos + 1 - self.prompt_len  # index of the completion token this step produces
        generating = self.active & (gen_idx >= 0)
        j = gen_idx.clamp(0, self.task.max_new_tokens - 1)
        tok, lp = sample_token(logits, self.uniforms[ar, j], self.temperature)
        nxt = torch.where(generating, tok, self.buf[ar, pos + 1])
        self.buf[ar, pos + 1] = torch.where(self.active, nxt, self.buf[ar, pos + 1])
        self.logp[ar, j] = torch.where(generating, lp, self.logp[ar, j])
        self.vers[ar, j] = torch.where(generating, self.version_t.expand_as(j), self.vers[ar, j])
        self._done.copy_(generating & ((tok == EOS) | (j + 1 >= self.task.max_new_tokens)))
        self._j.copy_(j)
        self.pos += self.active.long()

    @torch.no_grad()
    def capture(self, capture_error_mode: str = "global") -> bool:
        """Capture :meth:`_compute` as a CUDA graph (only with every slot idle); False off the GPU.

        ``capture_error_mode``: as :class:`torch.cuda.graph`'s; ``"thread_local"`` where other threads
        of the process may call into CUDA during the capture (a process group's watchdog)."""
        if self.device.type != "cuda":
            return False
        if self.n_active:
            raise RuntimeError("Engine.capture: capture before admitting any sample")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (idle slots: writes nothing that matters)
            for _ in range(2):
                self._compute()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
            self._compute()
        self.graph = graph
        return True

    @torch.no_grad()
    def step(self) -> list[Sample]:
        """Decode one token in every busy slot; return the samples that finished (EOS or length)."""
        for s, i in self._first_due.pop(self.n_steps, ()):
            if self.meta[s] is not None and self.meta[s][0] == i:  # not aborted meanwhile
                self.oldest[s] = self.version
        if self.graph is not None:
            self.graph.replay()
        else:
            self._compute()
        self.n_steps += 1
        done = self._done.nonzero().flatten()
        if done.numel() == 0:
            return []
        slots = done.tolist()
        toks, lps, vers, js = (
            self.buf[done].cpu(),
            self.logp[done].cpu(),
            self.vers[done].cpu(),
            self._j[done].tolist(),
        )
        self.active[done] = False
        self.pos[done] = 0
        now = time.perf_counter()
        finished = []
        for k, s in enumerate(slots):
            index, prompt, t0 = self.meta[s]
            n, p0 = js[k] + 1, len(prompt)
            tokens = toks[k, p0 : p0 + n].tolist()
            finished.append(
                Sample(
                    index=index,
                    prompt=prompt,
                    tokens=tokens,
                    logprobs=lps[k, :n].tolist(),
                    versions=vers[k, :n].tolist(),
                    reward=reward(prompt, tokens),
                    actor=self.actor_id,
                    t_start=t0,
                    t_end=now,
                )
            )
            self.meta[s] = None
            self.free.append(s)
        return finished

    def active_slots(self) -> list[int]:
        return [s for s in range(self.slots) if self.meta[s] is not None]

    def generated(self, slot: int) -> int:
        """Completion tokens slot ``slot`` has sampled so far (0 while its prompt is being fed)."""
        prompt = self.meta[slot][1]
        return min(max(0, self.n_steps - self.added_at[slot] - (len(prompt) - 1)), self.task.max_new_tokens)

    @torch.no_grad()
    def abort(self, slots: list[int]) -> list[Sample]:
        """Stop the sequences in ``slots`` and free the slots; return them as truncated samples.

        Each keeps the tokens, log-probs and versions sampled so far (possibly none) and is marked
        ``truncated`` with reward 0: it exists only so that the trainer sees its group complete and
        drops it (see :func:`abort_doomed`)."""
        if not slots:
            return []
        if any(self.meta[s] is None for s in slots):
            raise RuntimeError(f"Engine.abort: slots {[s for s in slots if self.meta[s] is None]} are idle")
        idx = torch.tensor(slots, device=self.device)
        toks, lps, vers = self.buf[idx].cpu(), self.logp[idx].cpu(), self.vers[idx].cpu()
        self.active[idx] = False
        self.pos[idx] = 0
        now = time.perf_counter()
        out = []
        for k, s in enumerate(slots):
            index, prompt, t0 = self.meta[s]
            n, p0 = self.generated(s), len(prompt)
            out.append(
                Sample(
                    index=index, prompt=prompt, tokens=toks[k, p0 : p0 + n].tolist(), logprobs=lps[k, :n].tolist(),
                    versions=vers[k, :n].tolist(), reward=0.0, actor=self.actor_id, t_start=t0, t_end=now,
                    truncated=True,
                )
            )  # fmt: skip
            self.meta[s], self.oldest[s] = None, None
            self.free.append(s)
        return out


def broadcast_options(root: int = 0) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return opts


class WeightReceiver:
    """Joins every weight broadcast of the trainer (rank 0) and keeps the newest in host memory.

    Each broadcast is a header ``int64 [version, stop]`` then, unless stop, the fp32 weights. The
    thread never waits for the engine's steps, so the trainer is held up only by the transfer itself.

    Two host buffers (pinned when ``pin``, i.e. the engine is on a GPU, so that the swap is one
    asynchronous DMA): ``bufs[latest]`` holds the newest complete version, and each broadcast is
    received straight into the other one, then ``latest`` flips. :meth:`load_into` hands
    ``bufs[latest]`` itself to the engine (no copy on the host). Why the receiver never writes a
    buffer that a pending copy still reads:

    * only the receiver thread writes a buffer, and never ``bufs[latest]``;
    * the actor reads only ``bufs[latest]``, in :meth:`load_into`, which marks it held under the
      lock before the engine's copy is issued and, when it releases it, stores the CUDA event the
      engine recorded after the copy;
    * before receiving into a buffer, the receiver waits until no actor holds it, then for that
      event (``synchronize``): the last copy out of the buffer has completed. The wait is normally
      already over: a 12.8 MB pinned copy takes well under a millisecond, a broadcast several.

    One receiver serves one engine (``held`` is a flag, not a count). On the CPU the engine's copy
    is synchronous and there is no event."""

    def __init__(self, pg, numel: int, *, pin: bool = False):
        self.pg, self.numel = pg, numel
        self.cond = threading.Condition()
        self.bufs = [torch.zeros(numel, pin_memory=pin) for _ in range(2)]
        self.held = [False, False]
        self.events: list = [None, None]  # per buffer: the event after the last copy out of it
        self.latest = 0
        self.latest_version = -1
        self.received = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="weight-receiver")

    def start(self) -> WeightReceiver:
        self.thread.start()
        return self

    def _loop(self) -> None:
        header = torch.zeros(2, dtype=torch.long)
        while True:
            self.pg.broadcast([header], broadcast_options()).wait()
            if int(header[1]):
                return
            with self.cond:
                spare = 1 - self.latest
                while self.held[spare]:
                    self.cond.wait()
                pending, self.events[spare] = self.events[spare], None
            if pending is not None:
                pending.synchronize()  # the last copy out of this buffer has run
            self.pg.broadcast([self.bufs[spare]], broadcast_options()).wait()
            with self.cond:
                self.latest, self.latest_version = spare, int(header[0])
            self.received.set()

    def load_into(self, engine: Engine) -> int | None:
        """Swap the newest weights into ``engine`` if newer than its version; return that version.

        None when there is nothing newer. The copy itself is :meth:`Engine.load_weights`
        (asynchronous on a GPU); see the class docstring for why it never races with the receiver."""
        with self.cond:
            if self.latest_version <= engine.version:
                return None
            i, version = self.latest, self.latest_version
            self.held[i] = True
        done = None
        try:
            done = engine.load_weights(self.bufs[i], version)
        finally:
            if done is None and self.bufs[i].is_pinned():  # failed after issuing the copy: drain it
                torch.cuda.current_stream().synchronize()
            with self.cond:
                self.held[i] = False
                self.events[i] = done
                self.cond.notify_all()
        return version

    def take(self, newer_than: int) -> tuple[torch.Tensor, int] | None:
        """The newest weights if their version is above ``newer_than`` (a copy), else None."""
        with self.cond:
            if self.latest_version <= newer_than:
                return None
            return self.bufs[self.latest].clone(), self.latest_version

    def newest_version(self) -> int:
        with self.cond:
            return self.latest_version


@dataclass
class Shared:
    """What actors and trainer share besides the weight broadcast: counters and the sample queue."""

    mode: str
    batch_size: int
    max_lag: int
    abort_stale: bool = True  # stop decoding doomed groups (abort_doomed); False: the released code's rule
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = 0  # samples admitted by all actors so far (the next sample index)
    consumed: int = 0  # samples the trainer has taken off the queue (trained on or dropped)
    dropped: int = 0  # of which dropped as too stale
    aborted: int = 0  # samples handed over truncated as doomed (the trainer drops every one of them)
    doomed: set = field(default_factory=set)  # groups (index // attempts) known to be doomed
    stop: threading.Event = field(default_factory=threading.Event)
    finished: list = field(default_factory=list)  # Samples waiting for the trainer
    cond: threading.Condition | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    @property
    def rounds(self) -> int:
        """Conventional mode's G: optimizer steps per generation round."""
        return self.max_lag // self.batch_size + 1

    def try_admit(self, engine_version: int) -> int | None:
        """The next sample index if one more sample may start under weights ``engine_version``.

        The released code's rule, with versions in samples: an actor holding the weights trained on
        ``v`` samples may start samples up to ``v + B + max_lag`` (conventional mode: one round,
        ``G * B = B + max_lag``). Samples the trainer dropped as stale are credited back, or a
        window full of dropped samples would never move."""
        with self.lock:
            if self.started >= engine_version + self.dropped + self.batch_size + self.max_lag:
                return None
            self.started += 1
            return self.started - 1

    def put(self, samples: list[Sample]) -> None:
        if samples:
            with self.cond:
                self.finished.extend(samples)
                self.aborted += sum(s.truncated for s in samples)
                self.cond.notify_all()


def abort_doomed(shared: Shared, engine: Engine) -> list[Sample]:
    """Stop what ``engine`` decodes for doomed groups; return the truncated samples.

    A group is doomed once one member holds a token with :func:`doomed` true against the engine's
    version. Every member the engine is decoding then stops (:meth:`Engine.abort`): the doomed ones,
    the rest of their group, and members of groups other engines found doomed (``shared.doomed``).
    Handed to the trainer, they complete the group on the queue, whatever members had already
    finished, and ``take_batch`` drops it as stale (the engine's version is at most the trainer's),
    crediting the admission window. Host-side only (the engine's per-slot oldest versions): no
    device read unless something is aborted."""
    A = engine.attempts
    mine = engine.active_slots()
    new = {engine.meta[s][0] // A for s in mine if doomed(engine.oldest[s], engine.version, shared.max_lag)}
    with shared.lock:
        shared.doomed |= new
        stop = [s for s in mine if engine.meta[s][0] // A in shared.doomed]
    return engine.abort(stop)


def skip_doomed(shared: Shared, engine: Engine, admitted: list[int]) -> tuple[list[int], list[Sample]]:
    """Split just-admitted sample indices into those to start and empty truncated samples for the
    members of already doomed groups (a group admitted in two parts), which need no decoding."""
    A = engine.attempts
    with shared.lock:
        skip = {i for i in admitted if i // A in shared.doomed}
    if not skip:
        return admitted, []
    now = time.perf_counter()
    out = [
        Sample(
            i, make_prompt(engine.task, engine.seed, i // A), [], [], [], 0.0, engine.actor_id, now, now, True
        )
        for i in sorted(skip)
    ]
    return [i for i in admitted if i not in skip], out


def actor_loop(
    shared: Shared,
    engine: Engine,
    receiver: WeightReceiver,
    log: dict,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Run one actor until ``shared.stop``; appends timings to ``log['steps']`` and ``log['swaps']``.

    ``log['steps']``: ``(t, seconds, busy slots)`` per engine step; ``log['swaps']``: ``(t, version,
    seconds)`` per weight load; ``log['aborts']``: ``(t, version, samples)`` per :func:`abort_doomed`
    that stopped anything. Times are ``perf_counter`` seconds."""
    try:
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            _actor_loop(shared, engine, receiver, log)
    except BaseException as exc:  # surface the actor's failure to run() instead of hanging
        shared.error = exc
        shared.stop.set()
        with shared.cond:
            shared.cond.notify_all()


def _swap(engine: Engine, receiver: WeightReceiver, log: dict) -> bool:
    """Take the newest weights if newer. The logged seconds are the actor's own pause: on a GPU the
    time to issue the copy; the copy runs on the actor's stream and lands in the next step's time."""
    t0 = time.perf_counter()
    version = receiver.load_into(engine)
    if version is None:
        return False
    log["swaps"].append((t0, version, time.perf_counter() - t0))
    return True


def _actor_loop(shared: Shared, engine: Engine, receiver: WeightReceiver, log: dict) -> None:
    receiver.received.wait()  # the trainer's version-0 weights
    _swap(engine, receiver, log)
    mode = shared.mode
    seen_doomed = 0  # len(shared.doomed) at this engine's last check
    while not shared.stop.is_set():
        idle = engine.n_active == 0
        swapped = False
        if mode == "pipeline":
            swapped = _swap(engine, receiver, log)  # mid-sequence, KV cache kept
        elif idle:
            # async: between sequences. conventional: the trainer broadcasts only at the end of a
            # round, so newer weights are the next round's. (Not "trained on every sample started
            # so far": with several actors, the first to start the new round would lock the others
            # out of it.)
            swapped = _swap(engine, receiver, log)
        aborted: list[Sample] = []
        # Only a new version can doom a slot (new tokens carry the current one), and otherwise only
        # another engine's find can doom a group decoding here: check on those events, not every step.
        if shared.abort_stale and (swapped or len(shared.doomed) != seen_doomed):
            seen_doomed = len(shared.doomed)  # read first: a find racing with this check is seen next time
            aborted = abort_doomed(shared, engine)
        draining = mode == "async" and receiver.newest_version() > engine.version
        admitted = []
        while not draining and len(admitted) < len(engine.free):
            index = shared.try_admit(engine.version)
            if index is None:
                break
            admitted.append(index)
        if shared.abort_stale and shared.doomed and admitted:
            admitted, skipped = skip_doomed(shared, engine, admitted)
            aborted += skipped
        if aborted:
            log["aborts"].append((time.perf_counter(), engine.version, len(aborted)))
            shared.put(aborted)
        engine.add_many(admitted)
        if engine.n_active == 0:
            time.sleep(0.0005)  # nothing admitted: wait for the trainer
            continue
        t0 = time.perf_counter()
        busy = engine.n_active
        done = engine.step()
        log["steps"].append((t0, time.perf_counter() - t0, busy))
        shared.put(done)
