"""zerofn.hf's checkpoints: every rank writes its shards into the Trainer's ``checkpoint-<step>``, resumed at any N.

One script (accumulation 2, ``max_grad_norm``, a checkpoint every 4 of 8 steps, the global
batch of 12 rows kept at every world size), run by ZeroTrainer and by the Trainer's own DDP,
on the session's pools of 2 and 3 gloo ranks. At 3 ranks both sides reduce on a float64
wire (DESIGN's rule: a sum whose result cannot depend on the order), at 2 on the fp32 wire
(a sum of two addends has one order); the DDP side clips with zerofn's float64 norm.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_bitwise_equal

pytest.importorskip("transformers")

import hf_runs
from hf_runs import params, run

from zerofn.hf._checkpoint import ZEROFN_DIR

STEPS, SAVE_AT, GLOBAL_ROWS = 8, 4, 6  # GLOBAL_ROWS per micro-batch over all ranks


def _args(out: str, **kw):
    n = hf_runs.world()
    base = {"save_strategy": "steps", "save_steps": SAVE_AT, **kw}
    return hf_runs.args(
        out,
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_ROWS // n,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        **base,
    )


def _sides(n: int) -> dict[str, dict]:
    """The keywords of run() for each side at ``n`` ranks: zerofn and DDP, on a float64 wire from 3 ranks on."""
    wire = n > 2
    return {
        "zero": {"zero": True, **({"communication_dtype": torch.float64} if wire else {})},
        "ddp": {"zero": False, "ddp": {"wire64": wire}},
    }


def _save_at_two(tmp: str) -> None:
    """Both sides train to step 4 at 2 ranks and save there (then stop)."""
    for side, kw in _sides(2).items():
        run(**kw, train_args=_args(os.path.join(tmp, f"two-{side}")), recorder=hf_runs.Recorder(stop_at=SAVE_AT))


def _resume(tmp: str, source: str, tag: str) -> dict[str, tuple]:
    """Each side resumed from its own checkpoint at step 4 of the ``source`` runs; zerofn also from DDP's."""
    out = {}
    n = hf_runs.world()
    cases = {**_sides(n), "zero-from-ddp": _sides(n)["zero"]}
    for case, kw in cases.items():
        ckpt = os.path.join(tmp, f"{source}-{case.rsplit('-', 1)[-1]}", f"checkpoint-{SAVE_AT}")
        trainer = run(**kw, train_args=_args(os.path.join(tmp, f"{tag}-{case}"), save_strategy="no"), resume=ckpt)
        out[case] = (params(trainer.model), trainer.state.global_step, trainer.lr_scheduler.get_last_lr())
    return out


def _at_three(tmp: str) -> dict:
    """At 3 ranks: both sides straight through 8 steps (zerofn with both overlaps on), saving at 4 and 8; then
    both resumed from the 2-rank checkpoints."""
    from transformers import GPT2LMHeadModel

    straight = {}
    for side, kw in _sides(3).items():
        options = {"overlap_communication": True, "overlap_allgather": True} if side == "zero" else {}
        trainer = run(**kw, **options, train_args=_args(os.path.join(tmp, f"three-{side}")))
        straight[side] = params(trainer.model)
    folder = os.path.join(tmp, "three-zero", f"checkpoint-{STEPS}")
    loaded = params(GPT2LMHeadModel.from_pretrained(folder))  # the Trainer's own save of the weights
    files = sorted(os.listdir(folder))
    shards = sorted(f for f in os.listdir(os.path.join(folder, ZEROFN_DIR)) if f.endswith(".distcp"))
    return {"straight": straight, "loaded": loaded, "files": files, "shards": shards, **_resume(tmp, "two", "three")}


def _assert_resumed_alike(out: dict, what: str) -> None:
    ref, ref_step, ref_lr = out["ddp"]
    for case in ("zero", "zero-from-ddp"):
        got, step, lr = out[case]
        assert step == ref_step == STEPS and lr == ref_lr, (what, case, step, lr, ref_lr)
        for name in ref:
            assert_bitwise_equal(got[name], ref[name], f"{what} {case} {name}")


@pytest.mark.numerics
def test_resumed_at_another_world_size_each_way_is_bitwise_the_trainers_ddp_resumed_there(zerofn_world, tmp_path):
    tmp = str(tmp_path)
    zerofn_world(2).run(_save_at_two, tmp)
    two = sorted(os.listdir(tmp_path / "two-zero" / f"checkpoint-{SAVE_AT}"))
    assert ZEROFN_DIR in two and "optimizer.pt" not in two and "model.safetensors" in two, two
    assert {"scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(two), two
    three = zerofn_world(3).run(_at_three, tmp)
    for rank, out in enumerate(three):
        # Straight through at 3 ranks on a float64 wire: bitwise the Trainer's DDP, overlaps and all.
        for name, p in out["straight"]["ddp"].items():
            assert_bitwise_equal(out["straight"]["zero"][name], p, f"rank {rank} straight {name}")
            # The weights the Trainer saved (once, from rank 0) are the live ones: from_pretrained loads them.
            assert_bitwise_equal(out["loaded"][name], out["straight"]["zero"][name], f"rank {rank} saved {name}")
        assert out["shards"] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"], out["shards"]  # every rank's
        assert ZEROFN_DIR in out["files"] and "optimizer.pt" not in out["files"], out["files"]
        _assert_resumed_alike(out, f"rank {rank} 2 -> 3")
    for rank, out in enumerate(zerofn_world(2).run(_resume, tmp, "three", "two")):
        _assert_resumed_alike(out, f"rank {rank} 3 -> 2")
