"""The four stage functions of a ZeRO step.

::

    params --shard_params--> ZeroState                         (a tiny value check; sync=True: broadcast)
    grads  --reduce_grads--> grad shards                       (reduce-scatter, bucketed)
    state, grad shards --step_shards--> new state, StepInfo    (one scalar all-reduce)
    state  --gather_params--> params                           (all-gather, bucketed)

Each is pure: it never changes its inputs (neither tensors nor mappings) and returns new
values. ``donate=True`` on ``step_shards`` lets it reuse the state's and the grad shards'
storage instead (the caller promises not to read them again), as ``jax.jit``'s
``donate_argnums``. Process groups are arguments; ``None`` is the default group.

Every function validates its inputs and checks that all ranks agree *before* the first
collective, so a mistake raises the same clear error on every rank instead of hanging.

Mixed precision (:mod:`zerofn.precision`) threads through all four: ``shard_params``
takes a :class:`~zerofn.precision.PrecisionPolicy` (working, master and accumulation
dtypes, master weights on or off, the state device for CPU offload, the loss scaler) and
stores it in the state; ``reduce_grads`` casts to the wire dtype and back;
``step_shards`` decides overflow on all ranks at once, advances the loss scale, unscales
and clips; ``gather_params`` casts the master shards to the working dtype.

One module per stage function (``_shard_params``, ``_reduce_grads``, ``_step_shards``,
``_gather_params``), the global gradient norm the step and the facade share
(``_grad_norm``), what the two bucketed collectives share (``_pipeline``: bucket size,
pipeline depth), and where a reduced bucket row becomes this rank's flat gradient shards
(``_grad_shards``). ``value_and_reduced_grads`` (``_value_and_reduced_grads``) is
``torch.func.grad`` + ``reduce_grads`` with each bucket reduced during the backward.
Import the names from here.
"""

from __future__ import annotations

from zerofn.stages._gather_params import gather_params
from zerofn.stages._grad_norm import global_grad_norm
from zerofn.stages._pipeline import DEFAULT_BUCKET_NUMEL as DEFAULT_BUCKET_NUMEL  # read as zf.stages.<NAME>
from zerofn.stages._reduce_grads import reduce_grads
from zerofn.stages._shard_params import resolve_placement, shard_params
from zerofn.stages._step_errors import StepVetoed
from zerofn.stages._step_shards import step_shards
from zerofn.stages._value_and_reduced_grads import value_and_reduced_grads

__all__ = [
    "StepVetoed",
    "gather_params",
    "global_grad_norm",
    "reduce_grads",
    "resolve_placement",
    "shard_params",
    "step_shards",
    "value_and_reduced_grads",
]
