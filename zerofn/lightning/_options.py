"""zerofn's options of both Lightning strategies: the integrations' options and the checkpoint's.

:class:`~zerofn.lightning.ZeroStrategy` (Fabric) and
:class:`~zerofn.lightning.ZeroTrainerStrategy` (Trainer) take the same zerofn keywords,
next to their own Lightning ones, and hand them to :class:`ZeroOptions`: every integration's
keywords (:class:`zerofn._integration_options.IntegrationOptions`, shared with
:mod:`zerofn.hf`: their names, meanings, defaults and translation into ``ZeroOptimizer``'s
keywords live there once) and Lightning's checkpoint keywords.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from zerofn._integration_options import IntegrationOptions

__all__ = ["ZeroOptions"]


@dataclasses.dataclass(frozen=True)
class ZeroOptions(IntegrationOptions):
    """zerofn's keywords of ``ZeroStrategy(...)`` and ``ZeroTrainerStrategy(...)``; ``ZeroOptions()`` is ZeRO-2.

    Every keyword of the integrations (``stage``, ``reduce_bucket_size``,
    ``overlap_communication``, ``overlap_allgather``, ``communication_dtype``,
    ``cpu_offload``, ``master_weights``, ``grad_accum_dtype``, ``sub_dp_size``,
    ``broadcast_buffers``, ``nonfinite``, the loss scaler's ``initial_scale``,
    ``min_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``hysteresis``, ``max_scale``, and ``comm_policy``, ``entry_timeout``, ``compile``:
    ``ZeroOptimizer``'s meanings and defaults; ``initial_scale`` & co. apply under
    ``precision="16-mixed"``), and:

    Args:
      state_dict_type: ``"sharded"``: a checkpoint is a zerofn sharded checkpoint (every
        rank writes its shards, DCP); ``"full"``: Lightning's one file with the optimizer in
        torch's format (gathered on every rank). Loading reads either.
      safe_globals: the classes (and functions) beyond data that a checkpoint's entries may
        pickle, admitted by name as ``torch.serialization.safe_globals`` admits them, on save
        (the sharded checkpoint records them) and on load (either format: both are read with
        ``weights_only=True``). Empty: a checkpoint is data only (tensors, numbers, strings,
        bools, ``None``, containers, dtypes, devices), and an entry that is not is refused
        at save, naming its key path and type. Admit only classes of checkpoints you trust.
    """

    state_dict_type: Literal["sharded", "full"] = "sharded"
    safe_globals: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "safe_globals", tuple(self.safe_globals))
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {self.state_dict_type!r}")
        super().__post_init__()
