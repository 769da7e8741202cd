"""``ZeroOptimizer``'s side of "the params are the user's": adopting writes, ``check_params``.

A mixin of :class:`~zerofn.facade.optimizer.ZeroOptimizer` (kept apart so the class reads
as construction + training loop). What is a write, how it is seen and what the masters do
with it is :mod:`zerofn.facade._guards`; here the optimizer threads its state through it:
the step's veto, the verdict every rank reaches alike, and the explicit byte check for
writes through ``p.data``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zerofn import _comm as comm
from zerofn import optim
from zerofn.facade import _guards
from zerofn.stages import StepVetoed, step_shards
from zerofn.state import StepInfo, ZeroState

__all__ = ["ParamMethods"]


class _Host(Protocol):
    """What the methods below read from the ZeroOptimizer they are mixed into."""

    _state: ZeroState
    _params: dict[str, torch.Tensor]
    _group: comm.Group
    _max_norm: float | None
    _norm_type: float
    _reducer: Any
    _guard: _guards.ParamGuard
    _entry: Any
    _compiled: Any

    def wait_params(self) -> None: ...

    def _current_optimizer(self) -> optim.Optimizer: ...

    def _step_shards(self, veto: dict[str, Any] | None) -> tuple[ZeroState, StepInfo]: ...

    def check_params(self) -> list[str]: ...


class ParamMethods:
    """``check_params`` / ``update_master_params``, the step's veto when params were written, and
    the maps between model params and master shards."""

    def _step_shards(self: _Host, veto: dict[str, Any] | None) -> tuple[ZeroState, StepInfo]:
        """``step_shards`` on the reduced shards, with this rank's report of changed params as its veto.

        Without changes (the common case) this is one ``step_shards`` call. If any rank saw
        its params changed, ``step_shards`` applies nothing and every rank gets every rank's
        report (in the all-gather it makes for that); all decide alike
        (:func:`~._guards.params_verdict`): the masters follow the changed params, and the
        step runs again (one more scalar all-reduce), or every rank raises
        :class:`~._guards.ParamsChangedError` with the gradients kept for a later ``step``.
        """
        state = self._state.replace(optimizer=self._current_optimizer())
        shards = self._reducer.take_step_grads()  # stage 1: p.grad as the user left it, cut into shards
        try:
            if self._compiled is not None and veto is None:  # with a veto: the eager step, whose collectives match
                return self._compiled(state, shards, self._params)
            return step_shards(
                state, shards, self._group, self._max_norm, norm_type=self._norm_type, donate=True, veto=veto
            )
        except StepVetoed as e:
            self._reducer.give_back(shards)  # nothing was applied: they wait for the step that follows
            adopt = _guards.params_verdict(e.vetoes, self._state.layout.names)  # type: ignore[arg-type]
        # ``state`` carries the live hyperparameters (cached by _current_optimizer): keep it.
        self._state = _guards.adopt_params(state, self._params, adopt)
        self._guard.record()
        return self._step_shards(None)

    def _fold_writes(self: _Host, where: str) -> None:
        """Make the masters follow what the user wrote into the params since the last step, as ``step`` would.

        Called before anything reads or writes the optimizer state (``state_dict``,
        ``save_checkpoint``, ``load_checkpoint``, ``load_state_dict``), so a checkpoint holds
        what the model holds. The same detection as ``step`` (:meth:`~._guards.ParamGuard.inspect`)
        and the same verdict, alike on every rank.

        Collectives: one scalar all-reduce over the group (did any rank see a write?); only
        when some did, one object all-gather of the reports.
        """
        self.wait_params()
        report = self._guard.inspect()
        flag = torch.tensor([0.0 if report is None else 1.0], dtype=torch.float64, device=self._state.work_device)
        if float(comm.all_reduce_scalars(flag, "max", self._group)[0]) == 0.0:
            return
        reports = comm.all_gather_objects(report, self._group)
        adopt = _guards.params_verdict(reports, self._state.layout.names, where)  # type: ignore[arg-type]
        self._state = _guards.adopt_params(self._state, self._params, adopt)
        self._guard.record()

    def _params_written(self: _Host) -> None:
        """The facade has just written every param (e.g. a checkpoint's weights): its write, not the user's."""
        self._guard.record()

    def check_params(self: _Host) -> list[str]:
        """Find params written without moving their version counter, and make the masters follow them.

        ``step`` notices every write that moves a param's version counter
        (``model.load_state_dict``, ``p.copy_``, in-place ops under ``no_grad``). Writes through
        ``p.data`` (``p.data.copy_(x)``, ``p.data.clamp_(-c, c)``) do not move it: call this after
        such code. It compares, bitwise, each param's part on this rank with the master
        rounded to the working dtype and takes the params that differ on any rank (as
        ``step`` does, see :mod:`zerofn.facade._guards` for the precision rule).

        Returns:
          The names of the params whose masters were updated (the same on every rank).

        Raises:
          ParamsChangedError: on every rank, when the ranks' params are not equal (nothing changed).

        Collectives: the entry wait (one monitored barrier, :mod:`zerofn.facade._entry`),
        one object all-gather of each rank's differing names and a digest of
        every param (each rank hashes all its params: O(params) work, not for every step).
        With ``overlap_allgather`` it first completes the pending gathers (``wait_params``).
        """
        self._entry.join("check_params")  # a collective: every rank must call it (bounded wait)
        self.wait_params()
        reports = comm.all_gather_objects(_guards.byte_report(self._state, self._params), self._group)
        adopt = _guards.byte_verdict(reports, self._state.layout.names)  # type: ignore[arg-type]
        self._state = _guards.adopt_params(self._state, self._params, adopt)
        self._guard.record()
        return adopt

    def update_master_params(self: _Host, model: torch.nn.Module | None = None) -> None:
        """Make the masters follow the model's current params (after editing weights); every rank calls it.

        For float32 params with float32 masters the masters become the params exactly; with
        bf16/fp16 params, master elements that still round to the param keep their extra
        precision and the others take the param's value (:mod:`zerofn.facade._guards`).
        The optimizer state is kept, as torch keeps it when weights are loaded.

        Raises:
          ParamsChangedError: on every rank, when the ranks' params are not equal (nothing changed).

        Collectives: as :meth:`check_params`, which it is.
        """
        del model  # the facade already holds the model's param tensors
        self.check_params()

    def get_working_to_master_map(self: _Host) -> dict[int, torch.Tensor]:
        """``id(model param) -> this rank's master`` for the params this rank holds a master of
        (1-D shards of split params, full-shaped whole params it owns; fp32 unless
        ``master_weights=False``)."""
        master = self._state.master
        return {id(p): master[n] for n, p in self._params.items() if n in master}

    def get_master_to_working_map(self: _Host) -> dict[int, torch.Tensor]:
        """``id(master) -> model param``, for the masters this rank holds."""
        master = self._state.master
        return {id(master[n]): p for n, p in self._params.items() if n in master}
