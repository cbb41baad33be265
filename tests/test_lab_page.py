"""The lab tools page (paperclub.lab_page): every tool of every lab folder, what it does (its docstring's
first paragraph) and how to run it, generated from the folders; a lab module without a docstring is an
error of ``paperclub check``."""

from __future__ import annotations

import json
from pathlib import Path

from paperclub import ROOT
from paperclub.claims import package_dirs
from paperclub.lab_page import lab_folders, lab_page, lab_problems, run_commands


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _fixture(root: Path) -> list[tuple[str, Path]]:
    """A repository with two lab folders: repro/toy/lab/ and nanoparallel/cuda/lab/."""
    lab = root / "repro" / "toy" / "lab"
    _write(
        lab / "__init__.py", '"""The toy lab: sweeps and snapshots. Nothing in the fast path imports it."""\n'
    )
    _write(lab / "sweep.py", '"""Tile sweeps of the toy kernel, each tile checked first.\n\n'
           "More detail that the page leaves out.\n\n"
           "    python -m repro.toy.lab.sweep --out DIR [--dtype bf16|fp16]   # on a GPU\n"
           "    python -m repro.toy.lab.sweep --dry-run\n\n"
           'It compares with ``snapshot.json``.\n"""\n\nif __name__ == "__main__":\n    pass\n')  # fmt: skip
    _write(lab / "helpers.py", '"""Shared launch recording for :mod:`repro.toy.lab.sweep`."""\n')
    _write(lab / "gpu.sh", "#!/usr/bin/env bash\n# The toy GPU job in one device call: tests, then the sweep.\n"
           "#   bash repro/toy/lab/gpu.sh --quick\nset -e\n")  # fmt: skip
    _write(lab / "snapshot.json", json.dumps([{"kernel": "a"}, {"kernel": "b"}, {"kernel": "c"}]))
    _write(lab / "README.md", "# toy lab\n")
    _write(root / "nanoparallel" / "cuda" / "lab" / "probe.py", '"""``python -m nanoparallel.cuda.lab.probe'
           ' --world-size 2``: link bandwidth by pattern."""\n')  # fmt: skip
    _write(root / "repro" / "toy" / "ops.py", '"""Not in a lab folder."""\n')
    return [("toy", root / "repro" / "toy"), ("nanoparallel", root / "nanoparallel")]


def test_the_page_lists_every_lab_tool_with_what_it_does_and_how_to_run_it(tmp_path):
    packages = _fixture(tmp_path)
    assert [name for name, _ in lab_folders(packages)] == ["toy", "nanoparallel"]
    page = lab_page(packages, tmp_path, repro_pages={"toy"})
    assert page.index("## toy") < page.index("## nanoparallel")
    assert "`repro/toy/lab/` ([the reproduction](repro/toy.md)): The toy lab: sweeps and snapshots." in page
    assert "[README.md](source/repro/toy/lab/README.md.md)" in page
    sweep = next(line for line in page.splitlines() if "`sweep.py`" in line)
    assert (
        "[`sweep.py`](source/repro/toy/lab/sweep.py.md) | Tile sweeps of the toy kernel, each tile checked first. |"
        in sweep
    )
    assert "More detail" not in sweep and "# on a GPU" not in sweep
    assert "<code>python -m repro.toy.lab.sweep --out DIR [--dtype bf16\\|fp16]</code>" in sweep  # one cell
    assert "<code>python -m repro.toy.lab.sweep --dry-run</code>" in sweep
    helpers = next(line for line in page.splitlines() if "`helpers.py`" in line)
    assert "Shared launch recording for `repro.toy.lab.sweep`. | no command line" in helpers
    script = next(line for line in page.splitlines() if "`gpu.sh`" in line)
    assert "[`gpu.sh`](source/repro/toy/lab/gpu.sh.md) | The toy GPU job in one device call" in script
    assert "<code>bash repro/toy/lab/gpu.sh --quick</code>" in script
    # data is named, not linked (the site has no page for a lab .json)
    assert (
        "- `snapshot.json`: JSON, 3 entries; named in `sweep.py`" in page and "snapshot.json.md" not in page
    )
    assert "`ops.py`" not in page and "`__init__.py`" not in page
    probe = next(line for line in page.splitlines() if "`probe.py`" in line)
    assert (
        "| Link bandwidth by pattern. | <code>python -m nanoparallel.cuda.lab.probe --world-size 2</code> |"
        in probe
    )
    assert lab_problems(packages, tmp_path) == []


def test_a_lab_module_without_a_docstring_is_a_problem_naming_it(tmp_path):
    packages = _fixture(tmp_path)
    _write(tmp_path / "repro" / "toy" / "lab" / "bisect.py", "import sys\n")
    _write(tmp_path / "repro" / "toy" / "lab" / "job.sh", "#!/usr/bin/env bash\nset -e\n")
    problems = lab_problems(packages, tmp_path)
    assert [(f, line) for f, line, _ in problems] == [
        ("repro/toy/lab/bisect.py", 1),
        ("repro/toy/lab/job.sh", 1),
    ]
    assert "needs a module docstring" in problems[0][2] and "leading comment" in problems[1][2]
    assert "| (no docstring) |" in lab_page(packages, tmp_path)


def test_run_commands_in_a_sentence_end_with_its_clause():
    text = "Writes run.log (bash repro/fa4/lab/gpu.sh, from the repository root). Then\n  bash repro/fa4/lab/gpu.sh --x"
    assert run_commands(text, "bash repro/fa4/lab/gpu.sh") == [
        "bash repro/fa4/lab/gpu.sh",
        "bash repro/fa4/lab/gpu.sh --x",
    ]
    assert run_commands("python -m a.b.toolkit", "python -m a.b.tool") == []


def test_the_repository_page_lists_every_lab_module_and_script():
    packages = package_dirs(ROOT)
    folders = lab_folders(packages)
    assert {name for name, _ in folders} >= {"fa4", "kda", "nsa", "pipelinerl", "dflash", "nanoparallel"}
    page = lab_page(packages, ROOT)
    for _, folder in folders:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if (
                path.suffix in (".py", ".sh")
                and path.name != "__init__.py"
                and "__pycache__" not in path.parts
            ):
                assert f"[`{path.relative_to(folder).as_posix()}`](source/{rel}.md) | " in page, rel
            elif path.suffix == ".json":
                assert f"- `{path.relative_to(folder).as_posix()}`" in page, rel
    assert "(no docstring)" not in page
    assert lab_problems(packages, ROOT) == []
