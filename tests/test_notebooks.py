"""The teaching notebooks: each runs top to bottom, and each committed .ipynb matches its source.

The sources are ``notebooks/NN_name.py`` (jupytext percent format); ``notebooks/build.py``
turns them into the committed, executed ``.ipynb`` files, each in a fresh kernel. Here
every cell of every source is executed in a kernel of *this* interpreter (a kernelspec
made on the fly, never an installed ``python3`` kernel of some other environment), with a
timeout per cell; any cell that raises fails the test. Each notebook ends with an assert
against an unsharded or DDP reference, so a notebook that runs is a claim that holds.

The nine share one kernel (its start-up and its imports of torch, matplotlib and zerofn
cost more than most notebooks' own work), and each starts with the namespace cleared
(``%reset -f``), so a notebook that uses a name it does not define or import fails here
as it would in a fresh kernel. Each one sets its own torch threads, seeds and matplotlib
settings, so none depends on what an earlier one left in the modules.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("zerofn_notebooks_build", ROOT / "notebooks" / "build.py")
assert _spec is not None and _spec.loader is not None
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

EXPECTED = [
    "01_sharding",
    "02_collectives",
    "03_training_loop",
    "04_mixed_precision",
    "05_checkpoints",
    "06_whole_tensor_optimizers",
    "07_lowbit_state",
    "08_jit",
    "09_compressed_wire",
]
# Appended to each notebook under test (not to the committed one): every World the
# notebook started must have been closed, so no worker process outlives it.
NO_WORKERS_LEFT = (
    "import multiprocessing\n"
    "assert not multiprocessing.active_children(), "
    "f'worker processes left running (call world.close()): {multiprocessing.active_children()}'"
)
# Prepended to each notebook under test: the shared kernel's namespace is emptied, so no
# name an earlier notebook defined or imported is still bound. ``%reset`` also drops the
# module's own dunders (``__spec__``: multiprocessing's spawn reads it), so those are put back.
CLEAR_NAMESPACE = (
    "get_ipython()._zerofn_dunders = {k: v for k, v in globals().items() if k[:2] == k[-2:] == '__'}\n"
    "get_ipython().run_line_magic('reset', '-f')\n"
    "for k, v in get_ipython()._zerofn_dunders.items():\n"
    "    globals().setdefault(k, v)\n"
    "left = [k for k in globals() if not k.startswith('_')]\n"
    "left = [k for k in left if k not in ('In', 'Out', 'get_ipython', 'exit', 'quit', 'open', 'left', 'k', 'v')]\n"
    "assert not left, f'names left from an earlier notebook: {left}'\n"
    "del k, v, left"
)


@pytest.fixture(scope="module")
def kernel():
    """The kernel manager every notebook of this module runs in (see the module's docstring)."""
    with build.shared_kernel() as km:
        yield km


def test_the_nine_notebooks_are_there() -> None:
    assert [p.stem for p in build.NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("source", build.NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_has_the_cells_of_its_source(source: Path) -> None:
    problem = build.out_of_sync(source)
    assert problem is None, f"{problem}; regenerate with `python notebooks/build.py {source.stem[:2]}`"


@pytest.mark.parametrize("source", build.NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_and_closes_its_workers(source: Path, kernel) -> None:
    nb = build.read_source(source)
    nb.cells.insert(0, nbformat.v4.new_code_cell(CLEAR_NAMESPACE))
    nb.cells.append(nbformat.v4.new_code_cell(NO_WORKERS_LEFT))
    build.execute(nb, km=kernel)  # raises CellExecutionError, with the cell and its traceback, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
