"""The demo (``python -m zerofn demo``): end to end, its report, and its option errors."""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import get_world
from helpers import seeded

from zerofn import demo
from zerofn.__main__ import build_parser, main
from zerofn.demo import cli, config

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
# The demo's seed (model init and data), moved by the suite's seed knob.
SEED = seeded(0)
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


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails unless ``path`` is a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_demo_runs_end_to_end_and_matches_ddp(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    proc = _run_cli("demo", "--steps", "5", "--world-size", "2", *(["--plot", str(plot)] if HAVE_MATPLOTLIB else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ZeRO stage 2, functional API, 2 gloo rank(s), fp32, 5 steps" in out
    assert "Traceback" not in proc.stderr
    assert "5/5" in proc.stderr  # the progress bar reached the end
    loss_start = _figure(r"loss\s+([\d.]+) ->", out)
    loss_end = _figure(r"loss\s+[\d.]+ -> ([\d.]+)", out)
    assert loss_end < loss_start
    assert "max abs diff 0, max rel diff 0: bitwise equal" in out
    state = _figure(r"optimizer state\s+([\d,]+) B per rank", out)
    unsharded = _figure(r"vs DDP ([\d,]+) B \(replicated\)", out)
    assert state == pytest.approx(unsharded / 2, rel=1e-3)  # even split: half per rank
    sent = _figure(r"bytes sent\s+([\d,]+) B per rank per step", out)
    theory = _figure(r"2\(N-1\)/N·Ψ·b = ([\d,]+) B", out)
    assert theory == 2 * (2 - 1) / 2 * 22_026 * 4
    assert theory <= sent <= 1.5 * theory * 1.01  # gloo trades 1.5x the bytes for speed
    assert re.search(r"time per step\s+zerofn [\d.]+ ms, DDP [\d.]+ ms", out)
    if HAVE_MATPLOTLIB:
        assert f"wrote {plot}" in proc.stderr
        width, height = _png_size(plot)
        assert width > 400 and height > 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--stage", "3"], "invalid choice"),
        (["--max-norm", "-1"], "--max-norm must be a positive finite number"),
        (["--steps", "many"], "invalid int value"),
        (["--no-such-option"], "unrecognized arguments"),
        (["--accumulate", "0"], "--accumulate must be at least 1"),
        (["--accumulate", "-3"], "--accumulate must be at least 1"),
        (["--accumulate", "2.5"], "argument --accumulate: invalid int value"),
        (["--api", "jax"], "argument --api: invalid choice: 'jax'"),
        (["--api", "functional", "--overlap"], "--overlap needs --api facade"),
        (["--overlap", "yes"], "unrecognized arguments: yes"),
        (["--plot"], "argument --plot: expected one argument"),
        (["--plot", "loss.jpg"], "--plot writes a PNG: give a path ending in .png"),
        (["--plot", "/no/such/folder/demo.png"], "the folder /no/such/folder does not exist"),
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


@pytest.mark.parametrize("args", [["demo", "--accumulate", "0", "--precision", "bf16"], []])
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
    """At 3 ranks on the float64 wire the demo's two runs are bitwise equal: every addend of
    a gradient sum is an fp32 number, exact in float64, so the sum has no order and DDP's
    buckets and zerofn's rank-major rows give the same bits (``zerofn.testing._wire``).
    On the default fp32 wire they differ in last bits, which AdamW's eps 1e-8 may amplify;
    the parity tests hold that wire to a bound from error analysis with SGD instead."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    cfg = demo.DemoConfig(world_size=3, steps=5, comm="byte-optimal", seed=SEED, wire="fp64", progress=False)
    r = demo.run(cfg)
    assert (r["world_size"], r["stage"], r["steps"], r["precision"], r["wire"]) == (3, 2, 5, "fp32", "fp64")
    assert (r["reduce"], r["gather"]) == ("reduce_scatter", "all_gather")
    assert r["num_params"] == 22_026
    assert r["max_abs_diff"] == 0 and r["max_rel_diff"] == 0
    assert r["losses"] == r["ddp_losses"]
    assert "bitwise equal" in demo.format_report(r) and "float64 wire" in demo.format_report(r)
    assert r["loss_end"] < r["loss_start"]
    # Each rank holds a third of master + moments (plus a little padding).
    assert r["state_bytes_per_rank"] == pytest.approx(r["ddp_state_bytes"] / 3, rel=1e-2)
    # Byte-optimal: the reduce-scatter sends (N-1)/N·Ψ float64 gradients, the all-gather
    # (N-1)/N·Ψ fp32 params, plus padding and a few scalars (rank agreement, the norm);
    # the report's yardstick stays the working dtype's 2(N-1)/N·Ψ·b.
    assert r["theory_bytes_per_step"] == pytest.approx(2 * 2 / 3 * 22_026 * 4)
    assert r["bytes_sent_per_step"] == pytest.approx(2 / 3 * 22_026 * (8 + 4), rel=1e-2)
    assert set(r["bytes_by_collective"]) >= {"reduce_scatter", "all_gather"}
    assert r["ms_per_step"] > 0 and r["ddp_ms_per_step"] > 0
    assert "ZeRO stage 2, functional API, 3 gloo rank(s)" in demo.format_report(r)


def test_config_rejects_what_the_command_line_rejects() -> None:
    with pytest.raises(ValueError, match="--overlap needs --api facade"):
        demo.run(demo.DemoConfig(overlap=True))
    with pytest.raises(ValueError, match="--accumulate must be at least 1"):
        demo.run(demo.DemoConfig(accumulate=0))


def _config(*args: str) -> demo.DemoConfig:
    parsed = build_parser().parse_args(["demo", *args])
    return demo.config_from_args(parsed, parsed.subparser)


def test_overlap_picks_the_facade_and_api_is_explicit_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    assert (_config().api, _config().overlap) == ("functional", False)
    assert (_config("--overlap").api, _config("--overlap").overlap) == ("facade", True)
    assert _config("--api", "facade").api == "facade"
    assert _config("--api", "facade", "--overlap", "--accumulate", "3").accumulate == 3
    assert (_config().wire, _config("--wire", "fp64").wire) == ("working", "fp64")
    assert demo.DemoConfig(wire="fp16").problems() == ["--wire must be one of working, fp64, got 'fp16'"]


def test_plot_problems_are_option_errors_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "taken.png"
    folder.mkdir()  # a folder where the PNG should go: cannot be written
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--plot", str(folder)])
    assert exc.value.code == 2
    assert "cannot write there" in capsys.readouterr().err
    # Checking the path leaves nothing behind.
    fresh = tmp_path / "fresh.png"
    with pytest.raises(SystemExit):
        main(["demo", "--plot", str(fresh), "--steps", "0"])
    assert not fresh.exists()


def test_plot_without_matplotlib_is_an_option_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--plot", str(tmp_path / "demo.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib, which is not installed: pip install matplotlib" in err
    assert not (tmp_path / "demo.png").exists()


def test_the_demo_imports_matplotlib_only_for_a_plot() -> None:
    code = "import sys, zerofn.__main__, zerofn.demo; print('matplotlib' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


# --------------------------------------------------------------------------- the options at 2 ranks
#
# One pool of 2 gloo ranks trains every configuration below in turn (a few steps each), so
# the options cost seconds, not a process start each.

MIXED = [
    demo.DemoConfig(steps=4, precision="bf16", seed=SEED, progress=False),
    demo.DemoConfig(steps=4, precision="fp16", seed=SEED, progress=False),
    demo.DemoConfig(steps=3, precision="fp32", stage=1, accumulate=3, seed=SEED, progress=False),
    demo.DemoConfig(steps=3, precision="fp32", api="facade", overlap=True, accumulate=3, seed=SEED, progress=False),
    demo.DemoConfig(steps=3, precision="bf16", api="facade", stage=1, accumulate=2, seed=SEED, progress=False),
    demo.DemoConfig(steps=4, precision="fp16", api="facade", overlap=True, seed=SEED, progress=False),
    demo.DemoConfig(steps=3, precision="bf16", max_norm=0.5, comm="byte-optimal", seed=SEED, progress=False),
]


def _train_each(configs: list[demo.DemoConfig]) -> list[dict[str, Any]]:
    return [demo.train(cfg) for cfg in configs]


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    """Rank 0's report for every config in ``MIXED``."""
    per_rank = get_world(2).run(_train_each, MIXED)
    local = ("ms_per_step", "ddp_ms_per_step", "bytes_by_collective")  # this rank's own
    for mine, first in zip(per_rank[1], per_rank[0], strict=True):
        assert {k: v for k, v in mine.items() if k not in local} == {k: v for k, v in first.items() if k not in local}
    return per_rank[0]


def _report(reports: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    (found,) = [r for r in reports if all(r[k] == v for k, v in match.items())]
    return found


def _id(c: demo.DemoConfig) -> str:
    return f"{c.precision}-{c.api}-s{c.stage}-k{c.accumulate}" + ("-clip" if c.max_norm else "")


@pytest.mark.parametrize("cfg", MIXED, ids=_id)
def test_every_option_matches_ddp_at_two_ranks(reports: list[dict[str, Any]], cfg: demo.DemoConfig) -> None:
    r = reports[MIXED.index(cfg)]
    assert (r["precision"], r["api"], r["stage"], r["accumulate"], r["overlap"]) == (
        cfg.precision,
        cfg.api,
        cfg.stage,
        cfg.accumulate,
        cfg.overlap,
    )
    assert r["parity_ok"]
    if cfg.max_norm is None:
        # Two ranks, no clipping: the same bits as DDP in every dtype, through both APIs.
        assert r["max_abs_diff"] == 0
        assert r["losses"] == r["ddp_losses"]
        assert "bitwise equal" in demo.format_report(r)
    else:  # the clip coefficients differ in the last bit of a double (see DemoConfig.max_norm)
        assert r["max_rel_diff"] <= config.TOLERANCE[cfg.precision]
    assert len(r["losses"]) == cfg.steps
    # Working-dtype bytes on the wire: b = 2 for bf16/fp16.
    elem = torch.finfo(config.DTYPES[cfg.precision]).bits // 8
    assert r["theory_bytes_per_step"] == pytest.approx(22_026 * elem)
    # Each rank keeps half of the fp32 masters + AdamW state, whatever the working dtype.
    assert r["state_bytes_per_rank"] == pytest.approx(r["ddp_state_bytes"] / 2, rel=1e-3)
    assert r["master_bytes_per_rank"] == pytest.approx(22_026 * 4 / 2, rel=1e-3)


def test_accumulation_sends_nothing_before_the_last_micro_batch(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        assert r["accumulation_bytes"] == 0
        text = demo.format_report(r)
        if r["accumulate"] > 1:
            assert f"{r['steps']} steps x {r['accumulate']} micro-batches" in text
            assert "one reduction: 0 B sent before the last micro-batch" in text
        else:
            assert "accumulation" not in text
    # K micro-batches cost one reduction per step: each step's reduction sends what one
    # reduction of the model sends (all_reduce 2(N-1)/N·Ψ·b, all_to_all (N-1)/N·Ψ·b: the
    # demo's layers need no padding at N = 2), whatever K.
    for r in reports:
        one = r["theory_bytes_per_step"] * (1 if r["reduce"] == "all_reduce" else 0.5)
        assert r["bytes_by_collective"][r["reduce"]] == one, (r["accumulate"], r["reduce"])


def test_fp16_skips_the_same_overflowing_steps_as_torch_grad_scaler(reports: list[dict[str, Any]]) -> None:
    for api in ("functional", "facade"):
        r = _report(reports, precision="fp16", api=api)
        # 2^16 times a loss of about 2.3 overflows fp16: step 1 is skipped, the scale halves.
        assert r["skipped"] == r["ddp_skipped"] >= 1
        assert (r["loss_scale_start"], r["loss_scale_end"]) == (2.0**16, 2.0**15)
        text = demo.format_report(r)
        assert f"loss scale       65536 -> 32768, {r['skipped']} of 4 steps skipped for overflow" in text
        assert f"(DDP + torch.amp.GradScaler: {r['ddp_skipped']})" in text
    assert "loss scale" not in demo.format_report(_report(reports, precision="bf16", api="functional", max_norm=None))


def test_the_report_names_the_api_and_overlap(reports: list[dict[str, Any]]) -> None:
    overlap = _report(reports, precision="fp16", api="facade")
    assert "ZeRO stage 2, ZeroOptimizer facade with overlap, 2 gloo rank(s), fp16, 4 steps" in demo.format_report(
        overlap
    )
    stage1 = _report(reports, precision="bf16", api="facade")
    assert "ZeRO stage 1, ZeroOptimizer facade, 2 gloo rank(s), bf16, 3 steps x 2 micro-batches" in (
        demo.format_report(stage1)
    )
    functional = _report(reports, precision="bf16", api="functional", max_norm=None)
    assert "ZeRO stage 2, functional API, 2 gloo rank(s), bf16, 4 steps" in demo.format_report(functional)


def test_a_drift_beyond_the_tolerance_is_reported_and_fails_the_command(
    reports: list[dict[str, Any]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    drifted = {**reports[0], "max_abs_diff": 0.5, "max_rel_diff": 0.5, "parity_ok": False}
    monkeypatch.setattr(cli, "run", lambda cfg: drifted)
    assert main(["demo", "--precision", "bf16"]) == 1
    out, err = capsys.readouterr()
    assert "max rel diff 0.5: NOT within the bf16 tolerance (max rel diff <= 0.05)" in out
    assert "further from DDP's than the bf16 tolerance allows" in err


def test_plot_writes_a_png_of_the_loss_curves_and_memory_bars(reports: list[dict[str, Any]], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib import image

    for i, r in enumerate(reports[:2]):
        path = tmp_path / f"demo{i}.png"
        demo.write_plot(r, path)
        width, height = _png_size(path)
        assert (width, height) == (810, 306)  # 9 x 3.4 inches at 90 dpi
        pixels = image.imread(str(path))
        colors = {tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}
        assert len(colors) > 20  # curves, bars, text: not a blank canvas


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
    assert proc.stdout.count("zerofn demo: ZeRO stage 2, functional API, 2 gloo rank(s)") == 1  # rank 0 only
    assert "max rel diff 0: bitwise equal" in proc.stdout
