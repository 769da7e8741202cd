"""What ``overlap_allgather``'s guard costs per step, timed alone on a benchmark model's params.

Per step the guard swaps each param's class to its pending subclass when ``step`` launches
the gathers, and back when its bucket is written (``zerofn/facade/_prefetch.py``); nothing
else runs unless a param is used before the forward. This times exactly those two swaps
(and the in-flight registry) over every param of the model, and, for comparison, a
metadata read (``p.grad``) of every param while pending and while plain::

    python -m benchmarks.guard_cost                       # transformer (101 params)
    python -m benchmarks.guard_cost --model mlp-large

One process, no communication: the guard's work does not depend on N.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref


def main(argv: list[str] | None = None) -> None:
    import torch

    from benchmarks import models
    from zerofn.facade import _prefetch

    p = argparse.ArgumentParser(prog="python -m benchmarks.guard_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer", choices=("transformer", "mlp-small", "mlp-large"))
    p.add_argument("--repeats", type=int, default=2000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    params = list(models.build_model(models.model_config(args.model), 0, torch.device("cpu")).parameters())

    class Owner:  # stands in for the prefetcher the registry refers to
        pass

    owner = Owner()
    me = weakref.ref(owner)

    def swap_in() -> None:  # what ParamPrefetcher.launch adds per param
        for q in params:
            q.__class__ = _prefetch._pending_class(type(q))
            _prefetch._IN_FLIGHT[id(q)] = (me, 0)  # type: ignore[assignment]

    def swap_out() -> None:  # what ParamPrefetcher.complete adds per param
        for q in params:
            _prefetch._unguard(q)

    def timed(fn: object, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            out.append(time.perf_counter() - t0)
        return out

    both = timed(lambda: (swap_in(), swap_out()), args.repeats)
    swap_in()
    pending = timed(lambda: [q.grad for q in params], args.repeats // 10)
    swap_out()
    plain = timed(lambda: [q.grad for q in params], args.repeats // 10)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# {args.model}: {len(params)} params; load average {load}; median (min) over {args.repeats} steps, us")
    print(
        f"guard per step (swap in at step + swap out at the write): {statistics.median(both) * 1e6:.1f} "
        f"({min(both) * 1e6:.1f})"
    )
    print(
        f"p.grad of every param, pending: {statistics.median(pending) * 1e6:.1f}; plain: "
        f"{statistics.median(plain) * 1e6:.1f} (zero_grad() skips the check)"
    )


if __name__ == "__main__":
    main()
