"""zerofn: ZeRO stage 1 and 2 for PyTorch as pure functions over explicit state.

The four stage functions (``shard_params``, ``reduce_grads``, ``step_shards``,
``gather_params``) take immutable state and explicit process groups and return new
state; ``zerofn.optim`` holds the functional optimizers they apply, ``zerofn.buckets``
the bucket pieces every path moves gradients and params through, and ``ZeroOptimizer``
is the drop-in facade. ``__all__`` is the public surface (pinned by a test).
"""

from zerofn import buckets, checkpoint, optim, precision, torch_optim
from zerofn._agreement import RankMismatchError, check_ranks_agree
from zerofn._comm import CommPolicy
from zerofn._comm_count import CommCounter, count_bytes
from zerofn._comm_join import NotJoinedError
from zerofn._sync import broadcast_params
from zerofn._tree import FrozenDict
from zerofn._wire._policy import CompressedWire
from zerofn.buckets import Bucket
from zerofn.checkpoint import CheckpointError
from zerofn.facade import ParamsChangedError, ShardedGradError, ZeroOptimizer
from zerofn.layout import ParamSpec, ShardLayout, make_layout
from zerofn.precision import (
    DynamicLossScaler,
    LossScaleState,
    MixedDtypeError,
    NoLossScaling,
    NonFiniteGradError,
    PrecisionPolicy,
    StaticLossScaler,
    scale_loss,
)
from zerofn.stages import gather_params, reduce_grads, shard_params, step_shards, value_and_reduced_grads
from zerofn.state import StepInfo, ZeroState

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "CheckpointError",
    "CommCounter",
    "CommPolicy",
    "CompressedWire",
    "DynamicLossScaler",
    "FrozenDict",
    "LossScaleState",
    "MixedDtypeError",
    "NoLossScaling",
    "NonFiniteGradError",
    "NotJoinedError",
    "ParamSpec",
    "ParamsChangedError",
    "PrecisionPolicy",
    "RankMismatchError",
    "ShardLayout",
    "ShardedGradError",
    "StaticLossScaler",
    "StepInfo",
    "ZeroOptimizer",
    "ZeroState",
    "broadcast_params",
    "buckets",
    "check_ranks_agree",
    "checkpoint",
    "count_bytes",
    "gather_params",
    "make_layout",
    "optim",
    "precision",
    "reduce_grads",
    "scale_loss",
    "shard_params",
    "step_shards",
    "torch_optim",
    "value_and_reduced_grads",
]
