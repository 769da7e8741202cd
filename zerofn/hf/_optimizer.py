"""The Trainer's optimizer as a ``ZeroOptimizer``, and the wrapper accelerate's Trainer steps through.

:func:`zero_optimizer` turns the torch optimizer the Trainer built from ``args.optim`` (its
weight-decay groups, the user's ``optimizers=`` or ``optimizer_cls_and_kwargs=``) into a
:class:`~zerofn.ZeroOptimizer` over the model's params. A torch optimizer is wrapped as it
is, so its ``param_groups`` are the ZeroOptimizer's live groups and an LR scheduler built on
it (before or after) drives what zerofn reads. ``optim="adafactor"`` builds transformers'
own ``Adafactor``, which reads whole tensors (row and column statistics, the RMS of the
whole update): zerofn runs that class, unchanged, on whole params on their owner ranks
(:func:`zerofn.torch_optim.from_torch` with ``placement="whole"``), so its update is the
one the Trainer runs under DDP, bit for bit.

:class:`ZeroAcceleratedOptimizer` is accelerate's ``AcceleratedOptimizer`` around the
ZeroOptimizer, built without its ``state_dict()`` round trip (a gather of the whole state
for a sharded optimizer) and without a ``GradScaler``; its ``step_was_skipped`` is zerofn's
verdict, so the Trainer's ``accelerator.optimizer_step_was_skipped`` gate keeps the LR
schedule still on a step zerofn skipped (a non-finite gradient on any rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers.optimization import Adafactor

from zerofn import torch_optim
from zerofn.facade.optimizer import ZeroOptimizer

__all__ = ["ZeroAcceleratedOptimizer", "zero_optimizer"]


def _named_groups(torch_opt: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """The names (the model's) of each param group's params; a param that is not the model's is refused."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for i, group in enumerate(torch_opt.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in name_of]
        if missing:
            raise ValueError(
                f"zerofn.hf.ZeroTrainer: param group {i} of the optimizer holds params that are not the model's "
                f"(shapes {missing}); build the optimizer over trainer.model's parameters"
            )
        groups.append([name_of[id(p)] for p in group["params"]])
    return groups


def zero_optimizer(
    torch_opt: torch.optim.Optimizer, model: torch.nn.Module, stage: int, kwargs: Mapping[str, Any]
) -> ZeroOptimizer:
    """``ZeroOptimizer`` at ``stage`` over ``model``'s params, updating as ``torch_opt`` does.

    Collectives: the ZeroOptimizer's construction (the ranks' agreement on the layout and
    the broadcast of rank 0's params and buffers, as DDP's construction broadcasts them).
    """
    if type(torch_opt) is not Adafactor:
        return ZeroOptimizer(torch_opt, module=model, partition_grad=stage == 2, **kwargs)
    names = _named_groups(torch_opt, model)
    hyper = [{k: v for k, v in g.items() if k not in ("params", "initial_lr")} for g in torch_opt.param_groups]
    groups = [{"params": ns, **hp} for ns, hp in zip(names, hyper, strict=True) if ns]
    functional = torch_optim.from_torch(Adafactor, placement="whole", param_groups=groups, **torch_opt.defaults)
    params = dict(model.named_parameters())
    return ZeroOptimizer(
        [(n, params[n]) for ns in names for n in ns], functional, module=model, partition_grad=stage == 2, **kwargs
    )


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a ``ZeroOptimizer``: no state round trip, no scaler, zerofn's skip verdict.

    ``step`` and ``zero_grad`` act only on the Trainer's synchronising micro-steps, as
    accelerate's wrapper does; ``optimizer`` is the ZeroOptimizer.
    """

    def __init__(self, optimizer: ZeroOptimizer) -> None:
        # device_placement=False: accelerate would round-trip state_dict() (a gather of every shard) to move
        # the state; zerofn's state already lives where its policy puts it. scaler=None: zerofn scales the loss.
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._is_accelerate_prepared = True

    @property
    def step_was_skipped(self) -> bool:
        """Whether zerofn skipped the last step (a non-finite gradient on any rank): the LR schedule then waits."""
        info = self.optimizer.last_step_info
        return bool(info is not None and info.skipped)
