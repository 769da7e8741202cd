"""The benchmark harness runs end to end on tiny models and writes well-formed results.

No timing is asserted (speed targets live in the benchmark's own report). What is checked
exactly: every zerofn system runs at N = 2, its losses agree with DDP's, and the bytes
zerofn counts equal the formula of the collective realisation in use (and what the
harness's own ``torch.distributed`` wrapper counts for the same steps).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import page, report  # noqa: E402
from benchmarks import run as bench  # noqa: E402

# The compiled systems compile for tens of seconds (inductor: minutes) and count no bytes
# inside their graph: benchmarks/README.md gives their figures; tests/test_jit.py and
# tests/test_jit_facade.py their parity.
ZEROFN_SYSTEMS = [s for s in bench.ALL_SYSTEMS if s.startswith("zerofn-") and "compiled" not in s]
N = 2
STEPS = 2


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench") / "quick"
    args = bench.parse_args(
        [
            "--quick",
            "--models",
            "transformer",
            "--world-sizes",
            str(N),
            "--systems",
            "ddp-fused",
            *ZEROFN_SYSTEMS,
            "--steps",
            str(STEPS),
            "--device",
            "cpu",
            "--no-plot",
            "--strict",
            "--out",
            str(out),
        ]
    )
    results = bench.run(args)
    return results, out


def test_quick_run_writes_json_and_markdown_that_agree(quick_results: tuple[dict, Path]) -> None:
    results, out = quick_results
    on_disk = json.loads(out.with_suffix(".json").read_text())
    assert on_disk["runs"][0]["psi"] == results["runs"][0]["psi"]
    assert set(on_disk) >= {"meta", "runs", "targets", "notes"}
    md = out.with_suffix(".md").read_text()
    for name in ["ddp-fused", *ZEROFN_SYSTEMS]:
        assert f"`{name}`" in md
    assert "## Targets" in md


def test_the_benchmarks_page_summary_is_made_from_one_results_file(quick_results: tuple[dict, Path]) -> None:
    """What the site's benchmarks page shows at the top (``<!-- benchmarks-summary: ... -->``)."""
    _, out = quick_results
    summary = page.summary(json.loads(out.with_suffix(".json").read_text()))
    assert "| DDP + fused AdamW | " in summary and " ms |" in summary  # the reference row: milliseconds
    assert "| zerofn facade, stage 2 | " in summary and "×" in summary  # the others: its multiples
    assert "**Machine:**" in summary


def test_every_zerofn_system_ran_its_steps_with_finite_losses(quick_results: tuple[dict, Path]) -> None:
    results, _ = quick_results
    (run,) = results["runs"]
    assert (run["model"], run["world_size"], run["backend"]) == ("transformer", N, "gloo")
    for name in ["ddp-fused", *ZEROFN_SYSTEMS]:
        s = run["systems"][name]
        assert s["status"] == "ok", (name, s.get("note"))
        assert len(s["step_ms"]) == STEPS  # one round of STEPS timed steps
        assert all(t > 0 for t in s["step_ms"])
        assert len(s["losses"]) == N and all(math.isfinite(v) for r in s["losses"] for v in r)
        assert s["ratio_ddp_fused"] is not None


def test_zerofn_losses_match_ddp(quick_results: tuple[dict, Path]) -> None:
    (run,) = quick_results[0]["runs"]
    for name in ZEROFN_SYSTEMS:
        assert run["systems"][name]["max_loss_diff_vs_ref"] <= 1e-5, name


def test_zerofn_bytes_equal_the_formula_of_the_realisation(quick_results: tuple[dict, Path]) -> None:
    (run,) = quick_results[0]["runs"]
    for name in ZEROFN_SYSTEMS:
        s = run["systems"][name]
        shard_elems = s["describe"][0]["shard_elems"]
        b = s["describe"][0]["elem_size"]
        by = s["zerofn_by_collective"]
        # gloo's default policy: all-to-all for the reduce (stage 1: all-reduce), one broadcast per
        # rank for the gather; byte-optimal: reduce-scatter and all-gather.
        if name == "zerofn-s2-byteopt":
            reduce, gather, factor = "reduce_scatter", "all_gather", 1
        else:
            reduce, gather, factor = (
                ("all_reduce", "broadcast", 2) if name.startswith("zerofn-s1") else ("all_to_all", "broadcast", 1)
            )
        assert by[reduce] == factor * (N - 1) * shard_elems * b
        assert by[gather] == (N - 1) * shard_elems * b
        # Beyond the buckets only O(1) bytes: the rank-agreement check and the norm scalars.
        small = {k: v for k, v in by.items() if k in ("check", "scalars")}
        assert set(by) - set(small) == {reduce, gather}
        assert 0 <= sum(small.values()) <= 256
        assert s["bytes_sent"] == sum(by.values())
        assert s["bytes_extra"] == sum(small.values())
        # The harness's wrapper around torch.distributed sees the same collectives.
        assert s["python_bytes"] == s["zerofn_bytes"]


def test_state_bytes_are_the_sharded_adamw_state(quick_results: tuple[dict, Path]) -> None:
    (run,) = quick_results[0]["runs"]
    n_params = run["n_params"]
    for name in ZEROFN_SYSTEMS:
        s = run["systems"][name]
        shard_elems = s["describe"][0]["shard_elems"]
        # master + exp_avg + exp_avg_sq (fp32) per shard element, plus at most one fp32 step per tensor
        assert 12 * shard_elems <= s["state_master_bytes"] <= 12 * shard_elems + 4 * n_params
        assert s["state_theory"] == 12 * math.ceil(run["psi"] / N)


def test_memory_phase_reports_peak_rss_per_rank(tmp_path: Path) -> None:
    args = bench.parse_args(
        [
            "--quick",
            "--models",
            "mlp-small",
            "--systems",
            "zerofn-s2",
            "--memory",
            "isolated",
            "--device",
            "cpu",
            "--no-plot",
            "--strict",
            "--out",
            str(tmp_path / "mem"),
        ]
    )
    results = bench.run(args)
    (run,) = results["runs"]
    assert run["n_params"] >= 16  # many small params even in the quick config
    mem = run["systems"]["zerofn-s2"]["memory"]
    assert len(mem["peak_rss"]) == N and all(p > 0 for p in mem["peak_rss"])
    assert all(p >= b for p, b in zip(mem["peak_rss"], mem["baseline_rss"], strict=True))


def test_report_targets_read_ratios_from_runs() -> None:
    run = {
        "model": "transformer",
        "world_size": 2,
        "systems": {
            "zerofn-s2": {"status": "ok", "family": "zerofn", "median_ms": 60.0, "ratio_ddp_foreach": 0.7},
            "zerofn-s2-overlap": {"status": "ok", "family": "zerofn", "median_ms": 80.0},
            "zerofn-fn-pure": {"status": "ok", "family": "zerofn", "median_ms": 66.0},
            "zerofn-fn-donated": {"status": "ok", "family": "zerofn", "median_ms": 60.0},
        },
    }
    got = {t["target"]: t for t in report.targets([run])}
    assert got["stage-2 facade <= 0.75x DDP foreach"]["met"] is True
    assert got["stage-2 facade <= 0.75x DDP foreach"]["detail"] == "zerofn-s2"
    assert got["pure functional <= 1.10x donated"]["value"] == pytest.approx(1.1)


def test_device_cuda_picks_nccl_on_a_world_with_device_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # As on a one-GPU machine, whatever this one has: nothing is started here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = bench.parse_args(["--device", "cuda", "--world-sizes", "1", "2", "--threads", "2", "--timeout", "45"])
    assert bench._backend_for(1, "cuda") == ("nccl", None)
    assert bench._backend_for(2, "cuda") == ("", "N=2 needs 2 GPUs, found 1; skipped")
    assert bench._backend_for(2, "auto") == ("gloo", None) and bench._backend_for(1, "cpu") == ("gloo", None)
    world = bench._world(1, "nccl", args)
    assert (world.world_size, world.backend, world.device, world.threads, world.timeout) == (1, "nccl", "cuda", 2, 45.0)
    assert world.init is not None  # every rank installs the byte counter before any system is built
    cpu = bench._world(2, "gloo", args)
    assert (cpu.backend, cpu.device) == ("gloo", "cpu")


def test_the_jit_pages_compiled_table_shows_each_compiled_step_beside_its_eager_one() -> None:
    """``<!-- benchmarks-compiled: ... -->``: ratios from the file, compile times of the compiled
    steps only, a dash where a model lacks a system, and nothing made up for absent systems."""

    def system(ratio: float, cold: float | None = None, warm: float | None = None) -> dict:
        s = {"status": "ok", "median_ms": 100.0 * ratio, "ratio_ddp_fused": ratio}
        return s if cold is None else {**s, "compile_cold_s": cold, "compile_warm_s": warm}

    runs = [
        {
            "model": "transformer",
            "world_size": 2,
            "systems": {
                "ddp-fused": system(1.0),
                "zerofn-fn-donated": system(1.24),
                "zerofn-fn-compiled": system(2.14, 29.6, 30.6),
            },
        },
        {
            "model": "mlp-large",
            "world_size": 2,
            "systems": {"ddp-fused": system(1.0), "zerofn-fn-donated": system(1.53)},
        },
    ]
    table = page.compiled({"meta": {"zerofn_commit": "abc1234", "cpus": 2}, "runs": runs})
    assert "| functional, eager | 1.24× | 1.53× |" in table
    assert "| functional, aot_eager | 2.14× | – |" in table
    assert "| functional, aot_eager | 30 / 31 | – |" in table  # the compile table: cold / warm
    assert "functional, eager | 1" not in table.split("**Compile time**")[1]  # eager steps compile nothing
    assert "inductor" not in table.replace("torch._dynamo", "")  # no row for a system the file lacks
    assert "zerofn abc1234" in table
    assert page.compiled({"runs": []}).startswith("*(no compiled step")
