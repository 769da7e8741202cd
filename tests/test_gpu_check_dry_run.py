"""The prepared GPU check stays runnable: its test bodies pass when dry-run on the CPU.

``tests/gpu`` is skipped without CUDA (this suite's machines have none), so on its own it
would rot silently as zerofn changes. Here the same tests run in a subprocess with
``ZEROFN_GPU_CHECK_DEVICE=cpu``: gloo on the CPU in place of NCCL and of the shared GPU.
Only the checks that mean something on CUDA alone (the stream sanitizer, pinned host
memory) are skipped there, each with its reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "ZEROFN_GPU_CHECK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed(?:, (\d+) skipped)?", proc.stdout)
    assert summary is not None, tail
    passed, skipped = int(summary.group(1)), int(summary.group(2) or 0)
    assert passed >= 30, tail  # every device-parametric body ran
    # What stays skipped on the CPU is only what needs CUDA itself, and says so.
    reasons = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", proc.stdout)
    assert len(reasons) == skipped, tail
    assert all("CUDA" in r or "cuda" in r for r in reasons), reasons


def test_gpu_check_dry_run_compiles_the_functional_step(tmp_path):
    # The ``jit`` part: the step compiled on one gloo rank in place of NCCL, bitwise eager
    # in one graph; CUDA graphs (mode="reduce-overhead") recorded as skipped, not failed.
    proc = subprocess.run(
        [sys.executable, "scripts/gpu-check", "--dry-run", str(tmp_path), "--parts", "jit"],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (tmp_path / "jit.log").read_text() if (tmp_path / "jit.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log[-3000:]
    (part,) = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert (part["part"], part["status"]) == ("jit", "passed")
    nccl1 = json.loads((tmp_path / "jit.json").read_text())["nccl1"]
    compiled = nccl1["backends"]["aot_eager"]
    assert compiled["status"] == "ok" and compiled["bitwise"] and compiled["graphs"] == 1, compiled
    assert nccl1["backends"]["reduce-overhead"]["status"].startswith("skipped: CUDA graphs need CUDA")
    assert "JIT nccl1 aot_eager: ok, bitwise=True" in log
