"""``benchmarks/whole_optimizers.py`` runs end to end on the tiny transformer at N = 2.

No timing is asserted (the figures are the benchmark's to report). What is checked: every
system ran its timed steps, ZeroOptimizer([Muon, AdamW]) follows DDP with the same torch
optimizers step by step (the losses, on the same batches), its optimizer-state bytes per
rank are half of DDP's up to the documented bound (the balanced share plus one largest
whole param's state), and the printed table and the JSON agree with the results.
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

from benchmarks import whole_optimizers as bench  # noqa: E402

STEPS, ROUNDS = 2, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("whole-bench") / "whole.json"
    args = bench.parse_args(["--quick", "--steps", str(STEPS), "--rounds", str(ROUNDS), "--json", str(out)])
    res = bench.run(args)
    return res, out, bench.markdown(res, bench.models.model_config("transformer", quick=True))


def test_every_system_ran_its_timed_steps_and_zerofn_follows_ddp(results):
    res, _, _ = results
    assert res["world_size"] == 2 and 0 < res["muon_numel"] < res["psi"]
    assert list(res["systems"]) == list(bench.SYSTEMS)
    for name, e in res["systems"].items():
        assert len(e["step_ms"]) == STEPS * ROUNDS and all(t > 0 for t in e["step_ms"]), name
        assert e["median_ms"] > 0 and math.isfinite(e["ratio"]), name
        # warm-up + timed steps, every one with a finite loss, the same count for every system
        assert len(e["losses"]) == 1 + STEPS * ROUNDS and all(math.isfinite(v) for v in e["losses"]), name
        # The same batches in the same order: Muon + AdamW sharded by owner trains as DDP does.
        assert e["max_loss_rel_diff"] <= 1e-6, (name, e["max_loss_rel_diff"])
    assert res["systems"]["ddp"]["ratio"] == 1.0


def test_state_bytes_per_rank_are_the_balanced_share_within_one_whole_param(results):
    res, _, _ = results
    ddp = res["systems"]["ddp"]
    assert len(set(ddp["state_bytes"])) == 1  # DDP: every rank holds everything
    for name in ("zerofn-s2", "zerofn-s2-overlap"):
        e = res["systems"][name]
        top, balanced, largest = max(e["state_bytes"]), e["balanced_bytes"], e["largest_whole_bytes"]
        assert largest > 0, name  # Muon's matrices are placed whole
        # Every per-element byte is held once, by one rank; only AdamW's 0-d step counter
        # (4 bytes per split param) is kept on every rank.
        extra = sum(e["state_bytes"]) - ddp["state_bytes"][0]
        assert 0 < extra <= 4 * res["tensors"] * (res["world_size"] - 1) and extra % 4 == 0, (name, extra)
        assert balanced <= top <= balanced + largest, name
        assert top < 0.6 * ddp["state_bytes"][0], name


def test_the_table_and_the_json_agree_with_the_results(results):
    res, path, table = results
    on_disk = json.loads(path.read_text())
    assert on_disk["psi"] == res["psi"]
    assert {n: e["median_ms"] for n, e in on_disk["systems"].items()} == {
        n: e["median_ms"] for n, e in res["systems"].items()
    }
    assert "| system | median step (ms) | vs DDP |" in table
    for name, e in res["systems"].items():
        assert f"| `{name}` | {e['median_ms']:.1f} | {e['ratio']:.2f}x |" in table
