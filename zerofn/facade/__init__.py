"""The stateful facade: ``ZeroOptimizer`` for an ordinary ``nn.Module`` training loop.

One file per concern (as FSDP2's ``_fully_shard/``):

=====================  ======================================================================
``optimizer.py``       ``ZeroOptimizer``: the public surface, each method a thin delegation
                       to a collaborator below; the ``torch.optim.Optimizer`` bridge
``_build.py``          construction: options resolved, the first state, the ranks agreed and
                       synced; the collaborators made, each given what it needs
``_options.py``        the precision keywords -> PrecisionPolicy, hybrid groups, named params
``_reducer.py``        gradient hooks: which bucket is ready, when its reduction launches,
                       which staging buffer it uses, accumulation, replica sums
``_held.py``           the gradients held between backward and step, per name
``_settle.py``         a reduced bucket into shards (through ``stages._grad_shards``) or ``p.grad``
``_step_grads.py``     the held gradients handed to ``step`` as shards, given back, scaled
``_sharded_grad.py``   the stage-2 ``p.grad`` placeholder and the errors it raises
``_grads.py``          backward, ``zero_grad``, ``no_sync``, the global norm, clipping, byte counts
``_step.py``           ``step``: ``step_shards`` on the shards (again after a veto), the write-back
``_hyperparams.py``    the live ``param_groups`` hyperparameters into the state, and back on load
``_writes.py``         the masters follow the user's param writes; ``check_params``
``_state_dicts.py``    state dicts and checkpoints
``_prefetch.py``       ``overlap_allgather``: gathers launched by ``step``, written by the
                       next forward's hooks or a param's first use (the guard)
``_guards.py``         the params are the user's: writes made outside the facade, what the
                       masters do with them, porting mistakes refused
``_buffers.py``        the module's buffers as DDP keeps them: rank 0's, broadcast before each forward
``_entry.py``          collective entry points wait at most ``entry_timeout`` for every rank
``_compiled.py``       ``compile=``: the step after backward as one compiled graph
=====================  ======================================================================

The facade owns no math and no bucket code: every bucket goes through
:mod:`zerofn.buckets`, the pieces the stage functions loop over, so the facade and the
functional path give the same bits.
"""

from zerofn.facade._guards import ParamsChangedError
from zerofn.facade._reducer import ShardedGradError
from zerofn.facade.optimizer import ZeroOptimizer

__all__ = ["ParamsChangedError", "ShardedGradError", "ZeroOptimizer"]
