"""Executes every notebook in place, storing its outputs (for readers on the web).

    pip install -e ".[notebooks]" && python notebooks/run.py

The test suite runs the notebooks' code itself (``tests/test_notebooks.py``);
this script only refreshes the stored outputs after a notebook changes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def byte_map_png() -> None:
    """The README's picture: pool 0 of the built-in hybrid model, per group."""
    import matplotlib

    matplotlib.use("Agg")
    import jaxkv
    from jaxkv.pictures import plot_byte_map

    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    plot_byte_map(plan, pool=0, max_columns=512).savefig(HERE / "byte_map.png", dpi=80)


def main(names: list[str]) -> int:
    byte_map_png()
    paths = [HERE / n for n in names] if names else sorted(HERE.glob("*.ipynb"))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(HERE.parent)}},
        ).execute()
        nbformat.write(nb, path)
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
