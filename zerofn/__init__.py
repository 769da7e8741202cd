"""zerofn: ZeRO stage 1 and 2 for PyTorch as pure functions over explicit state.

The four stage functions (``shard_params``, ``reduce_grads``, ``step_shards``,
``gather_params``) take immutable state and explicit process groups and return new
state; ``zerofn.optim`` holds the functional optimizers they apply.
"""

from zerofn import buckets, checkpoint, checks, comm, optim, precision, torch_optim
from zerofn._tree import FrozenDict
from zerofn.checks import RankMismatchError
from zerofn.comm import CommPolicy, count_bytes
from zerofn.facade import ZeroOptimizer
from zerofn.layout import Bucket, ParamSpec, ShardLayout, make_layout
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
from zerofn.stages import gather_params, reduce_grads, shard_params, step_shards
from zerofn.state import StepInfo, ZeroState

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "CommPolicy",
    "DynamicLossScaler",
    "FrozenDict",
    "LossScaleState",
    "MixedDtypeError",
    "NoLossScaling",
    "NonFiniteGradError",
    "ParamSpec",
    "PrecisionPolicy",
    "RankMismatchError",
    "ShardLayout",
    "StaticLossScaler",
    "StepInfo",
    "ZeroOptimizer",
    "ZeroState",
    "buckets",
    "checkpoint",
    "checks",
    "comm",
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
]
