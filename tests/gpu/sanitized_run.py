"""Run zerofn's overlapped training under torch's CUDA stream sanitizer (one case per pool).

Started by ``tests/gpu/test_gpu_sanitizer.py`` in a subprocess with ``TORCH_CUDA_SANITIZER=1``
in its environment, so that every rank process (spawned by ``World``, inheriting it)
enables the sanitizer when it imports torch, before any CUDA work. The sanitizer
(``torch.cuda._sanitizer``, "CSAN") records which stream each kernel launched from
Python reads and writes each tensor on, and the events and waits between streams; an
access on one stream to memory another stream wrote (or read, for a write) without a
synchronisation in between raises ``CUDASanitizerErrors`` at that kernel and prints both
stack traces. It does not see work that collectives do inside their C++ backends (NCCL's
stream, gloo's copies): it checks the streams zerofn and torch's Python-visible kernels use.

Cases (any number, in order)::

    python tests/gpu/sanitized_run.py [--device cuda|cpu] CASE...

* ``facade-nccl1``: one rank over NCCL: the facade with overlap (stage 1 and 2),
  overlap_allgather, bf16, clipping and CPU offload, and the functional loop;
* ``facade-shared2``: two ranks sharing the GPU through gloo (asynchronous work handles
  on CUDA tensors): the facade with overlap and overlap_allgather, the functional loop;
* ``control-missing-wait``: the negative control, a test-only variant of an overlapped
  reduction: ``reduce_grads`` launched on a side stream (as a reduction stream would be)
  that reads the gradients the backward just wrote on the main stream without waiting for
  it, and the update then reads its output without waiting for the side stream. The
  sanitizer must report it;
* ``control-with-wait``: the same with both waits (``side.wait_stream(main)`` before,
  ``main.wait_stream(side)`` after): must be clean.

For each case one line: ``CASE <name>: clean (sanitizer enabled on ranks [...])`` or
``CASE <name>: reported <exception type>: <first line>``, the sanitizer's full report on
stderr. Exit status 0 once every case ran (whatever it found), 2 for a usage error.
``--device cpu`` runs the same cases with gloo on the CPU and no sanitizer (it needs
CUDA): a dry run of this script's plumbing, which can report nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for entry in (HERE, HERE.parent, HERE.parent.parent):  # tests/gpu, tests (helpers), the repo (zerofn)
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpucheck import ADAMW, BUCKET, base_model, device_here, run_trainers  # noqa: E402
from helpers import batches  # noqa: E402
from torch.func import functional_call, grad  # noqa: E402

import zerofn as zf  # noqa: E402
from zerofn.testing import World, WorldError  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


def sanitizer_enabled() -> bool:
    """Whether this process runs under the CUDA stream sanitizer."""
    if not torch.cuda.is_available():
        return False
    from torch.cuda import _sanitizer

    return bool(_sanitizer.cuda_sanitizer.enabled)


def _trainers_then_report(device: str, jobs: dict) -> bool:
    """Run every job (``gpucheck.run_trainers``); raise if any job raised (a sanitizer
    report included: ``run_trainers`` keeps going and records it), else whether the
    sanitizer was on."""
    results = run_trainers(device, jobs)
    if device == "cuda":
        torch.cuda.synchronize()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(jobs)} jobs raised:\n" + "\n".join(errors))
    return sanitizer_enabled()


def _facade_jobs(kinds: list[tuple[torch.dtype, bool, dict]]) -> dict:
    return {i: ("facade", (dtype, clip), kwargs) for i, (dtype, clip, kwargs) in enumerate(kinds)}


NCCL1_JOBS = {
    **_facade_jobs(
        [
            (F32, False, dict(stage=1, overlap=True)),
            (F32, False, dict(stage=2, overlap=True)),
            (F32, True, dict(stage=2, overlap=True, overlap_allgather=True)),
            (BF16, False, dict(stage=2, overlap=True, overlap_allgather=True)),
            (F32, False, dict(stage=2, overlap=True, cpu_offload=True)),
        ]
    ),
    "functional": ("functional", (F32, False), dict(stage=2)),
}
SHARED2_JOBS = {
    **_facade_jobs(
        [
            (F32, False, dict(stage=1, overlap=True)),
            (F32, False, dict(stage=2, overlap=True, overlap_allgather=True)),
        ]
    ),
    "functional": ("functional", (F32, False), dict(stage=2)),
}


def side_stream_reduce(device: str, wait: bool) -> bool:
    """One training step whose gradient reduction runs on a side stream (see the module doc)."""
    cuda = device == "cuda"
    # Created first, so the sanitizer knows it from before any of the work below.
    side = torch.cuda.Stream() if cuda else None
    dev = device_here(device)
    model = copy.deepcopy(base_model()).to(dev)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = zf.shard_params(params, zf.optim.adamw(**ADAMW))
    x, y = next(batches(dist.get_rank(), 1))

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (x,), {"use_gate": True}) - y) ** 2).mean()

    grads = {n: g for n, g in grad(loss)(params, x.to(dev), y.to(dev)).items() if not n.startswith("unused.")}
    main = torch.cuda.current_stream() if cuda else None
    if wait and side is not None:
        side.wait_stream(main)  # the gradients' writes come before the side stream reads them
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        shards = zf.reduce_grads(grads, state.layout, bucket_numel=BUCKET)
    if wait and side is not None:
        main.wait_stream(side)  # the update reads the reduced shards only once they are written
    state, _ = zf.step_shards(state, shards)
    zf.gather_params(state, bucket_numel=BUCKET)
    if cuda:
        torch.cuda.synchronize()
    return sanitizer_enabled()


#: case -> (world size, backend on CUDA, what runs on the pool; returns each rank's "sanitizer enabled")
CASES: dict[str, tuple[int, str, Any]] = {
    "facade-nccl1": (1, "nccl", lambda world: world.run(_trainers_then_report, world.device, NCCL1_JOBS)),
    "facade-shared2": (2, "gloo", lambda world: world.run(_trainers_then_report, world.device, SHARED2_JOBS)),
    "control-missing-wait": (1, "nccl", lambda world: world.run(side_stream_reduce, world.device, False)),
    "control-with-wait": (1, "nccl", lambda world: world.run(side_stream_reduce, world.device, True)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = p.parse_args(argv)
    for name in args.cases:
        n, backend, body = CASES[name]
        if args.device == "cpu":
            backend = "gloo"
        with World(n, backend=backend, device=args.device, timeout=60.0) as world:
            try:
                enabled = body(world)
                line = f"clean (sanitizer enabled on ranks {enabled})"
            except WorldError as exc:
                failure = next(iter(exc.failures.values()))
                first = (failure.message.strip().splitlines() or [""])[0]
                line = f"reported {failure.type_name}: {first}"
                print(str(exc), file=sys.stderr, flush=True)
        print(f"CASE {name}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
