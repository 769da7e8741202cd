"""Train a small model with zerofn's ZeRO stage 1 or 2 next to DDP, and compare.

Run it on one machine; it starts its own gloo ranks on the CPU::

    python -m zerofn demo                        # 2 ranks, ZeRO stage 2, fp32, AdamW
    python -m zerofn demo --world-size 3 --stage 1 --steps 50
    python -m zerofn demo --precision bf16 --accumulate 4
    python -m zerofn demo --overlap --plot demo.png   # the ZeroOptimizer facade, a PNG

or let torchrun start the ranks (the same code; ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` in the environment switch it to ``init_process_group("env://")``)::

    torchrun --standalone --nproc_per_node=2 -m zerofn demo --steps 50

Every rank trains the same MLP on the same synthetic classification data twice, with the
same per-rank batches:

* zerofn, through one of its two APIs (``--api``):

  - ``functional`` (default): ``torch.func.functional_call`` + ``torch.func.grad`` ->
    ``zf.reduce_grads`` -> ``zf.step_shards`` -> ``zf.gather_params``, the state threaded
    by hand (:class:`FunctionalRun`);
  - ``facade``: ``zf.ZeroOptimizer(torch.optim.AdamW(...))`` in an ordinary
    ``backward`` / ``step`` / ``zero_grad`` loop (:class:`FacadeRun`). Only the facade
    can overlap communication with backward (``--overlap``): it launches each bucket's
    reduction from gradient hooks while autograd is still running, and the functional
    loop has no hooks (``torch.func.grad`` returns all gradients at once). So
    ``--overlap`` picks the facade when ``--api`` is not given.

* the reference: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``
  with the optimizer state replicated on every rank (:class:`DDPRun`).

``--precision`` sets the working dtype of both runs. Under bf16 and fp16 both keep fp32
master weights and AdamW state: zerofn through ``zf.PrecisionPolicy.for_dtype`` (1/N of
them per rank), DDP as the usual hand-written loop (a working-dtype model, an fp32 copy
of every param that ``torch.optim.AdamW`` updates, the params copied back after each
step), and fp16 adds dynamic loss scaling on both sides (zerofn's
``DynamicLossScaler`` with ``hysteresis=1`` follows ``torch.amp.GradScaler``'s rule, which
the reference uses). ``--accumulate K`` sums K micro-batch gradients per step with no
communication before the last one (``ddp.no_sync()``, ``ZeroOptimizer.no_sync()``, or a
local sum in the functional loop); both runs sum them in the working dtype, as DDP's
``p.grad`` does.

Rank 0 shows a progress bar and the caller gets a report: the loss, how far zerofn's
params are from DDP's (with the tolerance of the working dtype), optimizer-state bytes
per rank, bytes sent per rank per step against the byte-optimal 2(N-1)/N·Ψ·b, and the
time per step of both. ``--plot PATH`` draws the loss curves and the memory bars into a
PNG (needs matplotlib, imported only then).


The package, one module per concern (each imports only the ones above it):

* :mod:`zerofn.demo.config`: :class:`DemoConfig`, the choices it accepts, the tolerances;
* :mod:`zerofn.demo.runs`: the model, the data, and the three runs;
* :mod:`zerofn.demo.report`: the progress bar, :func:`format_report`, :func:`write_plot`;
* :mod:`zerofn.demo.training`: :func:`train`, the per-rank script (call it inside an
  initialised process group);
* :mod:`zerofn.demo.cli`: :func:`run`, which starts the ranks when needed and returns
  rank 0's report as a dict, and the command line.
"""

from __future__ import annotations

from zerofn.demo.cli import add_arguments, config_from_args, run
from zerofn.demo.config import DemoConfig
from zerofn.demo.report import format_report, write_plot
from zerofn.demo.runs import ByteLog, DDPRun, FacadeRun, FunctionalRun
from zerofn.demo.training import train

__all__ = [
    "ByteLog",
    "DDPRun",
    "DemoConfig",
    "FacadeRun",
    "FunctionalRun",
    "add_arguments",
    "config_from_args",
    "format_report",
    "run",
    "train",
    "write_plot",
]
