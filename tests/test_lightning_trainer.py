"""zerofn.lightning: ZeroTrainerStrategy in Lightning's Trainer, on real gloo ranks, against Lightning's own "ddp".

Every rank function builds its ``Trainer`` inside a worker of the session's ``World`` pool
(which set ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` as torchrun does, and whose process
group the Trainer finds initialized), so no process starts per test.

Bitwise by construction, as in tests/test_lightning.py: at 2 ranks an fp32 mean does not
depend on the order of the sum; at 3 zerofn sends gradients as float64
(``communication_dtype``) and Lightning's DDP through ``float64_wire_hook``; the DDP side
clips with ``helpers.clip_in_float64`` (zerofn's arithmetic: the norm in float64).
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import assert_bitwise_equal, clip_in_float64, float64_wire_hook, mse, seeded

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision  # noqa: E402

import zerofn as zf  # noqa: E402
from zerofn.lightning import ZeroTrainerStrategy  # noqa: E402

ACCUMULATE = 2
CLIP = 0.05


class _Net(L.LightningModule):
    """Two linear layers, AdamW with weight decay and a per-step scheduler; rank r starts from its own weights."""

    def __init__(
        self, *, wire64: bool = False, two_optimizers: bool = False, wrapped: bool = False, inf_at_epoch: int = -1
    ) -> None:
        super().__init__()
        torch.manual_seed(seeded(31) + dist.get_rank())  # different on each rank: setup must broadcast rank 0's
        self.net = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 5))
        if wrapped:
            self.net = nn.parallel.DistributedDataParallel(self.net)
        self.wire64, self.two_optimizers = wire64, two_optimizers
        self.inf_at_epoch = inf_at_epoch  # rank 1's first micro-batch of that epoch overflows
        self.steps: list[tuple[bool, float]] = []  # (skipped, loss scale) after each optimizer step
        self.automatic_optimization = not two_optimizers
        self.losses: list[float] = []
        self.sent: list[int] = []

    def on_fit_start(self) -> None:
        model = self.trainer.strategy.model
        if self.wire64 and isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(None, float64_wire_hook)  # Lightning's DDP side of the exact wire

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._counting = zf.count_bytes()
        self._counter = self._counting.__enter__()

    def on_after_backward(self) -> None:
        self.sent.append(self._counter.bytes_sent)  # what this micro-batch's backward sent (zerofn's hooks)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._counting.__exit__(None, None, None)

    def on_train_epoch_end(self) -> None:  # one epoch is one optimizer step
        zero = getattr(self.trainer.strategy, "zero_optimizer", None)
        if zero is not None:
            self.steps.append((zero.last_step_info.skipped, zero.loss_scale))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.current_epoch == self.inf_at_epoch and batch_idx == 0 and dist.get_rank() == 1:
            x = x * float("inf")
        loss = mse(self.net(x + 0.1 * self.current_epoch), y)  # other inputs in each epoch
        self.losses.append(float(loss.detach()))
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if isinstance(self.trainer.strategy, ZeroTrainerStrategy) or gradient_clip_algorithm == "value":
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_val:  # the DDP side (the algorithm is None unless the Trainer was given one), as zerofn
            clip_in_float64(self.parameters(), gradient_clip_val)
        return None

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        if self.two_optimizers:
            return [opt, torch.optim.SGD(self.parameters(), lr=0.1)]
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader() -> torch.utils.data.DataLoader:
    """Each rank its own batches (no distributed sampler); one epoch is one optimizer step."""
    g = torch.Generator().manual_seed(seeded(100) + dist.get_rank())
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * ACCUMULATE, 7, generator=g), torch.randn(4 * ACCUMULATE, 5, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(
    strategy, epochs: int, *, precision="32-true", plugins=None, clip=CLIP, algorithm=None, accumulate=ACCUMULATE
):
    kw = {"precision": precision} if plugins is None else {"plugins": plugins}
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" & co. in the output
    return L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        **kw,
    )


def _fit(trainer, model, ckpt_path=None, **kw) -> None:
    with warnings.catch_warnings():
        # Tiny in-memory data on purpose; Lightning suggests loader workers and more batches for logging.
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
        # Lightning 2.6.6's own use of a torch pytree API that torch 2.13 deprecates.
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
        trainer.fit(model, _loader(), ckpt_path=ckpt_path, **kw)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _state_bytes(tree) -> int:
    """Bytes of the tensors in ``tree``, each storage once (zerofn's names are views of flat buffers)."""
    import torch.utils._pytree as pytree

    seen = {}
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _parity(stages, precisions, steps: int):
    """Fit with ZeroTrainerStrategy (each stage, precision) and with Lightning's ddp; return both per case."""
    wire = torch.float64 if dist.get_world_size() > 2 else None
    out = {}
    for precision in precisions:
        model = _Net(wire64=wire is not None)
        trainer = _trainer("ddp", steps, precision=precision)
        _fit(trainer, model)
        opt = trainer.optimizers[0]
        ref = (
            _params(model),
            model.losses,
            _state_bytes(dict(opt.state)),
            trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
        )
        for stage in stages:
            model = _Net()
            trainer = _trainer(ZeroTrainerStrategy(stage=stage, communication_dtype=wire), steps, precision=precision)
            _fit(trainer, model)
            zero = trainer.strategy.zero_optimizer
            lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
            out[(stage, precision)] = (
                _params(model),
                model.losses,
                ref,
                _state_bytes(zero.state.opt_state),
                lr,
                model.sent,
            )
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("n", [2, 3], ids=lambda n: f"N{n}")
def test_trainer_fits_bitwise_like_lightning_ddp(zerofn_world, n):
    precisions = ["32-true", "bf16-mixed"] if n == 2 else ["32-true"]
    steps = 3
    results = zerofn_world(n).run(_parity, [1, 2], precisions, steps)
    for rank, per_case in enumerate(results):
        for (stage, precision), (params, losses, ref, moments, lr, sent) in per_case.items():
            ref_params, ref_losses, ref_moments, ref_lr = ref
            what = f"rank {rank} stage {stage} {precision}"
            assert losses == ref_losses and len(losses) == steps * ACCUMULATE, what
            assert lr == ref_lr == [0.02 * 0.7**steps], what  # the scheduler stepped the live param groups
            for name in ref_params:
                assert_bitwise_equal(params[name], ref_params[name], f"{what} {name}")
            # AdamW's moments: 1/N of DDP's on each rank, up to the padding (< N elements per param and moment).
            assert 0 <= moments * n - ref_moments <= 2 * 4 * n * len(ref_params), (what, moments, ref_moments)
            # accumulate_grad_batches: the first micro-batch's backward sends nothing, the last one's reduces.
            assert [b > 0 for b in sent] == [(i + 1) % ACCUMULATE == 0 for i in range(len(sent))], (what, sent)
    for rank in range(1, n):  # every rank ends with the same weights (rank 0's at setup, then the same updates)
        for name, p in results[0][(2, "32-true")][0].items():
            assert_bitwise_equal(results[rank][(2, "32-true")][0][name], p, f"rank {rank} vs 0 {name}")


def _clip_value_and_fp16():
    """Clipping by value at stage 1 against ddp; "16-mixed" with zerofn's loss scaler in place of the GradScaler,
    an overflow on rank 1 alone in the second step; "bf16-true"."""
    out = {}
    for name, strategy in (("ddp", "ddp"), ("zerofn", ZeroTrainerStrategy(stage=1))):
        model = _Net()
        _fit(_trainer(strategy, 2, clip=0.01, algorithm="value"), model)
        out[name] = _params(model)
    # Lightning turns precision="16-mixed" into "bf16-mixed" on the CPU; the plugin is what it builds elsewhere.
    # An inf on rank 1 alone in the second step: every rank skips it and backs off the scale.
    strategy = ZeroTrainerStrategy(initial_scale=2.0**10, hysteresis=1)
    trainer = _trainer(strategy, 3, plugins=[MixedPrecision("16-mixed", "cpu")])
    model = _Net(inf_at_epoch=1)
    _fit(trainer, model)
    zero = trainer.strategy.zero_optimizer
    out["fp16"] = (trainer.precision_plugin.scaler, model.steps, int(zero.state.step), _params(model))
    # "bf16-true": bfloat16 params, stepped from float32 master shards.
    trainer = _trainer(ZeroTrainerStrategy(), 2, precision="bf16-true")
    model = _Net()
    _fit(trainer, model)
    masters = {t.dtype for t in trainer.strategy.zero_optimizer.state.master.values()}
    out["bf16_true"] = (masters, _params(model))
    return out


def test_clip_by_value_at_stage_1_fp16_with_an_overflow_on_one_rank_skipped_on_every_rank_and_bf16_true(
    zerofn_world,
):
    results = zerofn_world(2).run(_clip_value_and_fp16)
    for rank, out in enumerate(results):
        for name in out["ddp"]:
            assert_bitwise_equal(out["zerofn"][name], out["ddp"][name], f"rank {rank} {name}")
        scaler, steps, taken, _ = out["fp16"]
        assert scaler is None  # no GradScaler: zerofn's loss scaler, whose overflow verdict every rank shares
        assert steps == [(False, 2.0**10), (True, 2.0**9), (False, 2.0**9)] and taken == 2, (rank, steps)
    for name, p in results[0]["fp16"][3].items():
        assert_bitwise_equal(results[1]["fp16"][3][name], p, name)
    (m0, p0), (m1, p1) = (out["bf16_true"] for out in results)
    assert m0 == m1 == {torch.float32}
    for name, p in p0.items():
        assert p.dtype == torch.bfloat16, name
        assert_bitwise_equal(p1[name], p, name)


# ----------------------------------------------------------------------------- checkpoints


def _zero(state_dict_type: str = "sharded") -> ZeroTrainerStrategy:
    wire = torch.float64 if dist.get_world_size() > 2 else None
    return ZeroTrainerStrategy(communication_dtype=wire, state_dict_type=state_dict_type)


def _save_resume(tmp: str, state_dict_type: str):
    # A run that never stopped.
    model = _Net()
    _fit(_trainer(_zero(), 4), model)
    straight = _params(model)
    # Two steps, saved, thrown away.
    model = _Net()
    trainer = _trainer(_zero(state_dict_type), 2)
    _fit(trainer, model)
    path = os.path.join(tmp, f"ckpt-{state_dict_type}")
    trainer.save_checkpoint(path)
    # A fresh start from other weights, resumed from the checkpoint.
    model = _Net()
    g = torch.Generator().manual_seed(seeded(999))  # the same other weights on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    trainer = _trainer(_zero(state_dict_type), 4)
    _fit(trainer, model, ckpt_path=path)
    return straight, _params(model), os.path.isdir(path), trainer.global_step


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_save_stop_resume_is_bitwise_a_run_that_never_stopped(zerofn_world, tmp_path, state_dict_type):
    results = zerofn_world(2).run(_save_resume, str(tmp_path), state_dict_type)
    for rank, (straight, resumed, is_dir, step) in enumerate(results):
        assert is_dir == (state_dict_type == "sharded") and step == 4
        for name in straight:
            assert_bitwise_equal(resumed[name], straight[name], f"rank {rank} {name}")


def _save_at_two(tmp: str) -> None:
    model = _Net()
    trainer = _trainer(ZeroTrainerStrategy(), 2)
    _fit(trainer, model)
    trainer.save_checkpoint(os.path.join(tmp, "sharded"))
    trainer.strategy.state_dict_type = "full"
    trainer.save_checkpoint(os.path.join(tmp, "full.ckpt"))  # torch's format: what Lightning's ddp loads


def _resume_at_three(tmp: str):
    """zerofn resumes the sharded checkpoint at 3 ranks; Lightning's ddp the torch-format one; both train on."""
    out = {}
    for name, strategy, path in [("zerofn", _zero(), "sharded"), ("ddp", "ddp", "full.ckpt")]:
        model = _Net(wire64=name == "ddp")
        trainer = _trainer(strategy, 4)
        _fit(trainer, model, ckpt_path=os.path.join(tmp, path), weights_only=False)
        out[name] = (_params(model), trainer.global_step, trainer.lr_scheduler_configs[0].scheduler.get_last_lr())
    return out


def test_resume_at_another_world_size_is_bitwise_ddp_resumed_there(zerofn_world, tmp_path):
    zerofn_world(2).run(_save_at_two, str(tmp_path))
    for rank, out in enumerate(zerofn_world(3).run(_resume_at_three, str(tmp_path))):
        (params, step, lr), (ref_params, ref_step, ref_lr) = out["zerofn"], out["ddp"]
        assert step == ref_step == 4 and lr == ref_lr
        for name in ref_params:
            assert_bitwise_equal(params[name], ref_params[name], f"rank {rank} {name}")


# ----------------------------------------------------------------------------- misuse


def _misuse():
    errors = {}
    cases = {
        "two_optimizers": lambda: _fit(
            _trainer(ZeroTrainerStrategy(), 1, clip=None, accumulate=1), _Net(two_optimizers=True)
        ),
        "ddp_wrapped": lambda: _fit(_trainer(ZeroTrainerStrategy(), 1), _Net(wrapped=True)),
        "own_grad_scaler": lambda: _fit(
            _trainer(
                ZeroTrainerStrategy(),
                1,
                plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))],
            ),
            _Net(),
        ),
        "fp16_true": lambda: _fit(_trainer(ZeroTrainerStrategy(), 1, plugins=[HalfPrecision("16-true")]), _Net()),
        "clip_value_at_stage_2": lambda: _fit(_trainer(ZeroTrainerStrategy(stage=2), 1, algorithm="value"), _Net()),
    }
    for what, fn in cases.items():
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            errors[what] = f"{type(e).__name__}: {e}"
        else:
            errors[what] = None
    return errors


def test_misuse_is_refused_at_setup_with_a_message(zerofn_world):
    for errors in zerofn_world(2).run(_misuse):
        assert "zerofn shards one optimizer per model" in errors["two_optimizers"]
        assert "keep the bare model in it" in errors["ddp_wrapped"]
        assert "GradScaler decides on each rank alone" in errors["own_grad_scaler"]
        assert "ZeroTrainerStrategy(initial_scale=" in errors["own_grad_scaler"]
        assert "'16-true'" in errors["fp16_true"] and "Write precision='16-mixed'" in errors["fp16_true"]
        assert "at stage 2 a rank holds only its shards" in errors["clip_value_at_stage_2"]


def test_registered_with_the_trainer_by_name_with_the_fabric_strategys_options():
    from lightning.pytorch.strategies import StrategyRegistry

    from zerofn.lightning import ZeroOptions, ZeroStrategy

    assert StrategyRegistry.get("zerofn").stage == 2 and StrategyRegistry.get("zerofn_stage_1").stage == 1
    assert ZeroTrainerStrategy().options == ZeroStrategy().options == ZeroOptions()
    assert ZeroTrainerStrategy(cpu_offload=True, stage=1).options == ZeroStrategy(cpu_offload=True, stage=1).options
    with pytest.raises(TypeError, match=r"ZeroTrainerStrategy: unknown option\(s\) \['stages'\]"):
        ZeroTrainerStrategy(stages=1)
    with pytest.raises(ValueError, match="ZeroTrainerStrategy: stage must be 1 or 2"):
        ZeroTrainerStrategy(stage=3)


def test_remove_checkpoint_takes_the_saves_own_directory_and_leaves_other_links_targets(tmp_path):
    from zerofn.checkpoint import META_FILE

    (tmp_path / "ck.ckpt.t0").mkdir()
    (tmp_path / "ck.ckpt.t0" / META_FILE).write_text("{}")
    os.symlink("ck.ckpt.t0", tmp_path / "ck.ckpt")  # as a sharded save commits
    os.symlink("ck.ckpt", tmp_path / "last.ckpt")  # as ModelCheckpoint(save_last="link") links
    strategy = ZeroTrainerStrategy()
    strategy.remove_checkpoint(tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ck.ckpt", "ck.ckpt.t0"]
    strategy.remove_checkpoint(tmp_path / "ck.ckpt")
    assert os.listdir(tmp_path) == []
