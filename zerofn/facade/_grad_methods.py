"""``ZeroOptimizer``'s gradient idioms: the global norm, clipping, one param's gradient, byte counts.

A mixin of :class:`~zerofn.facade.optimizer.ZeroOptimizer` (kept apart so the class reads
as construction + training loop). Where the gradients are (``p.grad`` at stage 1, shards
and a placeholder at stage 2) is :mod:`zerofn.facade._reducer`'s business; here they are
measured (:func:`~zerofn.stages.global_grad_norm`), clipped (:func:`~zerofn.precision.clip_coef`)
and shown, as ``torch.nn.utils.clip_grad_norm_`` and DDP users expect.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from zerofn import _comm as comm
from zerofn.facade._reducer import GradReducer, ShardedGrad
from zerofn.precision import clip_coef
from zerofn.stages import global_grad_norm
from zerofn.state import StepInfo, ZeroState

__all__ = ["GradMethods"]


class _Host(Protocol):
    """What the methods below read from the ZeroOptimizer they are mixed into."""

    _state: ZeroState
    _params: dict[str, torch.Tensor]
    _name_of: dict[int, str]
    _group: comm.Group
    _gather_how: str
    _norm_type: float
    _last_info: StepInfo | None
    _reducer: GradReducer
    _prefetch: Any

    def wait_params(self) -> None: ...

    def _current_grad_norm(self, norm_type: float) -> float: ...


class GradMethods:
    """``get_grad_norm`` / ``clip_grad_norm_`` / ``get_param_grad`` / ``grad_bytes`` / ``staging_bytes``."""

    def get_grad_norm(self: _Host) -> float | None:
        """The global norm of the true (unscaled) gradient: the current one, else the last step's.

        Between ``backward`` and ``step``: the norm of the averaged gradients now held
        (``p.grad`` at stage 1, as the user may have changed it; the shards at stage 2),
        divided by the loss scale, so fp16 users see the true norm, as after
        ``GradScaler.unscale_``. This is a **collective** (one all-reduce of three float64
        scalars over the group; with gradients left from ``no_sync`` micro-steps, their
        reduction first): call it on every rank. ``inf`` if an element is not finite.

        Otherwise (after ``step`` or ``zero_grad``): the norm the last ``step`` applied
        (before its clipping; ``inf`` after a step skipped for a non-finite gradient),
        ``None`` before the first step; no communication.
        """
        self.wait_params()
        if self._reducer.holds_grads():
            return self._current_grad_norm(self._norm_type)
        return None if self._last_info is None else self._last_info.grad_norm

    def _current_grad_norm(self: _Host, norm_type: float) -> float:
        """The norm of the gradients held now (a collective: one scalar all-reduce, after any pending reduction)."""
        self._reducer.settle()
        pieces, scale = self._reducer.norm_pieces()
        return global_grad_norm(pieces, self._group, norm_type=norm_type, scale=scale, device=self._state.work_device)

    def clip_grad_norm_(
        self: _Host, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the current gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

        Call it between ``backward`` and ``step``, on every rank, instead of
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``; it works at both
        stages (at stage 2 ``p.grad`` holds no values). The total norm is computed over the
        whole averaged gradient (every rank's shards, in float64), divided by the loss scale
        (the true norm, as after ``GradScaler.unscale_``); every gradient is multiplied by
        ``min(1, max_norm / (total_norm + 1e-6))`` (torch's factor): ``p.grad`` at stage 1
        (so ``step`` and any later inspection see the clipped values), the shards at
        stage 2. A non-finite norm leaves the gradients unchanged (``step`` then skips
        them, or raises with ``nonfinite="raise"``).

        Args:
          max_norm: the threshold (>= 0).
          norm_type: 2.0 or ``math.inf``.
          error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the norm is not finite.

        Returns:
          The total norm before clipping, a float32 0-d tensor on the params' device (as
          torch's function returns it); 0 when no gradient is held.

        Collectives: one all-reduce of three float64 scalars over the group (with gradients
        left from ``no_sync`` micro-steps, their reduction first).
        """
        if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm >= 0):
            raise ValueError(f"clip_grad_norm_: max_norm must be a finite number >= 0, got {max_norm!r}")
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        self.wait_params()
        device = self._state.work_device
        if not self._reducer.holds_grads():
            return torch.zeros((), dtype=torch.float32, device=device)
        total = self._current_grad_norm(norm_type)
        if not math.isfinite(total):
            if error_if_nonfinite:
                raise RuntimeError(
                    f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite, so it "
                    "cannot be clipped; set error_if_nonfinite=False to leave them unchanged (step then skips them)"
                )
        else:
            coef = clip_coef(total, float(max_norm))
            if coef < 1.0:
                self._reducer.scale_grads_(coef)
        return torch.tensor(total, dtype=torch.float32, device=device)

    def get_param_grad(self: _Host, param: torch.Tensor) -> torch.Tensor | None:
        """The full averaged gradient of ``param`` since the last step, unscaled, or None.

        The true gradient (divided by the loss scale under fp16 loss scaling), what ``step``
        would apply before clipping. Stage 1: a copy of ``p.grad`` as the user left it, no
        communication. Stage 2: a **collective**: every rank of the group must call it for
        the same param (one gather of the param's shards); in the shards' dtype (the
        accumulation dtype after ``no_sync`` micro-steps).
        """
        name = self._name_of.get(id(param))
        if name is None:
            raise KeyError("get_param_grad: this tensor is not one of the optimizer's params")
        self.wait_params()
        self._reducer.settle()
        return self._reducer.full_grad(name, self._gather_how)

    def grad_bytes(self: _Host) -> int:
        """Bytes this rank holds for gradients right now: ``p.grad``, accumulators, buckets in flight, shards.

        Not counted: the idle staging buffers kept for reuse between steps (:meth:`staging_bytes`).
        """
        held = [p.grad for p in self._params.values() if p.grad is not None and type(p.grad) is not ShardedGrad]
        return sum(g.numel() * g.element_size() for g in held) + self._reducer.grad_bytes()

    def staging_bytes(self: _Host) -> int:
        """Bytes of the reusable bucket staging buffers held now, idle or in flight.

        Per dtype up to three ``(N, S)`` gradient buffers with ``overlap_communication``,
        else one (each ``max(reduce_bucket_size, N·S)`` elements); with
        ``overlap_allgather`` also each multi-param bucket's ``(S,)`` send row (at most
        Ψ/N working-dtype elements in all). ``close()`` frees them.
        """
        rows = self._prefetch.row_bytes() if self._prefetch is not None else 0
        return self._reducer.staging_bytes() + rows
