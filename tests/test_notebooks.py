"""Notebooks run top to bottom (their code cells, in one namespace), and the
checks they print hold: every "identical:" and "reads layer N's view:" says
True, every "paged == dense for a/b" has a == b.
"""  # noqa: D205

import json
import re
from pathlib import Path

import pytest

# Five notebooks end to end (about 17 s): the slow pass; the library paths they
# run are the unit tests' too.
pytestmark = pytest.mark.slow

NOTEBOOKS = sorted(
    (Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb")
)


# The printed checks each notebook makes (at least).
CHECKS = {
    "01_tour.ipynb": 1,
    "02_your_model.ipynb": 3,
    "03_hybrid_and_mixed_layouts.ipynb": 0,
    "04_step_loop.ipynb": 2,
    "05_porting_from_vllm.ipynb": 1,
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert out
    flags = re.findall(r"(identical|reads layer \d+'s view): (\w+)", out)
    counts = re.findall(r"paged == dense for (\d+)/(\d+)", out)
    assert len(flags) + len(counts) >= CHECKS[path.name], out
    for what, value in flags:
        assert value == "True", (path.name, what)
    for a, b in counts:
        assert a == b, (path.name, a, b)
