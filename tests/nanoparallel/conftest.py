"""Worker worlds shared by the nanoparallel tests: spawned once per size, reused by every example.

Spawning a process and importing torch costs about a second on the 2-core CI machine, so each
world size gets one pool of workers for the whole session (nanoparallel.launch.World) and the
hypothesis examples are sent to it as tasks.
"""

from __future__ import annotations

import pytest

from nanoparallel.launch import World


@pytest.fixture(scope="session")
def worlds():
    cache: dict[int, World] = {}

    def get(n: int) -> World:
        if n not in cache:
            cache[n] = World(n)
        return cache[n]

    yield get
    for w in cache.values():
        w.close()
