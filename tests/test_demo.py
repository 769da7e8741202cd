"""The demo (``python -m zerofn demo``): end to end, its report, and its option errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerofn import demo
from zerofn.__main__ import main
from zerofn.testing import World

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m zerofn *args`` in a child process, outside any torchrun environment."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run(
        [sys.executable, "-m", "zerofn", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _figure(pattern: str, text: str) -> float:
    """The number ``pattern``'s group 1 captures in ``text`` (thousands commas allowed)."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the demo's output:\n{text}"
    return float(match.group(1).replace(",", ""))


def test_demo_runs_end_to_end_and_matches_ddp() -> None:
    proc = _run_cli("demo", "--steps", "5", "--world-size", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ZeRO stage 2, 2 gloo rank(s), fp32, 5 steps" in out
    assert "Traceback" not in proc.stderr
    assert "5/5" in proc.stderr  # the progress bar reached the end
    loss_start = _figure(r"loss\s+([\d.]+) ->", out)
    loss_end = _figure(r"loss\s+[\d.]+ -> ([\d.]+)", out)
    assert loss_end < loss_start
    assert _figure(r"max rel diff ([\d.e+-]+)", out) < 1e-6
    state = _figure(r"optimizer state\s+([\d,]+) B per rank", out)
    unsharded = _figure(r"vs ([\d,]+) B unsharded", out)
    assert state == pytest.approx(unsharded / 2, rel=1e-3)  # even split: half per rank
    sent = _figure(r"bytes sent\s+([\d,]+) B per rank per step", out)
    theory = _figure(r"2\(N-1\)/N·Ψ·b = ([\d,]+) B", out)
    assert theory == 2 * (2 - 1) / 2 * 22_026 * 4
    assert theory <= sent <= 1.5 * theory * 1.01  # gloo trades 1.5x the bytes for speed
    assert re.search(r"time per step\s+zerofn [\d.]+ ms, DDP [\d.]+ ms", out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "bf16"], "--precision bf16 is not available yet"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--stage", "3"], "invalid choice"),
        (["--max-norm", "-1"], "--max-norm must be a positive finite number"),
        (["--steps", "many"], "invalid int value"),
        (["--no-such-option"], "unrecognized arguments"),
    ],
)
def test_bad_options_exit_2_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: zerofn" in err


@pytest.mark.parametrize("args", [["demo", "--precision", "fp16"], []])
def test_bad_options_in_a_real_process_print_no_traceback(args: list[str]) -> None:
    proc = _run_cli(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr
    assert proc.stdout == ""


def test_torchrun_environment_without_master_addr_is_an_option_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", "1"])
    assert exc.value.code == 2
    assert "MASTER_ADDR is not" in capsys.readouterr().err


def test_world_size_that_disagrees_with_torchrun_is_an_option_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--world-size", "3"])
    assert exc.value.code == 2
    assert "disagrees with torchrun's WORLD_SIZE=2" in capsys.readouterr().err


def test_run_returns_the_report_at_world_size_3(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    cfg = demo.DemoConfig(world_size=3, steps=5, comm="byte-optimal", progress=False)
    r = demo.run(cfg)
    assert (r["world_size"], r["stage"], r["steps"], r["precision"]) == (3, 2, 5, "fp32")
    assert (r["reduce"], r["gather"]) == ("reduce_scatter", "all_gather")
    assert r["num_params"] == 22_026
    assert r["max_rel_diff"] < 1e-6
    assert r["max_abs_diff"] < 1e-6
    assert r["loss_end"] < r["loss_start"]
    assert r["loss_start"] == pytest.approx(r["ddp_loss_start"], rel=1e-6)
    assert r["loss_end"] == pytest.approx(r["ddp_loss_end"], rel=1e-5)
    # Each rank holds a third of master + moments (plus a little padding).
    assert r["state_bytes_per_rank"] == pytest.approx(r["unsharded_bytes"] / 3, rel=1e-2)
    # Byte-optimal: reduce-scatter + all-gather send 2(N-1)/N·Ψ·b, plus padding and a few
    # scalars (rank agreement, the global norm).
    assert r["theory_bytes_per_step"] == pytest.approx(2 * 2 / 3 * 22_026 * 4)
    assert r["theory_bytes_per_step"] <= r["bytes_sent_per_step"]
    assert r["bytes_sent_per_step"] == pytest.approx(r["theory_bytes_per_step"], rel=1e-2)
    assert set(r["bytes_by_collective"]) >= {"reduce_scatter", "all_gather"}
    assert r["ms_per_step"] > 0 and r["ddp_ms_per_step"] > 0
    assert "ZeRO stage 2, 3 gloo rank(s)" in demo.format_report(r)


def _readme_block(heading: str) -> str:
    """The first ```python block under ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(heading, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _exec_readme_loop(code: str) -> tuple[float, int, dict[str, list[float]]]:
    """Run the README's loop on this rank; what it ends with, to compare across ranks."""
    scope: dict[str, object] = {"__name__": "readme"}
    exec(code, scope)
    info, state, params = scope["info"], scope["state"], scope["params"]
    return info.grad_norm, state.step, {k: v.reshape(-1).tolist() for k, v in params.items()}  # type: ignore[attr-defined]


def test_readme_functional_loop_runs_on_two_ranks() -> None:
    code = _readme_block("## The functional training loop")
    with World(2) as world:
        results = world.run(_exec_readme_loop, code)
    assert results[0] == results[1]  # params identical on every rank after gather_params
    assert results[0][1] == 20


def test_config_rejects_what_the_command_line_rejects() -> None:
    with pytest.raises(ValueError, match="mixed precision"):
        demo.run(demo.DemoConfig(precision="bf16"))


@pytest.mark.slow
def test_demo_runs_under_torchrun() -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.run(
        [*TORCHRUN, "-m", "zerofn", "demo", "--steps", "3", "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("zerofn demo: ZeRO stage 2, 2 gloo rank(s)") == 1  # rank 0 only
    assert _figure(r"max rel diff ([\d.e+-]+)", proc.stdout) < 1e-6
