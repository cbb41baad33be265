"""One world of 4 CPU worker processes (gloo) for the whole test session: spawning costs seconds per
process on the CI machine, so it happens once and every drawn case of every module runs inside it
(groups of the first 1-4 ranks)."""

from __future__ import annotations

import pytest

WORLD = 4


@pytest.fixture(scope="session")
def world4():
    from nanoparallel.launch import World
    from repro.parallelism.tests import worker

    with World(WORLD) as w:
        w.run(worker.setup, timeout=120)
        yield w
