"""``ZeroOptimizer.step``'s parts: hand the reduced shards to ``step_shards``, then write the params back.

A :class:`Stepper` holds what a step needs (the reducer, the guard, the groups, the
clipping settings, the compiled step or the prefetcher) and owns no math: the update is
:func:`~zerofn.step_shards` with ``donate=True`` (the facade owns its state, so no step
doubles the optimizer-state memory) or ``compile=``'s graph, and the write-back is
:func:`~zerofn.gather_params` into the model's params (``out=``), or the
:class:`~zerofn.facade._prefetch.ParamPrefetcher`'s gathers for the next forward.

When the user wrote params since the last step (the guard's report, the step's veto),
``step_shards`` applies nothing and every rank reaches the same verdict
(:func:`~zerofn.facade._guards.params_verdict`): the masters follow the written params and
the step runs again, or every rank raises
:class:`~zerofn.facade._guards.ParamsChangedError` with the gradients kept for a later
``step``. :meth:`Stepper.attempt` returns after one try, so the facade keeps the adopted
state even when the second try raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn._comm import CommPolicy
from zerofn.facade._compiled import CompiledStep
from zerofn.facade._guards import ParamGuard, adopt_params, params_verdict
from zerofn.facade._hyperparams import LiveHyperparams
from zerofn.facade._prefetch import ParamPrefetcher
from zerofn.facade._reducer import GradReducer
from zerofn.stages import StepVetoed, gather_params, step_shards
from zerofn.state import StepInfo, ZeroState

__all__ = ["Stepper"]

log = logging.getLogger("zerofn")

NO_GRADS_MESSAGE = (
    "ZeroOptimizer.step: no gradients since the last step or zero_grad(). Call "
    "optimizer.backward(loss) (or loss.backward()) outside no_sync() before step()."
)


class Stepper:
    """One facade's step: :meth:`prepare`, :meth:`attempt` (again after a veto), :meth:`write_back`.

    Args:
      params: name -> the model's param (layout order).
      group: the sharding group.
      reducer: the facade's gradient reducer (its shards are the step's input).
      guard: the facade's param guard (writes made outside the facade).
      hyperparams: the live ``param_groups`` hyperparameters.
      max_norm: the clip threshold or ``None``; norm_type: 2.0 or ``math.inf``.
      bucket_numel: the gathers' bucket size; comm_policy: collective realisations.
      compiled: ``compile=``'s step, or ``None``.
      prefetch: ``overlap_allgather``'s prefetcher, or ``None``.
      verbose: log skipped steps.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        group: comm.Group,
        reducer: GradReducer,
        guard: ParamGuard,
        hyperparams: LiveHyperparams,
        *,
        max_norm: float | None,
        norm_type: float,
        bucket_numel: int,
        comm_policy: CommPolicy,
        compiled: CompiledStep | None,
        prefetch: ParamPrefetcher | None,
        verbose: bool,
    ) -> None:
        self._params, self._group, self._reducer, self._guard = params, group, reducer, guard
        self._hyperparams = hyperparams
        self._max_norm, self._norm_type = max_norm, norm_type
        self._bucket_numel, self._comm_policy = bucket_numel, comm_policy
        self._compiled, self._prefetch, self._verbose = compiled, prefetch, verbose

    def prepare(self) -> dict[str, Any] | None:
        """Before a step: the params' structure checked, the gradients reduced; this rank's veto.

        Raises ``RuntimeError`` on every rank when no gradient arrived since the last step.
        Collectives: with gradients left by ``no_sync`` micro-steps (or set by hand), their
        reduction (see :meth:`GradReducer.settle`).
        """
        self._guard.check_structure("ZeroOptimizer.step")  # before reduce_local reads moved/cast grads
        self._reducer.settle()  # local gradients left by no_sync() micro-steps, or set by hand
        if not self._reducer.holds_grads():
            raise RuntimeError(NO_GRADS_MESSAGE)
        return self._guard.inspect()

    def attempt(
        self, state: ZeroState, param_groups: list[dict[str, Any]], veto: dict[str, Any] | None
    ) -> tuple[ZeroState, StepInfo | None]:
        """``step_shards`` on the reduced shards, with ``veto`` (this rank's report of changed params).

        Returns the new state and its info; or, when some rank vetoed, the state whose
        masters took the written params and ``None`` (nothing applied, the shards given
        back: call again with no veto). Collectives: one scalar all-reduce (norm,
        overflow, veto); on a veto, one object all-gather of the reports.
        """
        state = self._hyperparams.apply(state, param_groups)
        shards = self._reducer.step_grads.take_step_grads()  # stage 1: p.grad as the user left it, cut into shards
        wire = self._reducer.wire  # a compressed wire: the residual of the reductions since the last step
        vetoed = False
        try:
            if self._compiled is not None and veto is None:  # with a veto: the eager step, whose collectives match
                return self._compiled(state, shards, self._params)
            residual = wire.residual_for_step(state) if wire is not None else None
            return step_shards(
                state,
                shards,
                self._group,
                self._max_norm,
                norm_type=self._norm_type,
                donate=True,
                veto=veto,
                residual=residual,
            )
        except StepVetoed as e:
            vetoed = True  # the gradients (and their residual) wait for the step that follows
            self._reducer.step_grads.give_back(shards)
            adopt = params_verdict(e.vetoes, state.layout.names)  # type: ignore[arg-type]
        finally:
            if wire is not None and not vetoed:  # the new state holds it (skipped: the old one, rescaled)
                wire.forget()
        # ``state`` carries the live hyperparameters (cached by LiveHyperparams): keep it.
        state = adopt_params(state, self._params, adopt)
        self._guard.record()
        return state, None

    def write_back(self, state: ZeroState, info: StepInfo, old_scale: torch.Tensor) -> None:
        """The stepped masters into the model's params: gathered now, or by the next forward.

        Collectives: the bucketed all-gather of the params (launched here and completed
        by the next forward with ``overlap_allgather``; inside the graph with ``compile=``);
        none for a skipped step.
        """
        if self._compiled is not None:  # it copied the gathered params in (a skipped step: the values they held)
            self._guard.record()
        if info.skipped:
            if self._verbose:
                scales = float(old_scale), float(state.loss_scale.scale)
                log.info(
                    "zerofn: non-finite gradient (norm %s); step skipped, loss scale %s -> %s", info.grad_norm, *scales
                )
            return
        if self._compiled is not None:
            return
        if self._prefetch is not None:  # written into the params by the next forward (or wait_params)
            self._prefetch.launch(state)
            return
        # The layout and bucket size were confirmed on every rank at construction.
        gather_params(
            state,
            self._group,
            bucket_numel=self._bucket_numel,
            comm_policy=self._comm_policy,
            out=self._params,
            check=False,
            staging=self._reducer.staging,  # idle between step and the next backward
        )
        self._guard.record()
