"""Messages between the processes of a multi-process run (``launch.py``): samples, grants, control.

Processes never share Python objects: everything that crosses between them is a message sent with
``torch.distributed.send`` / ``recv`` over a gloo process group (host memory over TCP, the same on a
GPU machine and in CI). A message is a header ``int64 [8]`` = ``[kind, n_ints, n_floats, a0..a4]``
followed, when their counts are non-zero, by one ``int64 [n_ints]`` and one ``float64 [n_floats]``
tensor. Between one sender and one receiver on one group messages arrive in the order they were
sent, which is all the protocol relies on.

Kinds (``a0..a4`` are small integers whose meaning depends on the kind):

* ``SAMPLES`` actor -> lead trainer: finished (or aborted) samples, and ``a0 = want`` (whole groups
  of free slots the actor could start now, beyond the grants it holds) and ``a1 = seen`` (samples
  granted to it that it had received when it counted ``want``; the trainer subtracts what it has
  granted since). No samples: a bare update of ``want`` (also sent as a heartbeat).
* ``GRANT`` lead trainer -> actor: start sample indices ``a0 .. a0 + a1 - 1`` once your weights are
  at least version ``a2`` (the admission rule, see ``launch.py``).
* ``WEIGHTS`` lead trainer -> actor: join the broadcast of weights version ``a0`` now.
* ``BATCH`` lead trainer -> another trainer: its share of the next optimizer step's batch.
* ``STOP`` lead trainer -> everyone: the run (of this mode) is over.
* ``BYE`` actor or trainer -> lead trainer: last message of a mode, a JSON record (counts for the
  sample accounting, busy times) as bytes in the int tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from repro.pipelinerl.actor import Sample

SAMPLES, GRANT, WEIGHTS, BATCH, STOP, BYE = 1, 2, 3, 4, 5, 6
KIND_NAMES = {
    SAMPLES: "SAMPLES",
    GRANT: "GRANT",
    WEIGHTS: "WEIGHTS",
    BATCH: "BATCH",
    STOP: "STOP",
    BYE: "BYE",
}
HEADER = 8
N_ARGS = HEADER - 3
_PER_SAMPLE = 5  # index, actor, truncated, prompt length, completion length


@dataclass
class Message:
    """One message: its kind, up to five small integer arguments and the two payload tensors."""

    kind: int
    args: list[int] = field(default_factory=list)
    ints: torch.Tensor | None = None  # int64 [n]
    floats: torch.Tensor | None = None  # float64 [n]

    def __post_init__(self) -> None:
        if self.kind not in KIND_NAMES:
            raise ValueError(f"Message: kind must be one of {sorted(KIND_NAMES)}, got {self.kind}")
        if len(self.args) > N_ARGS:
            raise ValueError(f"Message: at most {N_ARGS} arguments, got {len(self.args)}")


def send(msg: Message, dst: int, group) -> None:
    """Send ``msg`` to global rank ``dst`` over ``group`` (blocking until it has left)."""
    ints = msg.ints if msg.ints is not None else torch.zeros(0, dtype=torch.long)
    floats = msg.floats if msg.floats is not None else torch.zeros(0, dtype=torch.float64)
    if ints.dtype != torch.long or floats.dtype != torch.float64 or ints.dim() != 1 or floats.dim() != 1:
        raise ValueError(
            f"channel.send: payloads must be 1-D int64 and float64, got {ints.dtype} {tuple(ints.shape)} "
            f"and {floats.dtype} {tuple(floats.shape)}"
        )
    args = list(msg.args) + [0] * (N_ARGS - len(msg.args))
    header = torch.tensor([msg.kind, ints.numel(), floats.numel(), *args], dtype=torch.long)
    dist.send(header, dst, group=group)
    if ints.numel():
        dist.send(ints.contiguous(), dst, group=group)
    if floats.numel():
        dist.send(floats.contiguous(), dst, group=group)


def recv(src: int, group) -> Message:
    """Receive the next message from global rank ``src`` over ``group`` (blocking)."""
    header = torch.zeros(HEADER, dtype=torch.long)
    dist.recv(header, src, group=group)
    kind, n_ints, n_floats, *args = header.tolist()
    if kind not in KIND_NAMES or n_ints < 0 or n_floats < 0:
        raise RuntimeError(f"channel.recv: a malformed header from rank {src}: {header.tolist()}")
    ints = torch.zeros(n_ints, dtype=torch.long)
    floats = torch.zeros(n_floats, dtype=torch.float64)
    if n_ints:
        dist.recv(ints, src, group=group)
    if n_floats:
        dist.recv(floats, src, group=group)
    return Message(kind, args, ints, floats)


def pack_samples(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` -> ``(ints int64 [n], floats float64 [m])``, exactly invertible by :func:`unpack_samples`.

    Per sample: ints ``[index, actor, truncated, len(prompt), len(tokens)] + prompt + tokens +
    versions``, floats ``[reward] + logprobs`` (float64 holds the engine's float32 log-probs exactly).
    Times are not sent: each process has its own clock."""
    ints: list[int] = []
    floats: list[float] = []
    for s in samples:
        if not (len(s.tokens) == len(s.logprobs) == len(s.versions)):
            raise ValueError(
                f"pack_samples: sample {s.index} has {len(s.tokens)} tokens, {len(s.logprobs)} log-probs and "
                f"{len(s.versions)} versions (must be equal)"
            )
        ints += [
            s.index,
            s.actor,
            int(s.truncated),
            len(s.prompt),
            len(s.tokens),
            *s.prompt,
            *s.tokens,
            *s.versions,
        ]
        floats += [s.reward, *s.logprobs]
    return torch.tensor(ints, dtype=torch.long), torch.tensor(floats, dtype=torch.float64)


def unpack_samples(ints: torch.Tensor, floats: torch.Tensor) -> list[Sample]:
    """Inverse of :func:`pack_samples`."""
    iv, fv = ints.tolist(), floats.tolist()
    out: list[Sample] = []
    i = f = 0
    while i < len(iv):
        index, actor, truncated, p, n = iv[i : i + _PER_SAMPLE]
        i += _PER_SAMPLE
        prompt, tokens, versions = iv[i : i + p], iv[i + p : i + p + n], iv[i + p + n : i + p + 2 * n]
        i += p + 2 * n
        reward, logprobs = fv[f], [float(x) for x in fv[f + 1 : f + 1 + n]]
        f += 1 + n
        out.append(
            Sample(index=index, prompt=prompt, tokens=tokens, logprobs=logprobs, versions=versions,
                   reward=reward, actor=actor, truncated=bool(truncated))
        )  # fmt: skip
    if i != len(iv) or f != len(fv):
        raise RuntimeError(
            f"unpack_samples: {len(iv) - i} ints and {len(fv) - f} floats left over (corrupt payload)"
        )
    return out


def pack_json(record: dict) -> torch.Tensor:
    """A JSON-serialisable record as int64 bytes (for ``BYE``)."""
    return torch.tensor(list(json.dumps(record).encode()), dtype=torch.long)


def unpack_json(ints: torch.Tensor) -> dict:
    return json.loads(bytes(ints.tolist()).decode())
