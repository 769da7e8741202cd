"""The states of :mod:`zerofn.optim`'s optimizers: :class:`SGDState` and :class:`AdamState`.

Built by the updates of :mod:`zerofn._optim_update`; import them from :mod:`zerofn.optim`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zerofn._tree import FrozenDict

__all__ = ["AdamState", "SGDState"]


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
      momentum_buffer: name -> buffer shaped like the param (fp32 master dtype), or
        ``None`` until the first step with ``momentum != 0`` (torch.optim's rule).
    """

    momentum_buffer: FrozenDict[torch.Tensor | None]


class AdamState(NamedTuple):
    """State of :func:`adam` and :func:`adamw`.

    Attributes:
      step: name -> 0-d float32 CPU tensor, steps taken by that param (as torch.optim).
      exp_avg: name -> first moment, shaped like the param.
      exp_avg_sq: name -> second moment, shaped like the param.
      max_exp_avg_sq: name -> running max of ``exp_avg_sq``; empty unless ``amsgrad``.
    """

    step: FrozenDict[torch.Tensor]
    exp_avg: FrozenDict[torch.Tensor]
    exp_avg_sq: FrozenDict[torch.Tensor]
    max_exp_avg_sq: FrozenDict[torch.Tensor]

    # Names with equal counts may share one count tensor (zerofn.flat's held_flat makes
    # them so): the updates copy a count before adding to it unless no other name holds it.
    shares_step_counts = True
