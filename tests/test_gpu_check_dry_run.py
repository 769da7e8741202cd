"""The prepared GPU check stays runnable: its test bodies pass when dry-run on the CPU.

``tests/gpu`` is skipped without CUDA (this suite's machines have none), so on its own it
would rot silently as zerofn changes. Here the same tests run in a subprocess with
``ZEROFN_GPU_CHECK_DEVICE=cpu``: gloo on the CPU in place of NCCL and of the shared GPU.
Only the checks that mean something on CUDA alone (the stream sanitizer, pinned host
memory) are skipped there, each with its reason.
"""

from __future__ import annotations

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
