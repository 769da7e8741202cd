"""MkDocs hooks for zerofn's site (mkdocs.yml ``hooks:``): what lives outside ``docs/``.

* ``on_files`` adds the executed notebooks (``notebooks/NN_*.ipynb``, rendered with their
  outputs by mkdocs-jupyter), their pictures (``notebooks/img/``) and the benchmark plots
  (``benchmarks/results/*.png``) to the site, at the same paths as in the repository, so
  a page links them as ``notebooks/01_sharding.ipynb`` or ``benchmarks/results/x.png``.
* ``on_page_markdown`` replaces a line ``<!-- include: PATH -->`` with the Markdown file
  at ``PATH`` (relative to the repository root; its title dropped, its headings one level
  down), so the benchmarks page shows the recorded tables and their write-up themselves,
  never a copy that could drift. A missing file fails the build.
* ``on_page_markdown`` also replaces ``<!-- benchmarks-summary: PATH.json -->`` with the
  table that ``benchmarks.page.summary`` makes of that results file: the benchmarks page's
  answer is generated from one run (``python -m benchmarks.run --out benchmarks/results/latest``);
  ``<!-- benchmarks-compiled: PATH.json -->`` (the jit page) with ``benchmarks.page.compiled``'s
  tables of the compiled steps from the same file.
* ``on_page_markdown`` replaces ``<!-- count: WHAT -->`` with a number counted from the
  repository when the site is built (``notebooks``: the executed notebooks), so a page
  never states a count that has drifted.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
_INCLUDE = re.compile(r"^<!-- include: (?P<path>[\w./-]+\.md) -->$", re.MULTILINE)
_SUMMARY = re.compile(r"^<!-- benchmarks-(?P<what>summary|compiled): (?P<path>[\w./-]+\.json) -->$", re.MULTILINE)
_COUNT = re.compile(r"<!-- count: (?P<what>[\w-]+) -->")
_NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def count(what: str) -> int:
    """What a page may count: ``notebooks`` (the executed teaching notebooks)."""
    if what == "notebooks":
        return len(sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")))
    raise ValueError(f"docs: <!-- count: {what} --> counts nothing this hook knows (notebooks)")


def _count_words(m: re.Match[str]) -> str:
    n = count(m.group("what"))
    return _NUMBERS[n] if n < len(_NUMBERS) else str(n)


def _summary(what: str, relative: str) -> str:
    path = ROOT / relative
    if not path.is_file():
        raise FileNotFoundError(f"docs: <!-- benchmarks-{what}: {relative} --> names {path}, which does not exist")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import page

    make = page.summary if what == "summary" else page.compiled
    return make(json.loads(path.read_text(encoding="utf-8")))


# Repository files the site serves beside docs/: (folder, glob).
EXTRA_FILES = (
    ("notebooks", "[0-9][0-9]_*.ipynb"),
    ("notebooks/img", "*.png"),
    ("benchmarks/results", "*.png"),
)


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config: Any) -> Files:
    for folder, pattern in EXTRA_FILES:
        for path in sorted((ROOT / folder).glob(pattern)):
            files.append(
                File(
                    path.relative_to(ROOT).as_posix(),
                    src_dir=str(ROOT),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def _included(relative: str) -> str:
    path = ROOT / relative
    if not path.is_file():
        raise FileNotFoundError(f"docs: <!-- include: {relative} --> names {path}, which does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]  # the file's own title; the page has one
    out, fenced = [], False
    for line in lines:
        fenced ^= line.startswith("```")
        out.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    markdown = _INCLUDE.sub(lambda m: _included(m.group("path")), markdown)
    markdown = _SUMMARY.sub(lambda m: _summary(m.group("what"), m.group("path")), markdown)
    return _COUNT.sub(_count_words, markdown)
