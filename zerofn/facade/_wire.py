"""The facade's compressed wire: what it serves, each bucket's launch, and the residual between steps.

With ``precision=PrecisionPolicy(wire=CompressedWire(...))`` the
:class:`~zerofn.facade._reducer.GradReducer` sends each bucket it launches (from the
gradient hooks, or at the end of the backward) through
:func:`zerofn._wire._bucket.launch_compressed`, the piece ``reduce_grads`` launches per
bucket, so the facade's shards are ``reduce_grads``'s bits. The residual (error feedback)
lives in the facade's :class:`~zerofn.state.ZeroState` (``state.residual``): the first
reduction after a step starts from it, each launched bucket replaces its entry, and
``step`` hands the result to ``step_shards(..., residual=)``, which keeps it (or the old one,
rescaled, on a skipped step). A ``no_sync`` micro-step launches nothing, so it leaves the
residual alone; ``zero_grad`` (the reduced gradients thrown away) forgets the pending one.

:func:`check_facade_wire` refuses what the facade cannot serve with a wire, at construction,
before any collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerofn import _comm as comm
from zerofn._offsets import Bucket, plan_buckets
from zerofn._wire._bucket import launch_compressed, wire_plan
from zerofn._wire._checks import check_wire
from zerofn._wire._policy import CompressedWire
from zerofn.layout import ShardLayout
from zerofn.state import ZeroState

__all__ = ["FacadeWire", "check_facade_wire", "check_facade_wire_options"]

_WHO = "ZeroOptimizer: the compressed wire (PrecisionPolicy(wire=...))"


def check_facade_wire_options(
    *, stage: int, compile: bool | str, sub_dp_size: int, replicate_group: comm.Group
) -> None:
    """The facade's options a compressed wire cannot serve, refused before any collective (raises ``ValueError``).

    Stage 1 (``partition_grad=False``) leaves full averaged gradients in ``p.grad`` and the wire
    leaves each rank its shard of the mean only; ``compile=`` traces ``step_shards``, whose
    residual is kept eagerly; a hybrid layout's second sum would need a residual of its own.
    """
    if stage != 2:
        raise ValueError(
            f"{_WHO} leaves each rank its shard of the mean gradient, and partition_grad=False (ZeRO-1) puts full "
            "averaged gradients in p.grad: pass partition_grad=True, or use a floating wire (wire=None)"
        )
    if compile:
        raise ValueError(
            f"{_WHO} runs eagerly and its residual is kept by the eager step_shards: pass compile=False, or use a "
            "floating wire (wire=None) with compile="
        )
    if sub_dp_size != 1 or replicate_group is not None:
        raise ValueError(
            f"{_WHO} sums over the sharding group only; a hybrid layout (sub_dp_size / replicate_group) would need "
            "a residual for the replicas' sum: drop sub_dp_size and replicate_group, or use a floating wire"
        )


def check_facade_wire(state: ZeroState, bucket_numel: int, group: comm.Group) -> None:
    """What ``reduce_grads`` would refuse for the facade's first state (whole placements,
    e.g. Muon's), raised at construction, on every rank alike, before any collective."""
    wire = state.precision.wire
    assert wire is not None
    check_wire(
        wire,
        state.layout,
        plan_buckets(state.layout, bucket_numel),
        state.residual if wire.error_feedback else None,
        rank=comm.group_rank(group),
        replicate_group=None,
        comm_dtype=state.precision.comm_dtype,
        where="ZeroOptimizer",
    )


class FacadeWire:
    """One facade's compressed launches and the residual of the reduction since the last step.

    Args:
      layout: the state's layout; wire: the policy's wire; group: the sharding group.
      state_residual: returns the facade's current ``state.residual`` (a tuple of
        ``(N - 1, c)`` float32 tensors per bucket of the reducer's plan; ``()`` without
        error feedback).
    """

    def __init__(
        self,
        layout: ShardLayout,
        wire: CompressedWire,
        group: comm.Group,
        state_residual: Callable[[], tuple[torch.Tensor, ...]],
    ) -> None:
        self._layout, self._wire, self._group = layout, wire, group
        self._state_residual = state_residual
        self._next: list[torch.Tensor] | None = None  # None: no reduction since the last step

    def launch(self, b: int, bucket: Bucket, rows: torch.Tensor) -> comm.Pending:
        """Start bucket ``b``'s reduction from its ``(N, S)`` packed ``rows`` (read until it settles).

        Returns the pending ``(S,)`` float32 row of the mean. Collectives: one
        ``all_to_all_single`` (none at ``N = 1``).
        """
        keeps = self._wire.error_feedback
        if keeps and self._next is None:  # the first bucket since the step: from the state's residual
            self._next = list(self._state_residual())
        mine = self._next[b] if self._next is not None else None
        plan = wire_plan(self._layout, bucket, self._wire)
        pending, mine = launch_compressed(rows, plan, self._wire.format, mine, self._group)
        if self._next is not None:
            self._next[b] = mine  # type: ignore[assignment]
        return pending

    def residual_for_step(self, state: ZeroState) -> tuple[torch.Tensor, ...] | None:
        """What ``step_shards(residual=)`` takes: the reductions' residual (the state's if none ran);
        ``None`` without error feedback."""
        if not state.residual:
            return None
        return tuple(self._next) if self._next is not None else state.residual

    def forget(self) -> None:
        """The residual of the reductions since the step is dropped (stepped, or their gradients thrown away)."""
        self._next = None
