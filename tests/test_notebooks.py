"""A walkthrough that fails or runs too long is named in one line (notebook, cell, error), not in
nbclient's traceback of a hundred lines."""

from __future__ import annotations

import nbformat
import pytest

from paperclub.notebooks import NotebookError, _execute


def notebook(*cells: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A walkthrough")] + [
        nbformat.v4.new_code_cell(c) for c in cells
    ]
    return nb


def test_a_failing_cell_is_named_in_one_line():
    nb = notebook("x = 1", "import math\nmath.sqrt(-x)", "print('never')")
    with pytest.raises(NotebookError) as info:
        _execute(nb, "repro/toy/walkthrough.ipynb", timeout_s=60)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "repro/toy/walkthrough.ipynb: code cell 2 of 3 ('import math') raised ValueError: math domain error"
    )


def test_a_cell_past_the_limit_is_named_with_what_to_do():
    nb = notebook("import time\ntime.sleep(30)")
    with pytest.raises(NotebookError) as info:
        _execute(nb, "repro/toy/walkthrough.ipynb", timeout_s=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "repro/toy/walkthrough.ipynb: code cell 1 of 1 ('import time') ran past the 2 s"
    )
    assert "seconds on a CPU" in message
