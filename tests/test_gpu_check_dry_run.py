"""The prepared GPU check stays runnable: its script's compiled-step part passes when dry-run on the CPU.

``tests/gpu``'s test bodies themselves dry-run in the suite's own session on a machine
without CUDA (``ZEROFN_GPU_CHECK_DEVICE=cpu``, set by tests/conftest.py); what only
``scripts/gpu-check`` does, its ``jit`` part, runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
