"""The stateful facade: ``ZeroOptimizer`` for an ordinary ``nn.Module`` training loop.

One file per concern (as FSDP2's ``_fully_shard/``):

=====================  ======================================================================
``optimizer.py``       ``ZeroOptimizer``: construction, backward/step/zero_grad/no_sync,
                       state dicts and checkpoints, the ``torch.optim.Optimizer`` bridge
``_options.py``        the precision keywords -> PrecisionPolicy, hybrid groups, named params
``_reducer.py``        gradient hooks: which bucket is ready, when its reduction launches,
                       which staging buffer it uses, accumulation, replica sums
``_step_grads.py``     the reducer's gradients handed to ``step`` as shards, given back,
                       scaled for clipping (a mixin of the reducer)
``_sharded_grad.py``   the stage-2 ``p.grad`` placeholder and the errors it raises
``_prefetch.py``       ``overlap_allgather``: gathers launched by ``step``, written by the
                       next forward's hooks or a param's first use (the guard)
``_state_dicts.py``    state dicts and checkpoints (a mixin of ``ZeroOptimizer``)
``_guards.py``         the params are the user's: writes made outside the facade, what the
                       masters do with them, porting mistakes refused
``_param_methods.py``  ``check_params`` / ``update_master_params`` and the step's veto (a mixin)
``_grad_methods.py``   ``get_grad_norm`` / ``clip_grad_norm_`` / ``get_param_grad``, byte counts (a mixin)
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
