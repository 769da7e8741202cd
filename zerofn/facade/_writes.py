"""``ZeroOptimizer``'s side of "the params are the user's": adopting writes, ``check_params``.

What is a write, how it is seen and what the masters do with it is
:mod:`zerofn.facade._guards`; a :class:`ParamWrites` threads the facade's state through
it: before anything reads or writes the optimizer state (``state_dict``, checkpoints,
loads), the masters follow what the user wrote, with a verdict every rank reaches alike;
and the explicit byte check for writes through ``p.data``. Each method takes the current
:class:`~zerofn.state.ZeroState` and returns the one to keep.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn.facade._entry import EntryGuard
from zerofn.facade._guards import ParamGuard, adopt_params, byte_report, byte_verdict, params_verdict
from zerofn.state import ZeroState

__all__ = ["ParamWrites"]


class ParamWrites:
    """The masters follow the params' writes (see the module docstring).

    Args:
      params: name -> the model's param (layout order).
      group: the sharding group (the verdicts are reached over it).
      guard: the facade's :class:`~zerofn.facade._guards.ParamGuard`.
      entry: the facade's :class:`~zerofn.facade._entry.EntryGuard` (collective entry points).
      wait_params: completes the param gathers in flight (``overlap_allgather``), so a
        param read here holds its updated value.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        group: comm.Group,
        guard: ParamGuard,
        entry: EntryGuard,
        wait_params: Callable[[], None],
    ) -> None:
        self._params, self._group, self._guard, self._entry = params, group, guard, entry
        self._wait_params = wait_params

    def enter(self, state: ZeroState, call: str) -> ZeroState:
        """A collective entry point ``call`` of the facade: every rank joins, then :meth:`fold`.

        Collectives: the entry wait (one monitored barrier, :mod:`zerofn.facade._entry`),
        then those of :meth:`fold`.
        """
        self._entry.join(call)  # a collective: every rank must call it (bounded wait)
        return self.fold(state, f"ZeroOptimizer.{call}")

    def fold(self, state: ZeroState, where: str) -> ZeroState:
        """Make the masters follow what the user wrote into the params since the last step, as ``step`` would.

        Called before anything reads or writes the optimizer state, so a checkpoint holds
        what the model holds. The same detection as ``step``
        (:meth:`~zerofn.facade._guards.ParamGuard.inspect`) and the same verdict, alike on
        every rank; a verdict that the ranks' params differ raises
        :class:`~zerofn.facade._guards.ParamsChangedError` on every rank, ``state`` kept.

        Collectives: one scalar all-reduce over the group (did any rank see a write?); only
        when some did, one object all-gather of the reports.
        """
        self._wait_params()
        report = self._guard.inspect()
        flag = torch.tensor([0.0 if report is None else 1.0], dtype=torch.float64, device=state.work_device)
        if float(comm.all_reduce_scalars(flag, "max", self._group)[0]) == 0.0:
            return state
        reports = comm_setup.all_gather_objects(report, self._group)
        adopt = params_verdict(reports, state.layout.names, where)  # type: ignore[arg-type]
        state = adopt_params(state, self._params, adopt)
        self._guard.record()
        return state

    def check(self, state: ZeroState) -> tuple[ZeroState, list[str]]:
        """``check_params``: the params that differ bitwise from their masters, taken into them.

        Returns the state to keep and the names whose masters changed (alike on every rank).

        Collectives: the entry wait, one object all-gather of each rank's differing names
        and a digest of every param (O(params) hashing on each rank).
        """
        self._entry.join("check_params")  # a collective: every rank must call it (bounded wait)
        self._wait_params()
        reports = comm_setup.all_gather_objects(byte_report(state, self._params), self._group)
        adopt = byte_verdict(reports, state.layout.names)  # type: ignore[arg-type]
        state = adopt_params(state, self._params, adopt)
        self._guard.record()
        return state, adopt

    def written(self) -> None:
        """The facade has just written every param (e.g. a checkpoint's weights): its write, not the user's."""
        self._guard.record()
