"""The loss scalers of :mod:`zerofn.precision`, each a pure state machine.

:class:`LossScaleState` (the state, a pytree of three numbers), the :class:`LossScaler`
interface, the scalers :class:`DynamicLossScaler`, :class:`StaticLossScaler` and
:class:`NoLossScaling`, and :func:`scale_loss`. They know nothing of dtypes, so they live
apart from the dtype policy and the unscale and clip helpers in ``precision.py``. Import
them from :mod:`zerofn.precision`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

__all__ = [
    "DynamicLossScaler",
    "LossScaleState",
    "LossScaler",
    "NoLossScaling",
    "StaticLossScaler",
    "scale_loss",
]


class LossScaleState(NamedTuple):
    """State of a loss scaler; a pytree of three numbers, Python or 0-d tensors.

    A scaler's ``init`` returns Python numbers, and ``update`` on them is host arithmetic.
    A :class:`~zerofn.ZeroState` holds them as 0-d tensors (float64 scale, int64 counters,
    on the params' device), as ``torch.optim`` keeps its ``step``: a compiled step reads
    them as inputs (a skipped step is a ``torch.where``, the scale moves without
    recompiling) and the same step body runs eagerly. ``update`` on tensors is tensor math
    whose float64 products round as the Python floats do: the same trajectory. With
    power-of-two factors (the defaults) every scale is a power of two, exact in float32 and
    float64 alike.

    Attributes:
      scale: the current loss scale, ``> 0``; the loss is multiplied by it before backward.
      growth_tracker: consecutive non-overflowing steps since the last growth or overflow,
        in ``[0, growth_interval)``.
      hysteresis_left: the countdown to the overflow that backs the scale off, in
        ``[0, hysteresis]``: each overflow lowers it by one (not below 0), and the
        overflow that meets it at ``<= 1`` backs off. Refilled when the scale grows.
    """

    scale: float | torch.Tensor
    growth_tracker: int | torch.Tensor
    hysteresis_left: int | torch.Tensor


@runtime_checkable
class LossScaler(Protocol):
    """The interface step code uses for every scaler: two pure functions."""

    def init(self) -> LossScaleState:
        """The state before the first step."""
        ...

    def update(self, state: LossScaleState, found_overflow: bool) -> LossScaleState:
        """The state after a step whose gradients did (or did not) overflow."""
        ...


def _check_positive_finite(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: {name} must be a positive finite number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DynamicLossScaler:
    r"""Dynamic loss scaling: back off on overflow, grow after a run of good steps.

    The state is :math:`(s, g, h)` = (``scale``, ``growth_tracker``, ``hysteresis_left``),
    starting at :math:`(s_0, 0, H)`. Each step is either an overflow (some gradient
    element on some rank is ``inf`` or ``nan``, decided by all ranks together) or not:

    .. math::

        \text{overflow:}\quad & g' = 0,\quad h' = \max(h - 1, 0),\quad
            s' = \begin{cases} \max(\beta s,\ s_{\min}) & h \le 1 \\
                               s & \text{otherwise} \end{cases} \\
        \text{no overflow:}\quad & \text{if } g + 1 = G:\ (s', g', h') =
            (\min(\gamma s,\ s_{\max}),\ 0,\ H) \\
            & \text{else}:\ (s', g', h') = (s,\ g + 1,\ h)

    with :math:`\gamma` = ``growth_factor``, :math:`\beta` = ``backoff_factor``,
    :math:`G` = ``growth_interval``, :math:`H` = ``hysteresis``.

    Things worth knowing about this rule:

    - hysteresis is refilled only when the scale *grows*, not after every good step, and
      not after a backoff: once ``hysteresis`` overflows have happened since the last
      growth, every further overflow backs off, even after good steps in between;
    - an overflow resets the growth tracker even when hysteresis absorbs it;
    - ``hysteresis`` 0 and 1 behave alike: every overflow backs off;
    - at ``max_scale`` the growth still resets the tracker and refills hysteresis.

    The step whose gradients overflowed is skipped regardless of whether the scale moved.

    Args:
      initial_scale: :math:`s_0`, in ``[min_scale, max_scale]``.
      min_scale: :math:`s_{\min} > 0`, the floor of a backoff.
      growth_factor: :math:`\gamma > 1`.
      backoff_factor: :math:`\beta \in (0, 1)`.
      growth_interval: :math:`G \ge 1` consecutive good steps before the scale grows.
      hysteresis: :math:`H \ge 0`: the ``H``-th overflow since the last growth backs the
        scale off, and so does every later one until the next growth (``H`` 0 or 1: the
        first overflow already does).
      max_scale: :math:`s_{\max}`, the ceiling of a growth; ``math.inf`` for none.

    Examples:
      >>> scaler = DynamicLossScaler(initial_scale=8.0, growth_interval=2, hysteresis=2)
      >>> s = scaler.init(); s
      LossScaleState(scale=8.0, growth_tracker=0, hysteresis_left=2)
      >>> s = scaler.update(s, found_overflow=True); s  # absorbed by hysteresis
      LossScaleState(scale=8.0, growth_tracker=0, hysteresis_left=1)
      >>> s = scaler.update(s, found_overflow=True); s  # backs off
      LossScaleState(scale=4.0, growth_tracker=0, hysteresis_left=0)
      >>> s = scaler.update(s, False); s
      LossScaleState(scale=4.0, growth_tracker=1, hysteresis_left=0)
      >>> s = scaler.update(s, False); s  # grows, hysteresis refilled
      LossScaleState(scale=8.0, growth_tracker=0, hysteresis_left=2)
    """

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        who = "DynamicLossScaler"
        _check_positive_finite(who, "initial_scale", self.initial_scale)
        _check_positive_finite(who, "min_scale", self.min_scale)
        if not (isinstance(self.max_scale, (int, float)) and self.max_scale > 0):
            msg = f"max_scale must be positive (math.inf: no ceiling), got {self.max_scale!r}"
            raise ValueError(f"{who}: {msg}")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"{who}: need min_scale <= initial_scale <= max_scale, "
                f"got min_scale={self.min_scale!r}, "
                f"initial_scale={self.initial_scale!r}, max_scale={self.max_scale!r}"
            )
        _check_positive_finite(who, "growth_factor", self.growth_factor)
        if not self.growth_factor > 1:
            msg = f"growth_factor must be > 1 (the scale must grow), got {self.growth_factor!r}"
            raise ValueError(f"{who}: {msg}")
        _check_positive_finite(who, "backoff_factor", self.backoff_factor)
        if not self.backoff_factor < 1:
            msg = f"backoff_factor must be in (0, 1) (it must shrink), got {self.backoff_factor!r}"
            raise ValueError(f"{who}: {msg}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__}")
        if self.growth_interval < 1:
            raise ValueError(f"{who}: growth_interval must be >= 1, got {self.growth_interval!r}")
        if self.hysteresis < 0:
            raise ValueError(f"{who}: hysteresis must be >= 0, got {self.hysteresis!r}")

    def init(self) -> LossScaleState:
        """The state before the first step: ``(initial_scale, 0, hysteresis)``."""
        return LossScaleState(float(self.initial_scale), 0, self.hysteresis)

    def update(self, state: LossScaleState, found_overflow: bool) -> LossScaleState:
        """The state after one step; see the class docstring for the rule.

        Args:
          state: from :meth:`init` or a previous :meth:`update`.
          found_overflow: whether any gradient element on any rank of the data-parallel
            group was not finite. Every rank must pass the same value (all-reduce it).

        Returns:
          A new :class:`LossScaleState`; ``state`` is not changed.
        """
        scale, tracker, left = state
        if isinstance(found_overflow, torch.Tensor) or isinstance(scale, torch.Tensor):
            return self._update_tensors(state, found_overflow)
        if found_overflow:
            if left <= 1:
                scale = max(scale * self.backoff_factor, float(self.min_scale))
            return LossScaleState(scale, 0, max(left - 1, 0))
        tracker += 1
        if tracker == self.growth_interval:
            grown = min(scale * self.growth_factor, float(self.max_scale))
            return LossScaleState(grown, 0, self.hysteresis)
        return LossScaleState(scale, tracker, left)

    def _update_tensors(self, state: LossScaleState, found: torch.Tensor | bool) -> LossScaleState:
        """:meth:`update` as tensor math (``torch.where``, no host sync).

        ``state``'s fields are 0-d tensors (float64 scale, int64 counters, as a
        :class:`~zerofn.ZeroState` holds them); ``found`` a 0-d bool tensor (a compiled
        step), or a Python bool (an eager step, which then computes one branch only). The
        float64 products round as the Python floats of :meth:`update` do: the same trajectory.
        """
        scale, tracker, left = state
        if isinstance(found, bool):
            if found:
                backed = torch.clamp(scale * self.backoff_factor, min=float(self.min_scale))
                return LossScaleState(
                    torch.where(left <= 1, backed, scale), torch.zeros_like(tracker), torch.clamp(left - 1, min=0)
                )
            ticked = tracker + 1
            grow = ticked == self.growth_interval
            grown = torch.clamp(scale * self.growth_factor, max=float(self.max_scale))
            return LossScaleState(
                torch.where(grow, grown, scale),
                torch.where(grow, torch.zeros_like(tracker), ticked),
                torch.where(grow, torch.full_like(left, self.hysteresis), left),
            )
        backed = torch.clamp(scale * self.backoff_factor, min=float(self.min_scale))
        over_scale = torch.where(left <= 1, backed, scale)
        ticked = tracker + 1
        grow = ticked == self.growth_interval
        grown = torch.clamp(scale * self.growth_factor, max=float(self.max_scale))
        new_scale = torch.where(found, over_scale, torch.where(grow, grown, scale))
        new_tracker = torch.where(found | grow, torch.zeros_like(tracker), ticked)
        hysteresis = torch.full_like(left, self.hysteresis)
        new_left = torch.where(found, torch.clamp(left - 1, min=0), torch.where(grow, hysteresis, left))
        return LossScaleState(new_scale, new_tracker, new_left)


@dataclasses.dataclass(frozen=True)
class StaticLossScaler:
    """A constant loss scale: overflowing steps are skipped, the scale never moves.

    Args:
      scale: the loss scale, a positive finite number.

    Examples:
      >>> scaler = StaticLossScaler(128.0)
      >>> scaler.update(scaler.init(), found_overflow=True)
      LossScaleState(scale=128.0, growth_tracker=0, hysteresis_left=0)
    """

    scale: float = 2.0**16

    def __post_init__(self) -> None:
        _check_positive_finite("StaticLossScaler", "scale", self.scale)

    def init(self) -> LossScaleState:
        """``(scale, 0, 0)``."""
        return LossScaleState(float(self.scale), 0, 0)

    def update(self, state: LossScaleState, found_overflow: bool) -> LossScaleState:
        """Returns ``state`` unchanged (the counters stay zero)."""
        del found_overflow
        return state


@dataclasses.dataclass(frozen=True)
class NoLossScaling:
    """No loss scaling (bf16 and fp32): the scale is 1.0 forever.

    What a non-finite gradient does then is :attr:`PrecisionPolicy.nonfinite`'s choice.

    Examples:
      >>> NoLossScaling().init()
      LossScaleState(scale=1.0, growth_tracker=0, hysteresis_left=0)
    """

    def init(self) -> LossScaleState:
        """``(1.0, 0, 0)``."""
        return LossScaleState(1.0, 0, 0)

    def update(self, state: LossScaleState, found_overflow: bool) -> LossScaleState:
        """Returns ``state`` unchanged."""
        del found_overflow
        return state


def scale_loss(loss: torch.Tensor, state: LossScaleState) -> torch.Tensor:
    r"""The loss to call ``backward`` on: :math:`s \cdot \text{loss}`.

    Gradients of the result are the true gradients times ``state.scale``. ``loss`` is not
    changed; the result is a new tensor in the autograd graph.

    Args:
      loss: the loss tensor (any shape; usually 0-d).
      state: the current loss-scale state.

    Returns:
      ``loss * state.scale``.

    Examples:
      >>> scale_loss(torch.tensor(0.5), LossScaleState(1024.0, 0, 2))
      tensor(512.)
    """
    return loss * state.scale
