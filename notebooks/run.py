"""Executes the notebooks and stores the executed copies (outputs included).

    pip install -e ".[notebooks]" && python notebooks/run.py [--update] [NAME ...]

By default the executed copies, and the README's picture, go to
``build/notebooks/`` (ignored by git): the committed notebooks are never
touched. ``--update`` refreshes the committed notebooks' stored outputs (for
readers on the web), and only once every notebook asked for has run: one
that fails leaves every committed file as it was. The test suite runs the
notebooks' code itself (``tests/test_notebooks.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
BUILD = HERE.parent / "build" / "notebooks"


def byte_map_png(path: Path) -> None:
    """The README's picture: pool 0 of the built-in hybrid model, per group."""
    import matplotlib

    matplotlib.use("Agg")
    import jaxkv
    from jaxkv.pictures import plot_byte_map

    plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
    plot_byte_map(plan, pool=0, max_columns=512).savefig(path, dpi=80)


def _write_atomically(nb: nbformat.NotebookNode, path: Path) -> None:
    """Writes `nb` to `path` through a temporary file in the same folder.

    The kernel's per-cell execution timestamps are dropped: a stored notebook
    holds its outputs, not when and where they were made.
    """
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".ipynb")
    os.close(fd)
    nbformat.write(nb, tmp)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("names", nargs="*", help="notebooks to run (default: all)")
    ap.add_argument(
        "--update",
        action="store_true",
        help="store the outputs in the committed notebooks once all have run",
    )
    args = ap.parse_args(argv)
    paths = (
        [HERE / n for n in args.names] if args.names else sorted(HERE.glob("*.ipynb"))
    )
    out_dir = HERE if args.update else BUILD
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(HERE.parent)}},
        ).execute()
        executed.append((nb, out_dir / path.name))
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    for nb, target in executed:
        _write_atomically(nb, target)
    byte_map_png(out_dir / "byte_map.png")
    print(f"wrote {len(executed)} notebooks to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
