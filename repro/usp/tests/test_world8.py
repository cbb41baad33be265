"""USP on spawned worlds of 6 and 8 ranks (every factorisation), opt-in: ``USP_WORLD8=1 pytest ...``.

Spawning 8 workers takes about a minute on the 2-core CI machine (each imports torch), more than this
package's CPU test budget, so the default suite covers 1-4 ranks as processes and up to 8 as an
emulated ring in one process. Run on 2026-11-24 with USP_WORLD8=1: all cases passed.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.usp.tests.sections import HYBRID_SECTION
from repro.usp.tests.test_usp import SETTINGS, cases, check_exact
from repro.usp.tests.worker import Case

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("USP_WORLD8"), reason="opt-in (USP_WORLD8=1): spawns 8 processes"),
]


@pytest.fixture(scope="module")
def world8():
    from nanoparallel.launch import World
    from repro.usp.tests import worker

    with World(8) as w:
        w.run(worker.setup, timeout=300)
        yield w


@st.composite
def big_cases(draw):
    """A drawn case on 6 or 8 ranks, any factorisation."""
    p = draw(st.sampled_from([6, 8]))
    pu = draw(st.sampled_from([d for d in range(1, p + 1) if p % d == 0]))
    case = draw(cases(ulysses=pu))
    return Case(**{**case.__dict__, "ring": p // pu, "S": 2 * p * draw(st.integers(1, 2))})


@pytest.mark.claim("usp/usp-exact", section=HYBRID_SECTION)
@settings(max_examples=16, **SETTINGS)
@given(case=big_cases())
def test_usp_exact_on_6_and_8_ranks(world8, case):
    check_exact(world8, case)
