"""The exceptions nanoparallel raises: every one names the rank that raised it and what it waited for.

After any of them the communicator is *aborted*: its streams may hold half-sent chunks, so it
refuses further work; build a new one (see FAULTS.md).
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of every nanoparallel failure."""


class CommTimeoutError(CommError, TimeoutError):
    """A wait made no progress for ``timeout_s`` (names rank, peer, operation and step)."""


class PeerFailureError(CommError):
    """A peer died (its process is gone) or aborted its communicator while we waited on it."""


class MismatchError(CommError):
    """Ranks called different collectives, or the same one with different arguments."""


class CommAbortedError(CommError):
    """The communicator was aborted by an earlier error or closed; create a new one."""
