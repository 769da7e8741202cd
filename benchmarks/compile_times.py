"""Where the first compiled call of zerofn's functional step spends its time, truly cold.

The ``zerofn-fn-compiled-inductor`` system of ``benchmarks/systems.py`` (``torch.func`` +
the four stages in one ``torch.compile(fullgraph=True)`` graph, inductor) is built on N
gloo ranks and called once, from a fresh inductor cache with the FX-graph and AOT caches
off (the benchmark's cold compile). Rank 0 prints the call's wall time and dynamo's own
table of phases (``torch._dynamo.utils.compile_times``): tracing (``bytecode_tracing``,
and one ``compile_attempt_K`` per restart of the analysis), AOTAutograd, inductor's passes,
lowering, scheduling and code generation, and the C++ compiles (``async_compile.wait``)::

    python -m benchmarks.compile_times --model mlp-large      # about 30 s
    python -m benchmarks.compile_times --model mlp-small      # minutes: 1,028 param tensors

``--system ddp-compiled`` gives the same table for the reference, ``torch.compile(DDP(model))``
and fused AdamW, measured as ``benchmarks.run`` measures it (its first step minus its second,
cold): the model's own forward and backward, compiled the same way. ``--system grad-only``
compiles the functional step with the four stages taken out: the user's
``torch.func.grad_and_value`` of ``functional_call`` alone, the share of the step's compile
that is not zerofn's.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

SYSTEM = "zerofn-fn-compiled-inductor"
GRAD_ONLY = "grad-only"


def _job(model_name: str, system: str) -> tuple[float, str]:
    import torch._dynamo.utils

    from benchmarks import models, systems

    systems.setup(models.model_config(model_name), 0, 8, "fused")
    if system == "ddp-compiled":  # the benchmark's cold measure: the first step minus the second
        ctx = systems._ctx()
        systems.cold_compiles(ctx.rank)
        ddp = systems.DDPSystem(systems.SYSTEMS[system], ctx, "fused")
        seconds = systems.DDPCompiled.first_minus_second(ddp, ctx)
    else:
        systems.build(SYSTEM)
        if system == GRAD_ONLY:
            step = systems._BUILT[SYSTEM]
            grad_fn = step.grad_fn

            def grad_only(state: Any, params: Any, x: Any, y: Any) -> Any:
                grads, loss = grad_fn(params, x, y)
                return state, grads, loss.detach()  # the gradients are outputs: no backward left out

            step.train_step = grad_only  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        systems.run_block(SYSTEM, 0, 1)  # the first call: the compile, cold
        seconds = time.perf_counter() - t0
    table: Any = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    return seconds, str(table)


def main(argv: list[str] | None = None) -> None:
    from benchmarks import compile_times  # by module name: the pool pickles functions by reference
    from zerofn.testing import World

    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_times", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp-large", choices=("transformer", "mlp-small", "mlp-large"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--system",
        default=SYSTEM,
        choices=(SYSTEM, "ddp-compiled", GRAD_ONLY),
        help="ddp-compiled: the baseline; grad-only: the step without its stages",
    )
    args = p.parse_args(argv)
    os.environ["ZEROFN_BENCH_WARM_COMPILE"] = "0"  # one compile, cold (the ranks inherit it)
    with World(args.world_size, timeout=3600.0, run_timeout=7200.0) as world:
        seconds, table = world.run(compile_times._job, args.model, args.system)[0]
    print(f"# {args.system}, {args.model}, N = {args.world_size}, rank 0: first call {seconds:.1f} s")
    print(table)


if __name__ == "__main__":
    main()
