"""``ZeroState``: everything one rank holds between steps, as an immutable value."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from zerofn._tree import FrozenDict
from zerofn.layout import ShardLayout
from zerofn.optim import Optimizer

__all__ = ["StepInfo", "ZeroState"]


@dataclasses.dataclass(frozen=True)
class ZeroState:
    """One rank's ZeRO state: its master shards and optimizer-state shards.

    A pytree whose leaves are the tensors (and the step count); ``layout``,
    ``optimizer`` and ``rank`` are static metadata carried in the tree's context, so
    ``tree_map`` over a state touches tensors only.

    Attributes:
      layout: the :class:`~zerofn.layout.ShardLayout` every rank agrees on.
      optimizer: the functional optimizer that ``step_shards`` applies.
      rank: this rank's index in the sharding group; ``master`` holds chunk ``rank``.
      master: name -> ``(shard_numel,)`` master shard (float32 by default), padding zero.
      opt_state: the optimizer's state NamedTuple over the same shard shapes.
      step: completed (not skipped) optimizer steps.
    """

    layout: ShardLayout
    optimizer: Optimizer
    rank: int
    master: FrozenDict[torch.Tensor]
    opt_state: Any
    step: int = 0

    def replace(self, **changes: Any) -> ZeroState:
        return dataclasses.replace(self, **changes)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this rank holds: master shards plus optimizer state."""
        leaves = pytree.tree_leaves((self.master, self.opt_state))
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


pytree.register_pytree_node(
    ZeroState,
    lambda s: ([s.master, s.opt_state, s.step], (s.layout, s.optimizer, s.rank)),
    lambda children, ctx: ZeroState(ctx[0], ctx[1], ctx[2], *children),
    serialized_type_name="zerofn.ZeroState",
)


class StepInfo(NamedTuple):
    """What ``step_shards`` found out on the way.

    Attributes:
      grad_norm: the global gradient norm over the group (before clipping), a float;
        ``inf`` or ``nan`` when some gradient was not finite.
      skipped: True when the step was not applied (a non-finite gradient on any rank).
      clip_coef: the factor gradients were multiplied by (1.0 when not clipped).
    """

    grad_norm: float
    skipped: bool
    clip_coef: float
