"""The global gradient norm over the group: one scalar all-reduce.

What the facade's ``clip_grad_norm_`` and ``get_grad_norm`` report (``step_shards`` packs
the same three scalars in its own body).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from zerofn import _comm as comm
from zerofn._comm import Group
from zerofn._norm import local_norm_term
from zerofn.precision import unscaled_norm


def _global_norm(
    grad_shards: Mapping[str, torch.Tensor],
    norm_type: float,
    group: Group,
    device: torch.device,
    *,
    rejected: bool = False,
) -> tuple[float, bool]:
    """Global ``norm_type`` norm of the mean gradient over the group, accumulated in float64.

    Padding is zero, so summing over padded shards equals the norm of the full grads.
    The norm is ``inf`` if any rank holds a non-finite gradient element: the second value
    all-reduced is that flag, so every rank learns it from the same collective. The third
    is ``rejected`` (this rank found its input invalid); the second return value tells
    whether any rank did.
    Collectives: one ``all_reduce`` of three float64 values, on ``device``.
    """
    local = local_norm_term(grad_shards.values(), norm_type, device)
    finite = bool(torch.isfinite(local))
    packed = torch.stack(
        [
            local if finite else torch.zeros_like(local),
            torch.tensor(0.0 if finite else 1.0, dtype=torch.float64, device=device),
            torch.tensor(float(rejected), dtype=torch.float64, device=device),
        ]
    )
    total = comm.all_reduce_scalars(packed, "max" if norm_type == math.inf else "sum", group).tolist()
    if total[1] > 0:
        return math.inf, total[2] > 0
    return (math.sqrt(total[0]) if norm_type == 2.0 else total[0]), total[2] > 0


def global_grad_norm(
    grad_shards: Mapping[str, torch.Tensor],
    group: Group = None,
    *,
    norm_type: float = 2.0,
    scale: float = 1.0,
    device: torch.device | str = "cpu",
) -> float:
    """The global ``norm_type`` norm of the true gradient, from every rank's pieces of it.

    The same norm ``step_shards`` computes (float64, padding zero, ``inf`` when any rank
    holds a non-finite element), without a step: what ``clip_grad_norm_`` and
    ``get_grad_norm`` report between backward and step.

    Args:
      grad_shards: name -> this rank's piece of each mean gradient (shards from
        :func:`reduce_grads`, or views of the owned range of full gradients); any shapes.
        Together the ranks' pieces must cover each gradient exactly once.
      group: the sharding process group (``None``: default).
      norm_type: 2.0 or ``math.inf``.
      scale: the loss scale the pieces carry (1.0: none); the result is divided by it.
      device: where the scalars go (the params' device).

    Returns:
      The unscaled norm as a Python float, equal on every rank; ``inf`` if any element is
      not finite.

    Collectives: one ``all_reduce`` of three float64 values over ``group``.
    """
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"global_grad_norm: norm_type must be 2.0 or math.inf, got {norm_type!r}")
    norm, _ = _global_norm(grad_shards, norm_type, group, torch.device(device))
    return unscaled_norm(norm, scale)
