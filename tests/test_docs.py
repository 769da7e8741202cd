"""The documentation site: it builds strictly, it documents every public name and every error, and its code runs.

* ``mkdocs build --strict`` (what ``make docs`` runs): a broken link or anchor, a page
  missing from the nav, a reference that does not resolve or a docstring that does not
  render fails it. The built pages name no issue of the project's tracker (the word followed by a number),
  and the counts they state (how many notebooks) are the repository's.
* Every name in ``zerofn.__all__`` and in each public module's ``__all__`` has an entry
  (a ``::: path`` directive) in the API reference, and every exception class zerofn
  defines has a section on the errors page.
* Every ```` ```python ```` block of the guides (``docs/*.md``) and of the README runs:
  a script on two real gloo ranks (the scripts of one page in order, as one script), a
  test module (a block that defines ``test_`` functions) under pytest with zerofn's
  plugin. Blocks whose first line says ``# not run: <why>`` (several machines, GPUs) are
  the exception, and there are few of them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import types
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from conftest import get_world

import zerofn

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)
NOT_RUN = "# not run:"
# Pages whose scripts the tests at the end of this file run, checking what they leave.
CHECKED_PAGES = ("checkpoints.md", "facade.md", "functional-loop.md")
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    """Every ```` ```python ```` block of a Markdown text, in order."""
    return FENCE.findall(text)


def is_test_module(block: str) -> bool:
    """A block that defines pytest tests (run by pytest), not a script (run on ranks)."""
    return re.search(r"^def test_", block, re.MULTILINE) is not None


def scripts(page: Path) -> list[str]:
    """The page's blocks that run on ranks, in order."""
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    return [b for b in blocks if not b.startswith(NOT_RUN) and not is_test_module(b)]


def module_blocks(page: Path) -> list[str]:
    return [b for b in python_blocks(page.read_text(encoding="utf-8")) if is_test_module(b)]


GUIDES = sorted(p for p in DOCS.glob("*.md") if python_blocks(p.read_text(encoding="utf-8")))
RANK_GUIDES = [p for p in GUIDES if scripts(p) and p.name not in CHECKED_PAGES]


# --------------------------------------------------------------------------- the build


def test_the_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "errors/index.html", "api/stages/index.html", "notebooks/01_sharding/index.html"):
        assert (site / page).is_file(), page
    # The notebooks are rendered with their outputs (the committed .ipynb carry pictures).
    assert "data:image/png;base64" in (site / "notebooks/03_training_loop/index.html").read_text(encoding="utf-8")
    # The reference is rendered from the docstrings, and reStructuredText roles do not leak.
    reference = (site / "api/stages/index.html").read_text(encoding="utf-8")
    assert "zerofn.stages.reduce_grads" in reference and ":class:" not in reference
    assert ".. math::" not in (site / "api/optim/index.html").read_text(encoding="utf-8")
    pages = {p.relative_to(site).as_posix(): _visible_text(p) for p in sorted(site.rglob("*.html"))}
    # The site speaks to users about zerofn: no page names an issue of the project's tracker.
    hits = [f"{name}: ...{m.group(0)}..." for name, text in pages.items() for m in _ISSUE.finditer(text)]
    assert not hits, "pages that name an issue:\n" + "\n".join(hits)
    # Counts a page states are the repository's: "eight notebooks" while there are eight.
    stated = [(name, m.group(0)) for name, text in pages.items() for m in _NOTEBOOK_COUNT.finditer(text)]
    assert stated, "no page states how many notebooks there are: the check below checks nothing"
    wrong = [f"{name}: {said!r}" for name, said in stated if _number(said.split()[0]) != NOTEBOOKS]
    assert not wrong, f"there are {NOTEBOOKS} notebooks, but:\n" + "\n".join(wrong)


_ISSUE = re.compile(r".{0,40}\bissues?[\s-]+#?\d+.{0,40}", re.IGNORECASE)
_NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
_NOTEBOOK_COUNT = re.compile(
    r"\b(?:\d+|" + "|".join(_NUMBER_WORDS) + r")\s+(?:teaching\s+)?(?:notebooks|lectures)\b", re.IGNORECASE
)
NOTEBOOKS = len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.py")))


def _number(word: str) -> int:
    return int(word) if word.isdigit() else _NUMBER_WORDS.index(word.lower())


def _visible_text(page: Path) -> str:
    """A built page's text as a reader sees it: no tags, no scripts, whitespace collapsed."""
    html = page.read_text(encoding="utf-8")
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.DOTALL | re.IGNORECASE)
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


def test_the_readme_states_the_notebook_count_of_the_repository() -> None:
    stated = _NOTEBOOK_COUNT.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert stated and all(_number(s.split()[0]) == NOTEBOOKS for s in stated), (stated, NOTEBOOKS)


def test_the_benchmarks_page_states_the_command_of_the_run_it_shows() -> None:
    """The "Reproduce" command of docs/benchmarks.md is the one ``latest.json`` records:
    the same systems, world sizes, timeout and note."""
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    block = re.search(r'^SYSTEMS="(?P<systems>.*?)"\nmake benchmarks ARGS="(?P<args>[^"]*)"$', text, re.M | re.S)
    assert block, "docs/benchmarks.md: no SYSTEMS=... make benchmarks ARGS=... block"
    recorded = json.loads((ROOT / "benchmarks/results/latest.json").read_text(encoding="utf-8"))["meta"]
    systems = block.group("systems").replace("\\\n", " ").split()
    assert systems == recorded["args"]["systems"]
    args = block.group("args").replace("\\\n", " ").replace("$SYSTEMS", " ".join(systems))
    assert shlex.split(args) == recorded["argv"][2:], (args, recorded["argv"])


# --------------------------------------------------------------------------- API reference coverage


def public_modules() -> list[types.ModuleType]:
    """``zerofn`` and every module under it with no ``_``-prefixed part."""
    names = ["zerofn"] + [
        m.name
        for m in pkgutil.walk_packages(zerofn.__path__, "zerofn.")
        if not any(part.startswith("_") for part in m.name.split(".")[1:])
    ]
    return [importlib.import_module(name) for name in names]


def _resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def reference_entries() -> dict[str, Any]:
    """Every ``::: path`` directive of the API reference: path -> the object it documents."""
    entries = {}
    for page in sorted(API.glob("*.md")):
        for path in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            entries[path] = _resolve(path)
    return entries


def _covered(module: str, name: str, obj: Any, entries: dict[str, Any], objects: list[Any]) -> bool:
    if f"{module}.{name}" in entries:
        return True
    # A module, class or function documented under another public path is the same entry;
    # a plain value (a constant) is only covered by its own path.
    documented_elsewhere = isinstance(obj, types.ModuleType) or inspect.isclass(obj) or callable(obj)
    return documented_elsewhere and any(obj is o for o in objects)


def test_every_public_name_has_a_reference_entry() -> None:
    entries = reference_entries()
    objects = list(entries.values())
    names = [(m.__name__, n) for m in public_modules() for n in m.__all__]
    missing = [f"{m}.{n}" for m, n in names if not _covered(m, n, getattr(sys.modules[m], n), entries, objects)]
    assert not missing, f"public names without an entry in docs/api/*.md (add a `::: path` line): {missing}"
    # The count the closing note reports; it grows with the surface.
    assert len(names) >= 150, len(names)


def test_every_exception_zerofn_defines_has_a_section_on_the_errors_page() -> None:
    for info in pkgutil.walk_packages(zerofn.__path__, "zerofn."):  # every module, private ones too
        importlib.import_module(info.name)
    errors = {
        obj.__name__
        for name, module in list(sys.modules.items())
        if name.startswith("zerofn")
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("zerofn")
    }
    assert {"CheckpointError", "RankMismatchError", "ParamsChangedError", "ShardedGradError"} <= errors
    text = (DOCS / "errors.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## `(\w+)`", text, re.MULTILINE))
    assert errors <= headings, f"exceptions with no section on docs/errors.md: {sorted(errors - headings)}"


# --------------------------------------------------------------------------- code in the guides


def _exec_page(code: str, name: str, where: str) -> list[str]:
    """Run a page's blocks as one script in ``where`` on this rank; the names it left defined."""
    old = os.getcwd()
    os.chdir(where)  # pages write to relative paths; every rank in the same folder
    try:
        scope: dict[str, Any] = {"__name__": "docs"}
        exec(compile(code, f"docs/{name}", "exec"), scope)
        return sorted(k for k in scope if not k.startswith("__"))
    finally:
        os.chdir(old)


def test_there_are_guides_with_code_and_few_blocks_are_left_unrun() -> None:
    assert {p.name for p in GUIDES} >= {"functional-loop.md", "facade.md", "checkpoints.md", "testing.md"}
    assert set(CHECKED_PAGES) <= {p.name for p in GUIDES if scripts(p)}
    not_run = [b for p in GUIDES for b in python_blocks(p.read_text(encoding="utf-8")) if b.startswith(NOT_RUN)]
    for block in not_run:
        assert len(block.splitlines()[0]) > len(NOT_RUN) + 10, f"say why a block is not run: {block[:80]!r}"
    assert len(not_run) <= 3, len(not_run)


@pytest.mark.parametrize("page", RANK_GUIDES, ids=lambda p: p.stem)
def test_the_scripts_of_a_guide_run_on_two_ranks(page: Path, tmp_path: Path) -> None:
    defined = get_world(2).run(_exec_page, "\n".join(scripts(page)), page.name, str(tmp_path))
    assert defined[0] == defined[1]


def test_the_test_modules_in_the_docs_and_the_readme_pass_under_pytest(pytester: pytest.Pytester) -> None:
    blocks = {
        f"test_{page.stem.replace('-', '_').lower()}_{i}": block
        for page in [README, *GUIDES]
        for i, block in enumerate(module_blocks(page))
    }
    assert {name.rsplit("_", 1)[0] for name in blocks} >= {"test_testing", "test_readme"}
    pytester.makepyfile(**blocks)
    # In this process: the tests get this session's pools through the plugin, as a user's would.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    tests = sum(len(re.findall(r"^def test_", block, re.MULTILINE)) for block in blocks.values())
    result.assert_outcomes(passed=tests)


# --------------------------------------------------------------------------- what the loops leave


def _exec_loop(code: str) -> tuple[float, int, dict[str, list[float]]]:
    """Run a functional loop on this rank; what it ends with, to compare across ranks."""
    scope: dict[str, object] = {"__name__": "docs"}
    exec(code, scope)
    info, state, params = scope["info"], scope["state"], scope["params"]
    return info.grad_norm, state.step, {k: v.reshape(-1).tolist() for k, v in params.items()}  # type: ignore[attr-defined]


def test_the_functional_loop_leaves_the_same_params_on_every_rank() -> None:
    code = "\n".join(scripts(DOCS / "functional-loop.md"))
    results = get_world(2).run(_exec_loop, code)
    assert results[0] == results[1]  # params identical on every rank after gather_params
    assert results[0][1] == 20


def _exec_facade(code: str) -> dict[str, Any]:
    """Run the facade loop on this rank; what it ends with."""
    scope: dict[str, Any] = {"__name__": "docs"}
    exec(code, scope)
    model, optimizer = scope["model"], scope["optimizer"]
    return {
        "step": optimizer.state.step,
        "params": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()},
        "first_grad": tuple(scope["first_grad"].shape),
        "lr": optimizer.param_groups[0]["lr"],
        "grads_freed": all(p.grad is None for p in model.parameters()),
    }


def test_the_facade_loop_steps_schedules_and_gathers_alike_on_every_rank() -> None:
    code = "\n".join(scripts(DOCS / "facade.md"))
    assert "ZeroOptimizer(" in code and "no_sync()" in code and "get_param_grad" in code
    results = get_world(2).run(_exec_facade, code)
    assert results[0] == results[1]  # the same weights on every rank after step()
    r = results[0]
    assert r["step"] == 20
    assert r["first_grad"] == (32, 16)  # the full gradient of model[0].weight, gathered
    assert r["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine schedule ran its 20 steps
    assert r["grads_freed"]


def _exec_checkpoints(code: str, where: str) -> dict[str, Any]:
    """Run the checkpoints page in ``where``; what it leaves."""
    old = os.getcwd()
    os.chdir(where)
    try:
        scope: dict[str, Any] = {"__name__": "docs"}
        exec(code, scope)
        folder = Path("checkpoints")
        return {
            "step": scope["state"].step,
            "facade_step": scope["optimizer"].state.step,
            "plain_step": float(scope["plain"].state_dict()["state"][0]["step"]),
            "links": sorted(p.name for p in folder.iterdir() if p.is_symlink()),
            "background": scope["committed"] == os.path.realpath("checkpoints/background"),
            "params": {n: p.reshape(-1).tolist() for n, p in scope["params"].items()},
        }
    finally:
        os.chdir(old)


def test_the_checkpoints_page_saves_loads_and_round_trips_through_torch(tmp_path: Path) -> None:
    code = "\n".join(scripts(DOCS / "checkpoints.md"))
    results = get_world(2).run(_exec_checkpoints, code, str(tmp_path))
    assert results[0] == results[1]
    r = results[0]
    assert (r["step"], r["facade_step"], r["plain_step"]) == (5, 8, 5.0)  # the facade trains on after its async save
    assert r["links"] == ["background", "facade", "functional"]  # each path is a symlink to its last save
    assert r["background"]  # wait() returned the directory the path points at


def _exec_readme(code: str) -> dict[str, Any]:
    """Run the README's loops on this rank; what they leave."""
    scope: dict[str, Any] = {"__name__": "readme"}
    exec(code, scope)
    return {
        "step": scope["state"].step,
        "facade_step": scope["optimizer"].state.step,
        "params": {n: p.reshape(-1).tolist() for n, p in scope["params"].items()},
        "model": {n: p.detach().reshape(-1).tolist() for n, p in scope["model"].named_parameters()},
    }


def test_the_readme_loops_run_and_leave_the_same_weights_on_every_rank() -> None:
    loops = scripts(README)
    assert len(loops) == 2 and len(loops[0].strip().splitlines()) <= 20  # the front door's 20-line loop
    results = get_world(2).run(_exec_readme, "\n".join(loops))
    assert results[0] == results[1]
    assert (results[0]["step"], results[0]["facade_step"]) == (20, 20)


def test_the_readme_links_into_the_site_and_every_link_resolves() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert "docs/index.md" in local and "docs/testing.md" in local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200  # the front door, not the manual
