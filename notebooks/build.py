"""Build the teaching notebooks: ``NN_name.py`` (jupytext percent format) -> executed ``NN_name.ipynb``.

The ``.py`` files are the source: review and edit those. This script turns each into a
notebook, runs it top to bottom in a fresh kernel of *this* Python (a kernelspec made on
the fly in a temporary directory, so no installed ``python3`` kernel of another
environment is picked up), and writes the ``.ipynb`` with its outputs, so the plots show
where the repository is browsed. It also copies the picture docs/teaching-notebooks.md shows out of notebook 03::

    python notebooks/build.py            # all notebooks      (make notebooks)
    python notebooks/build.py 03 05      # those whose names start with 03 or 05
    python notebooks/build.py --check    # only check every .ipynb has its .py's cells

``tests/test_notebooks.py`` uses the same functions to execute every notebook and to
check that the committed ``.ipynb`` files are in sync with their sources.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOKS = sorted(HERE.glob("[0-9][0-9]_*.py"))
KERNEL_NAME = "zerofn-notebooks"
# The cell of notebook 03 whose picture docs/teaching-notebooks.md shows, and where it goes.
README_FIGURE_TAG = "readme-figure"
README_FIGURE = HERE / "img" / "03_loss_and_memory.png"
CELL_TIMEOUT_S = 600
# The display metadata an executed notebook carries (what a notebook viewer reads).
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}

# jupyter_core warns (DeprecationWarning) unless told to use the platformdirs locations.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")


def read_source(py: Path):  # -> nbformat.NotebookNode
    """The notebook that ``py`` describes, without outputs."""
    import jupytext

    nb = jupytext.read(py, fmt="py:percent")
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    # Cell ids from the cell's content (nbformat would draw random ones): a rebuild of an
    # unchanged notebook rewrites an identical file, and an edit changes only its cell's id.
    seen: set[str] = set()
    for cell in nb.cells:
        digest = hashlib.sha1(f"{cell.cell_type}:{cell.source}".encode()).hexdigest()
        cell_id = digest[:8]
        while cell_id in seen:
            digest = hashlib.sha1(digest.encode()).hexdigest()
            cell_id = digest[:8]
        seen.add(cell_id)
        cell["id"] = cell_id
    return nb


def cells_of(nb) -> list[tuple[str, str]]:
    """``(cell_type, source)`` of every cell: what must agree between a ``.py`` and its ``.ipynb``."""
    return [(c.cell_type, c.source) for c in nb.cells]


@contextlib.contextmanager
def kernel_manager() -> Iterator[object]:
    """An ``AsyncKernelManager`` for a kernel that runs ``sys.executable`` (this interpreter)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    with tempfile.TemporaryDirectory(prefix="zerofn-kernel-") as tmp:
        spec_dir = Path(tmp) / KERNEL_NAME
        spec_dir.mkdir()
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"zerofn ({sys.executable})",
            "language": "python",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        ksm = KernelSpecManager(kernel_dirs=[tmp], ensure_native_kernel=False)
        # The connection file and IPC sockets live in the temporary folder too: nothing is
        # written to Jupyter's runtime directory, the sockets are local only, and the kernel
        # does not warn about "running over TCP without encryption".
        yield AsyncKernelManager(
            kernel_name=KERNEL_NAME,
            kernel_spec_manager=ksm,
            connection_file=str(Path(tmp) / "connection.json"),
            transport="ipc",
            ip=str(Path(tmp) / "kernel"),
        )


def execute(nb, *, cell_timeout: int = CELL_TIMEOUT_S, km=None) -> None:
    """Run ``nb`` in place in a fresh kernel of this interpreter, cwd = this folder.

    With ``km`` (from :func:`shared_kernel`), in that manager's kernel instead, started by
    the first notebook that runs in it and left running for the next one.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first cell that fails.
    """
    if km is None:
        with kernel_manager() as own:
            _execute(nb, own, cell_timeout, shut_down=True)  # we made the manager: shut the kernel down after
    else:
        _execute(nb, km, cell_timeout, shut_down=False)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)


def _execute(nb, km, cell_timeout: int, *, shut_down: bool) -> None:
    from nbclient import NotebookClient

    client = NotebookClient(
        nb,
        km=km,
        timeout=cell_timeout,
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    )
    # Inline PNGs whatever MPLBACKEND the caller has set (e.g. Agg would drop every plot).
    env = {**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    try:
        client.execute(cleanup_kc=shut_down, env=env)
    finally:
        if not shut_down and client.kc is not None:
            client.kc.stop_channels()  # this notebook's client; the kernel stays up


@contextlib.contextmanager
def shared_kernel() -> Iterator[object]:
    """A kernel manager for running several notebooks in turn in one kernel: ``execute(nb, km=km)``.

    ``tests/test_notebooks.py`` uses it to pay the kernel's start-up and its imports (torch,
    matplotlib, zerofn) once, not once per notebook; it clears the namespace (``%reset -f``)
    before each notebook. ``build`` always runs each notebook in a fresh kernel.
    """
    from jupyter_core.utils import run_sync

    with kernel_manager() as km:
        try:
            yield km
        finally:
            if run_sync(km.is_alive)():
                run_sync(km.shutdown_kernel)()
            run_sync(km.cleanup_resources)()


def readme_figure(nb) -> bytes | None:
    """The PNG of the cell tagged ``readme-figure``; None if no cell has the tag."""
    for cell in nb.cells:
        if README_FIGURE_TAG in cell.get("metadata", {}).get("tags", []):
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png:
                    return base64.b64decode(png)
            raise RuntimeError(f"the cell tagged {README_FIGURE_TAG!r} drew no PNG")
    return None


def build(py: Path) -> float:
    """Execute ``py``'s notebook and write ``py.with_suffix('.ipynb')``; returns seconds taken."""
    import nbformat

    nb = read_source(py)
    start = time.perf_counter()
    execute(nb)
    took = time.perf_counter() - start
    nbformat.write(nb, py.with_suffix(".ipynb"))
    png = readme_figure(nb)
    if png is not None:
        README_FIGURE.parent.mkdir(exist_ok=True)
        README_FIGURE.write_bytes(png)
    return took


def out_of_sync(py: Path) -> str | None:
    """Why ``py``'s committed ``.ipynb`` does not match it, or None when it does."""
    import nbformat

    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
        return f"{ipynb.name} is missing"
    want, have = cells_of(read_source(py)), cells_of(nbformat.read(ipynb, as_version=4))
    if want == have:
        return None
    for i, ((w_type, w_src), (h_type, h_src)) in enumerate(zip(want, have, strict=False)):
        if w_type != h_type:
            return f"{ipynb.name}: cell {i} is a {h_type} cell, in {py.name} a {w_type} cell"
        if w_src != h_src:
            w_lines, h_lines = [*w_src.splitlines(), "<end>"], [*h_src.splitlines(), "<end>"]
            j = next(j for j, (a, b) in enumerate(zip(w_lines, h_lines, strict=False)) if a != b)
            return f"{ipynb.name}: cell {i} line {j + 1} is {h_lines[j]!r}, in {py.name} {w_lines[j]!r}"
    return f"{ipynb.name} has {len(have)} cells, {py.name} {len(want)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="name prefixes, e.g. 03 (default: all)")
    parser.add_argument("--check", action="store_true", help="only check that the .ipynb files are in sync")
    args = parser.parse_args(argv)
    chosen = [p for p in NOTEBOOKS if not args.only or any(p.name.startswith(o) for o in args.only)]
    if not chosen:
        parser.error(f"no notebook matches {args.only}")
    if args.check:
        problems = [msg for p in chosen if (msg := out_of_sync(p))]
        for msg in problems:
            print(msg, "(run: python notebooks/build.py)")
        return 1 if problems else 0
    for py in chosen:
        took = build(py)
        size = py.with_suffix(".ipynb").stat().st_size
        print(f"{py.with_suffix('.ipynb').name}: executed in {took:.1f} s, {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
