"""``ZeroOptimizer``'s gradient idioms: backward, ``zero_grad``, ``no_sync``, the global norm, clipping.

Where the gradients are (``p.grad`` at stage 1, shards and a placeholder at stage 2) is
:mod:`zerofn.facade._reducer`'s business; a :class:`GradOps` starts the backward (the loss
times the state's loss scale), forgets gradients, and measures
(:func:`~zerofn.stages.global_grad_norm`), clips (:func:`~zerofn.precision.clip_coef`) and
shows them, as ``torch.nn.utils.clip_grad_norm_`` and DDP users expect. The facade's
public methods of the same names delegate here and carry the user-facing docs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch

from zerofn import _comm as comm
from zerofn.facade._guards import ParamGuard
from zerofn.facade._prefetch import ParamPrefetcher
from zerofn.facade._reducer import GradReducer
from zerofn.facade._sharded_grad import ShardedGrad
from zerofn.precision import clip_coef, scale_loss
from zerofn.stages import global_grad_norm
from zerofn.state import StepInfo, ZeroState

__all__ = ["GradOps"]


class GradOps:
    """The gradient side of the facade (see the module docstring).

    Args:
      params: name -> the model's param (layout order).
      reducer: the facade's gradient reducer.
      guard: the facade's param guard (a moved, cast or replaced param is refused first).
      group: the sharding group; gather_how: the realisation of one gradient's gather.
      norm_type: the facade's ``norm_type`` (for :meth:`grad_norm`).
      prefetch: ``overlap_allgather``'s prefetcher (whose gathers a read waits for), or ``None``.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        reducer: GradReducer,
        guard: ParamGuard,
        group: comm.Group,
        *,
        gather_how: str,
        norm_type: float,
        prefetch: ParamPrefetcher | None,
    ) -> None:
        self._params, self._reducer, self._guard, self._group = params, reducer, guard, group
        self._name_of = {id(p): n for n, p in params.items()}
        self._gather_how, self._norm_type, self._prefetch = gather_how, norm_type, prefetch

    def wait_params(self) -> None:
        """Complete the param gathers the last ``step`` left in flight (none without ``overlap_allgather``)."""
        if self._prefetch is not None:
            self._prefetch.wait()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """No gradient communication inside; the reducer accumulates locally."""
        old = self._reducer.require_sync
        self._reducer.require_sync = False
        try:
            yield
        finally:
            self._reducer.require_sync = old

    def before_backward(self, state: ZeroState, x: torch.Tensor, where: str) -> torch.Tensor:
        """Before a backward of ``x`` (a loss, or the gradient given to ``autograd.backward``): ``x`` scaled.

        The params' structure is checked and pending gathers written first; ``x`` comes
        back unchanged under ``NoLossScaling`` (a scale of 1.0 forever).
        """
        self._guard.check_structure(where)  # a moved/cast/replaced param: say what to do
        # Pending gathers here mean a forward ran outside the model's hooks and read old params: writing
        # them now makes autograd refuse the saved tensors (modified in place) instead of training on them.
        self.wait_params()
        if not state.precision.scales_loss:
            return x
        return scale_loss(x, state.loss_scale)

    def zero_grad(self, set_to_none: bool) -> None:
        """``p.grad`` set to ``None`` (or zeroed; a placeholder removed), the reducer's gradients forgotten."""
        # Params may be pending (overlap_allgather's guard): .grad reads no values, skip their check.
        with torch._C.DisableTorchFunctionSubclass():
            for p in self._params.values():
                g = p.grad
                if g is None:
                    continue
                if set_to_none or type(g) is ShardedGrad:
                    p.grad = None
                else:
                    g.detach_()
                    g.zero_()
        self._reducer.clear()

    def grad_norm(self, state: ZeroState, last: StepInfo | None) -> float | None:
        """The current gradients' global norm (a collective), else the last step's (``None`` before one)."""
        self.wait_params()
        if self._reducer.holds_grads():
            return self.current_norm(state, self._norm_type)
        return None if last is None else last.grad_norm

    def current_norm(self, state: ZeroState, norm_type: float) -> float:
        """The norm of the gradients held now (a collective: one scalar all-reduce, after any pending reduction)."""
        self._reducer.settle()
        pieces, scale = self._reducer.step_grads.norm_pieces()
        return global_grad_norm(pieces, self._group, norm_type=norm_type, scale=scale, device=state.work_device)

    def clip_(self, state: ZeroState, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_grad_norm_``: the total norm (float32 0-d tensor on the work device), the gradients clipped."""
        if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm >= 0):
            raise ValueError(f"clip_grad_norm_: max_norm must be a finite number >= 0, got {max_norm!r}")
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or math.inf, got {norm_type!r}")
        self.wait_params()
        device = state.work_device
        if not self._reducer.holds_grads():
            return torch.zeros((), dtype=torch.float32, device=device)
        total = self.current_norm(state, norm_type)
        if not math.isfinite(total):
            if error_if_nonfinite:
                raise RuntimeError(
                    f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite, so it "
                    "cannot be clipped; set error_if_nonfinite=False to leave them unchanged (step then skips them)"
                )
        else:
            coef = clip_coef(total, float(max_norm))
            if coef < 1.0:
                self._reducer.step_grads.scale_grads_(coef)
        return torch.tensor(total, dtype=torch.float32, device=device)

    def param_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``get_param_grad``: one param's full averaged gradient (a collective at stage 2)."""
        name = self._name_of.get(id(param))
        if name is None:
            raise KeyError("get_param_grad: this tensor is not one of the optimizer's params")
        self.wait_params()
        self._reducer.settle()
        return self._reducer.full_grad(name, self._gather_how)

    def grad_bytes(self) -> int:
        """Bytes held for gradients: real ``p.grad`` tensors and the reducer's."""
        held = [p.grad for p in self._params.values() if p.grad is not None and type(p.grad) is not ShardedGrad]
        return sum(g.numel() * g.element_size() for g in held) + self._reducer.grad_bytes()

    def staging_bytes(self) -> int:
        """Bytes of the reducer's staging buffers and the prefetcher's send rows."""
        rows = self._prefetch.row_bytes() if self._prefetch is not None else 0
        return self._reducer.staging_bytes() + rows
