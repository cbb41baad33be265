"""Repository-wide pytest setup for a run spread over pytest-xdist workers (``.ci/test`` runs
``-n <cores> --dist loadgroup``); without xdist nothing here changes a run.

* Tests that share an expensive fixture of session, package, module or class scope defined in this
  repository (the built site, a world of gloo worker processes, the pre-trained policy, a module's
  offline sm_90a compiles, a clone of the repository) go to one worker: each such fixture, and every
  test that uses it, is one ``xdist_group``, so that no worker builds it a second time. Fixtures
  that one test uses together join their groups (the browser test's server needs the built site).
* Each worker's torch gets its share of the cores for its intra-op threads (and so do the processes
  it starts, through OMP_NUM_THREADS): two workers' thread pools of a thread per core each spun
  against each other on the 2-core CI machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from paperclub import usable_cpus

HERE = Path(__file__).resolve().parent
_SHARED_SCOPES = ("session", "package", "module", "class")


_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if os.environ.get("PYTEST_XDIST_WORKER") and _WORKERS > 1:
    _threads = max(1, usable_cpus() // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    if "torch" in sys.modules:  # already imported (by a plugin): set its pool too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _ours(fixturedef) -> bool:
    """Whether a fixture is defined in this repository (not pytest's own, like tmp_path_factory)."""
    func = getattr(fixturedef, "func", None)
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    path = Path(code.co_filename).resolve()
    return path.is_relative_to(HERE) and ".venv" not in path.relative_to(HERE).parts


def _fixture_key(fixturedef) -> str:
    code = fixturedef.func.__code__
    return f"{Path(code.co_filename).resolve().relative_to(HERE)}::{fixturedef.argname}"


def xdist_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Node id -> group name for the tests that share one of this repository's fixtures of a scope
    wider than a test (union of the fixtures each test uses; the group is named after its first
    fixture in sorted order, the same on every worker)."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    uses: dict[str, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        keys = sorted(
            {
                _fixture_key(fd)
                for defs in info.name2fixturedefs.values()
                for fd in defs[-1:]  # the definition the test gets (the closest override)
                if fd.scope in _SHARED_SCOPES and _ours(fd)
            }
        )
        if not keys:
            continue
        uses[item.nodeid] = keys
        for k in keys:
            parent.setdefault(k, k)
        for k in keys[1:]:
            a, b = find(keys[0]), find(k)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {nodeid: find(keys[0]) for nodeid, keys in uses.items()}


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers it too; here for a run without xdist (-p no:xdist) under --strict-markers
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups = xdist_groups(items)
    for item in items:
        if item.nodeid in groups and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))


@pytest.hookimpl(wrapper=True)
def pytest_collection_finish(session: pytest.Session):
    """On an xdist worker under --dist loadgroup: the test ids it sends the controller carry their
    group ("<id>@<group>"), by which the controller's scheduler keeps a group on one worker.

    pytest-xdist (3.8) writes that suffix into ``item._nodeid``, which pytest 9 no longer reads (a
    node's id is ``item._id``): every test was scheduled alone and each worker built the site and the
    process worlds. Here the suffix is in place only while the worker sends its collection, so test
    reports (and the claims records made from them) keep the plain ids."""
    config = session.config
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return (yield)
    try:  # pytest's own: a pytest without it runs the tests ungrouped (slower, not wrong)
        from _pytest.nodeid import NodeId
    except ImportError:
        return (yield)

    changed = []
    for item in session.items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        suffix = "@" + "_".join(names)
        if names and hasattr(item, "_id") and not item.nodeid.endswith(suffix):
            changed.append((item, item._id))
            item._id = NodeId.parse(item.nodeid + suffix)
    try:
        return (yield)
    finally:
        for item, old in changed:
            item._id = old
