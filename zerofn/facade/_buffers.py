"""The model's buffers as DDP keeps them: rank 0's, broadcast before each forward.

A module's buffers (BatchNorm's ``running_mean`` / ``running_var`` / ``num_batches_tracked``)
are not trained by the optimizer, but each rank's forward changes them from its own batch,
so the ranks drift apart and evaluate differently. DDP's default (``broadcast_buffers=True``)
broadcasts rank 0's buffers at construction and before every forward that follows a
training forward (a forward with gradients enabled, outside ``no_sync``); the facade does
the same when it knows the module (``module=``), over the whole data-parallel world of a
hybrid layout. ``broadcast_buffers=False`` is DDP's opt-out: each rank keeps its own
buffers, also at construction.

Cost, per training forward: one ``broadcast`` per buffer dtype (float32 running stats and
int64 counters: two) of all the module's buffers at once, and a walk over
``module.named_buffers()`` (buffers can be reassigned, as DDP re-reads them too). A model
without buffers pays the walk only. Measured figures: docs/coming-from-ddp.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import _sync

__all__ = ["BufferSync", "module_states"]


def module_states(
    module: torch.nn.Module | None, params: Mapping[str, torch.Tensor], *, buffers: bool = True
) -> dict[str, torch.Tensor]:
    """What construction broadcasts: the optimizer's params, and with ``module`` all its params and buffers.

    Names: the module's (``named_parameters`` then ``named_buffers``), then the optimizer's
    params the module does not own under their optimizer names. ``buffers=False`` leaves
    the buffers out (``broadcast_buffers=False``, as DDP's construction does).
    """
    if module is None:
        return dict(params)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters():
        out[name] = p
        seen.add(id(p))
    for name, p in params.items():
        if id(p) not in seen:
            out[f"optimizer:{name}"] = p
    if buffers:
        for name, b in module.named_buffers():
            out[f"buffer:{name}"] = b
    return out


class BufferSync:
    """A forward pre-hook on the module that broadcasts rank 0's buffers, DDP's ``broadcast_buffers``.

    Args:
      module: the model (``module=``).
      group, replicate: the shard group and the replicas of a hybrid layout (rank 0 of
        the whole data-parallel world wins).
      require_sync: whether gradients are being synchronised now (False inside ``no_sync``).

    As DDP: the broadcast runs before a forward when the previous forward of the module ran
    with gradients enabled outside ``no_sync`` (and before the first forward). Evaluation
    forwards under ``no_grad`` after a training forward get one broadcast, then none.
    """

    def __init__(
        self, module: torch.nn.Module, group: comm.Group, replicate: comm.Group, require_sync: Callable[[], bool]
    ) -> None:
        self._module = module
        self._group, self._replicate = group, replicate
        self._require_sync = require_sync
        self.pending = True  # DDP's require_forward_param_sync: set by the last forward
        self._handles = [
            module.register_forward_pre_hook(self._before, prepend=True),
            module.register_forward_hook(self._after),
        ]

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if self.pending:
            self.sync()

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.pending = torch.is_grad_enabled() and self._require_sync()

    def sync(self) -> None:
        """Broadcast rank 0's buffers now (collective: one broadcast per buffer dtype and group)."""
        bufs = [b for _, b in self._module.named_buffers()]
        if not bufs:
            return
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):
            _sync.broadcast_(bufs, self._group, self._replicate)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
