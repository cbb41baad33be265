"""The layout of nanoparallel/cuda (issue #40), read from the source without importing it.

One file per collective, the backend and the shared pieces import each other without a cycle and
never import the tools (check, sweep, emulate), the lab (``nanoparallel/cuda/lab/``: diagnosis,
tuning, compile reports) or the tests; the package's ``__init__.py`` turns NVLink multicast off
before its first import, so before anything can import torch.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

CUDA = Path(__file__).resolve().parents[2] / "nanoparallel" / "cuda"
# what a collective call runs: the package, the backend, one file per collective, what they share
FAST_PATH = (
    "__init__",
    "backend",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_to_all",
    "primitives",
    "partition",
    "policy",
    "auto_tables",
)
# tuning, diagnosis and compile reports: in nanoparallel/cuda/lab/, never beside the collectives
LAB = ("diagnose", "nccl_info", "tuning", "registers")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _tree(name: str) -> ast.Module:
    return ast.parse((CUDA / f"{name}.py").read_text())


def imports(name: str, top_level: bool = True) -> set[str]:
    """Modules ``name`` imports (dotted), at module level only or anywhere in the file; relative
    imports are resolved (the fast path's modules sit in nanoparallel.cuda), and so are
    ``importlib.import_module("...")`` calls with a constant name."""
    nodes = _tree(name).body if top_level else ast.walk(_tree(name))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = "nanoparallel.cuda".split(".")[: 3 - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            # "from nanoparallel.cuda import x": x may be a submodule
            out |= {f"{module}.{a.name}" for a in node.names}
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            out.add(node.args[0].value)
    return out


def package_imports(name: str) -> set[str]:
    """The nanoparallel.cuda modules that ``name`` imports at module level (not the package itself)."""
    known = {p.stem for p in CUDA.glob("*.py")}
    return {m.split(".")[2] for m in imports(name) if m.startswith("nanoparallel.cuda.")} & known - {
        "__init__"
    }


def test_every_collective_has_its_file_and_the_backend_binds_it():
    for c in COLLECTIVES:
        defined = {n.name for n in _tree(c).body if isinstance(n, ast.FunctionDef)}
        assert c in defined, f"nanoparallel/cuda/{c}.py defines no function {c}"
    bound = {
        t.id
        for cls in _tree("backend").body
        if isinstance(cls, ast.ClassDef) and cls.name == "CudaPeerBackend"
        for n in cls.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert set(COLLECTIVES) <= bound, f"CudaPeerBackend binds {sorted(bound)}"


def test_no_import_cycle_among_the_fast_path_modules():
    graph = {m: package_imports(m) for m in FAST_PATH}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 1:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            visit(n, path + [m])
        state[m] = 2

    for m in FAST_PATH:
        visit(m, [])


@pytest.mark.parametrize("name", FAST_PATH)
def test_the_fast_path_never_imports_tools_the_lab_or_tests(name):
    tools = {p.stem for p in CUDA.glob("*.py")} - set(FAST_PATH)
    got = imports(name, top_level=False)
    bad = sorted(
        m
        for m in got
        if m.startswith("tests")
        or any(m == f"nanoparallel.cuda.{t}" for t in tools)
        or m == "nanoparallel.cuda.lab"
        or m.startswith("nanoparallel.cuda.lab.")
    )
    assert not bad, f"nanoparallel/cuda/{name}.py imports {bad}"


def test_the_lab_holds_the_tuning_diagnosis_and_compile_tools():
    lab = CUDA / "lab"
    doc = ast.get_docstring(ast.parse((lab / "__init__.py").read_text()))
    assert doc, "nanoparallel/cuda/lab/__init__.py has no docstring saying what the lab is"
    for tool in LAB:
        assert (lab / f"{tool}.py").is_file(), f"nanoparallel/cuda/lab/{tool}.py is missing"
        assert not (CUDA / f"{tool}.py").exists(), f"nanoparallel/cuda/{tool}.py belongs in lab/"
        assert f"`{tool}.py`" in (lab / "README.md").read_text(), f"lab/README.md does not list {tool}.py"


def test_the_import_check_sees_relative_and_dynamic_imports(tmp_path, monkeypatch):
    # the check above can fail: a fast-path file that reached the lab by either route is caught
    (tmp_path / "probe.py").write_text(
        "import importlib\nfrom .lab import tuning\nfrom . import lab\n"
        "def f():\n    return importlib.import_module('nanoparallel.cuda.lab.diagnose')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "CUDA", tmp_path)
    got = imports("probe", top_level=False)
    assert {"nanoparallel.cuda.lab.tuning", "nanoparallel.cuda.lab", "nanoparallel.cuda.lab.diagnose"} <= got


def test_init_turns_nvlink_multicast_off_before_any_import():
    body = _tree("__init__").body
    first_import = next(
        i
        for i, n in enumerate(body)
        if isinstance(n, ast.ImportFrom | ast.Import) and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        and not (isinstance(n, ast.Import) and [a.name for a in n.names] == ["os"])
    )  # fmt: skip
    switches = {}
    for n in body[:first_import]:
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript):
            target = n.targets[0]
            if ast.unparse(target.value) == "os.environ":
                switches[ast.literal_eval(target.slice)] = ast.literal_eval(n.value)
    assert switches == NVLS_OFF
