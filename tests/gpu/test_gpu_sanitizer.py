"""Overlap on CUDA streams under torch's stream sanitizer: no race, and a planted one is caught.

The family of bug behind NaNs that show up only in ZeRO-2 (a gradient reduced, or a
staging buffer reused, before the stream that writes it has finished) is what torch's
CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``) reports. ``tests/gpu/sanitized_run.py`` runs
the overlapped configurations in fresh rank processes with the sanitizer on (it must be
enabled before any CUDA work, hence a subprocess with the variable set), and a negative
control: the same reduction launched on a side stream without waiting for the backward's
stream, which the sanitizer must report, so this check can fail. Its twin with the waits
must be clean, so a report means a missing wait and nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpucheck import needs_cuda, requires_device

pytestmark = [requires_device, needs_cuda("the CUDA stream sanitizer")]

SCRIPT = Path(__file__).resolve().with_name("sanitized_run.py")
CLEAN = "clean (sanitizer enabled on ranks "


def _sanitized(*cases: str) -> tuple[dict[str, str], str]:
    """Run ``cases`` under the sanitizer; ``({case: outcome line}, stderr)``."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", *cases],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, f"sanitized_run.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}"
    outcomes = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            name, _, outcome = line.removeprefix("CASE ").partition(": ")
            outcomes[name] = outcome
    assert sorted(outcomes) == sorted(cases), proc.stdout
    return outcomes, proc.stderr


def test_overlapped_training_on_cuda_streams_reports_no_race():
    outcomes, stderr = _sanitized("facade-nccl1", "facade-shared2")
    assert outcomes["facade-nccl1"] == CLEAN + "[True])", stderr[-6000:]
    assert outcomes["facade-shared2"] == CLEAN + "[True, True])", stderr[-6000:]


def test_the_sanitizer_reports_a_missing_wait_and_not_its_fixed_twin():
    outcomes, stderr = _sanitized("control-missing-wait", "control-with-wait")
    assert outcomes["control-missing-wait"].startswith("reported CUDASanitizerErrors"), outcomes
    assert "CSAN detected a possible data race" in stderr
    assert outcomes["control-with-wait"] == CLEAN + "[True])", stderr[-6000:]
