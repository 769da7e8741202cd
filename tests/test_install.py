"""Installing zerofn into an environment that already has its torch, as Getting started says.

The check a user runs after ``pip install zerofn[...]`` into their own project, done for
them on a wheel built from this repository:

1. build the wheel (``pip wheel --no-deps``) from a copy of the package's files;
2. make a fresh virtualenv that already has the pinned torch of this environment (its
   files linked in, not downloaded again, so the check takes seconds);
3. ``pip install zerofn-*.whl[test,docs,lowbit,data,lightning,hf]`` into it: the extras that
   come from the package index alone (``bench`` builds DeepSpeed from source: left out);
4. from a folder outside the repository, run ``python -m zerofn demo --steps 5`` and one
   test that asks for the ``zerofn_world`` fixture of the pytest plugin;
5. torch is the same afterwards: version, file and installed record, so pip kept it.

Nothing is imported from the checkout: the commands run in an empty folder with the new
environment's interpreter, and the test asserts that zerofn comes from its site-packages.
Marked ``install``: it needs the package index (``pytest -m "not install"`` leaves it out).
"""

from __future__ import annotations

import email
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "test,docs,lowbit,data,lightning,hf"  # every extra but bench (DeepSpeed builds from its sdist)

pytestmark = pytest.mark.install

PLUGIN_TEST = """
import torch
import torch.distributed as dist


def total_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_world_size(), t.item()


def test_ranks_add_up(zerofn_world):
    assert zerofn_world(2).run(total_of_ranks) == [(2, 1.0)] * 2
"""

# The last line: whether importing zerofn imported dynamo too (it should not: the first
# compiled step does, and a rank that never compiles saves over a second of its start).
PROBE = (
    "import sys, torch, zerofn; print(torch.__version__); print(torch.__file__); print(zerofn.__file__); "
    "print('torch._dynamo' in sys.modules)"
)


def _requirements(specs: list[str], extras: tuple[str, ...] = ("",)) -> list[str]:
    """The names among ``specs`` (Requires-Dist lines) that ``extras`` need on this interpreter."""
    from packaging.requirements import Requirement

    names = []
    for spec in specs:
        req = Requirement(spec)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
            names.append(req.name)
    return names


def _link_distribution(name: str, site: Path, done: set[str]) -> None:
    """Hard-link (or copy) an installed distribution and what it requires into ``site``."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in done:
        return
    done.add(key)
    dist = md.distribution(name)
    for f in dist.files or []:
        src = Path(dist.locate_file(f))
        if ".." in f.parts or not src.is_file():
            continue  # console scripts live in bin/ (the new environment has its own)
        pairs = [(src, site / f)]
        if src.suffix == ".py":  # and its bytecode, so the first import does not compile torch again
            cached = Path(importlib.util.cache_from_source(str(src)))
            if cached.is_file():
                pairs.append((cached, site / f.parent / "__pycache__" / cached.name))
        for a, b in pairs:
            if b.exists():  # a RECORD that lists the bytecode too
                continue
            b.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)
    for req in _requirements(dist.requires or []):
        _link_distribution(req, site, done)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_wheel_installs_with_its_extras_beside_torch_and_runs_the_demo_and_the_plugin(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    outside = tmp_path / "project"  # the user's own project: no zerofn sources anywhere near
    outside.mkdir()

    # 1. the wheel, built from a copy of what the package ships (the checkout stays clean)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "zerofn", src / "zerofn", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        outside,
        env,
    )
    (wheel,) = wheels.glob("zerofn-*.whl")

    # 2. a fresh virtualenv that already has torch, like the user's project. Its torch and
    # the extras' dependencies are this environment's, linked in (pip would download the
    # same wheels again for a minute); pip still resolves every requirement against them.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], outside, env)
    py = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(py), "-c", purelib], outside, env).strip())
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = (n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(zf.read(meta))
    done: set[str] = set()
    for name in ["torch", *_requirements(metadata.get_all("Requires-Dist") or [], tuple(EXTRAS.split(",")))]:
        _link_distribution(name, site, done)
    record = site / f"torch-{md.version('torch')}.dist-info" / "RECORD"
    record_before = record.stat()

    # 3. the user's install command (this environment's pip, acting on the new one)
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    _run([*pip, "install", "--no-compile", f"{wheel}[{EXTRAS}]"], outside, env, timeout=600)

    # 4. the three-line check, from the user's folder
    probe = _run([str(py), "-c", PROBE], outside, env).splitlines()
    expected = [md.version("torch"), str(site / "torch" / "__init__.py")]
    assert probe[:2] == expected, f"torch changed: {expected} -> {probe[:2]}"
    assert Path(probe[2]).is_relative_to(site), f"zerofn imported from {probe[2]}, not from the new environment"
    assert probe[3] == "False", "import zerofn imported torch._dynamo"
    demo = _run([str(py), "-m", "zerofn", "demo", "--steps", "5", "--no-progress"], outside, env)
    assert "bitwise equal" in demo, demo
    (outside / "test_ranks.py").write_text(textwrap.dedent(PLUGIN_TEST))
    result = _run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_ranks.py"], outside, env)
    assert re.search(r"\b1 passed\b", result), result

    # 5. pip kept the torch it found: the same record file, untouched
    after = record.stat()
    same = (after.st_ino, after.st_mtime_ns) == (record_before.st_ino, record_before.st_mtime_ns)
    assert same, "pip reinstalled torch"
