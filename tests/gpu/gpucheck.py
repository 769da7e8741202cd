"""Shared set-up of the GPU check (``tests/gpu``): where it runs, its rank pools, its trainers.

The GPU check runs zerofn's CUDA paths on one GPU: NCCL at one rank, two ranks
sharing the GPU through gloo on CUDA tensors, CPU offload with CUDA params, overlap under
torch's CUDA stream sanitizer, and checkpoints moving between CUDA and the CPU.

Where it runs is one setting, ``ZEROFN_GPU_CHECK_DEVICE``:

* ``cuda`` (the default where CUDA is available): the real check. Set explicitly on a
  machine without CUDA, every test in ``tests/gpu`` is skipped with the reason
  (:data:`SKIP_REASON`).
* ``cpu`` (what tests/conftest.py sets when there is no CUDA, so ``make test`` runs it): a
  dry run of the same test bodies with gloo on the CPU (the "NCCL" pool is a gloo pool, the
  "shared GPU" pool two gloo ranks), so the check cannot rot unseen and a typo cannot waste
  GPU time. The checks that only mean something on CUDA (the stream sanitizer, pinned host
  memory) stay skipped there, with their reason.

Pools (:func:`get_world`) start on first use and are closed when the interpreter exits;
this directory has no ``conftest.py`` on purpose (a second top-level ``conftest`` module
would shadow ``tests/conftest.py`` for the tests that import from it).

Everything here is importable on the worker ranks too (``tests`` and ``tests/gpu`` are on
their ``sys.path``), so the training functions below run inside ``World.run``.
"""

from __future__ import annotations

import atexit
import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import Net, batches, gate_used
from torch.func import functional_call, grad

import zerofn as zf
from zerofn.testing import World

__all__ = [
    "ADAMW",
    "BUCKET",
    "DEVICE",
    "MAX_NORM",
    "SKIP_REASON",
    "STEPS",
    "base_model",
    "cached_run",
    "device_here",
    "get_world",
    "needs_cuda",
    "on_cpu",
    "requires_device",
    "result",
    "run_trainers",
    "train_facade",
    "train_functional",
    "train_torch",
]

ENV = "ZEROFN_GPU_CHECK_DEVICE"
DEVICE = os.environ.get(ENV, "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise ValueError(f"{ENV} must be 'cuda' (the GPU check) or 'cpu' (its dry run), got {DEVICE!r}")

SKIP_REASON = (
    f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}): tests/gpu checks "
    f"zerofn's CUDA paths on a GPU machine (scripts/gpu-check); {ENV}=cpu dry-runs them with gloo on the CPU"
)

#: Marks every test of a ``tests/gpu`` module: skipped without CUDA unless dry-running on the CPU.
requires_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason=SKIP_REASON)


def needs_cuda(what: str) -> pytest.MarkDecorator:
    """A test that checks something only CUDA has (``what``): skipped in the CPU dry run too."""
    return pytest.mark.skipif(
        DEVICE != "cuda" or not torch.cuda.is_available(),
        reason=f"{what} needs CUDA; the {ENV}=cpu dry run leaves it out" if DEVICE == "cpu" else SKIP_REASON,
    )


# --------------------------------------------------------------------------- rank pools

#: name -> (world size, backend, device) on the GPU; in the dry run gloo on the CPU alike.
POOLS = {
    "nccl1": (1, "nccl", "cuda"),  # one rank on the GPU, NCCL
    "shared2": (2, "gloo", "cuda"),  # two ranks sharing the one GPU (NCCL refuses that)
    "cpu1": (1, "gloo", "cpu"),  # the CPU side of the checkpoint round trips
    "cpu2": (2, "gloo", "cpu"),
}
_worlds: dict[tuple[int, str, str], World] = {}


def get_world(name: str) -> World:
    """The session's pool ``name`` (see :data:`POOLS`), started on first use.

    In the dry run the pools of one world size are alike (gloo on the CPU), so they are one
    pool: "nccl1" is "cpu1" and "shared2" is "cpu2", two pools started instead of four.
    """
    n, backend, device = POOLS[name]
    if DEVICE == "cpu":
        backend, device = "gloo", "cpu"
    key = (n, backend, device)
    if key not in _worlds:
        # 60 s: a stuck collective fails within the GPU check's time limit instead of using it up.
        _worlds[key] = World(n, backend=backend, device=device, timeout=60.0).start()
    return _worlds[key]


@atexit.register
def _close_worlds() -> None:
    for world in _worlds.values():
        world.close()


def device_here(device: str) -> torch.device:
    """This rank's compute device in a pool made with ``device`` (``World.device``).

    On ``"cuda"`` it is the rank's current device, which ``World`` set to
    ``cuda:(rank % device_count)`` before the group started.
    """
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


# --------------------------------------------------------------------------- the model, data and trainers

STEPS = 9  # three layer-drop cycles: `gate` has no gradient in steps 2, 5, 8
BUCKET = 64  # several buckets per step; a.weight (91 elements) travels alone
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)  # eps as in the CPU precision suite
MAX_NORM = 0.05  # below every step's gradient norm here: clipping acts on every step


def base_model() -> nn.Module:
    """``helpers.Net`` (padding at every world size, layer drop, a never-used layer) in fp32."""
    torch.manual_seed(0)
    return Net()


def _data(device: torch.device, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    for step, (x, y) in enumerate(batches(dist.get_rank(), STEPS)):
        yield step, x.to(device, dtype), y.to(device, dtype)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_torch(device: str, dtype: torch.dtype, clip: bool, *, ddp: bool = False) -> dict[str, Any]:
    """The reference: torch.optim.AdamW on the same model and data, on this rank's device.

    fp32: the model's own params. bf16: forward and backward in bf16, AdamW on fp32 copies
    of the params (the gradients cast to fp32), the params the fp32 copies rounded after
    each step, as zerofn's fp32 masters do. ``ddp``: the model wrapped in
    ``DistributedDataParallel`` over the default group (else one rank's plain training).
    Clipping: ``torch.nn.utils.clip_grad_norm_`` on the (fp32) gradients the optimizer sees.

    Args:
      device: the pool's device (``World.device``): ``"cuda"`` or ``"cpu"``.
      dtype: working dtype, float32 or bfloat16.
      clip: clip the global gradient norm to ``MAX_NORM``.
      ddp: train under DDP (every rank of the pool) instead of alone.

    Returns:
      ``{"params": name -> tensor (working dtype, on the device), "master": name -> fp32 tensor}``.
    """
    dev = device_here(device)
    model = copy.deepcopy(base_model()).to(dev, dtype)
    net: nn.Module = model
    if ddp:
        ids = [dev.index] if dev.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)
    master = {n: p for n, p in model.named_parameters()}
    if dtype != torch.float32:
        master = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(master.values(), **ADAMW)
    for step, x, y in _data(dev, dtype):
        _loss(net(x, gate_used(step)), y).backward()
        if dtype != torch.float32:
            for n, p in model.named_parameters():
                master[n].grad = None if p.grad is None else p.grad.float()
        if clip:
            torch.nn.utils.clip_grad_norm_([m for m in master.values() if m.grad is not None], MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if dtype != torch.float32:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(master[n])
    return {"params": _params_of(model), "master": {n: m.detach().clone() for n, m in master.items()}}


def train_facade(
    device: str,
    dtype: torch.dtype,
    clip: bool,
    *,
    stage: int,
    overlap: bool = False,
    overlap_allgather: bool = False,
    cpu_offload: bool = False,
) -> dict[str, Any]:
    """``zf.ZeroOptimizer`` around ``torch.optim.AdamW`` over the default group.

    bf16 through the facade's ``forced_dtype`` (it casts the fp32 model and keeps fp32
    masters). Returns the params (working dtype, on the device), the full fp32 masters
    (from ``state_dict()``, CPU), where the state lives and the pinned host memory the
    steps handed out (CUDA only, else 0; None where torch does not count them).
    """
    dev = device_here(device)
    model = copy.deepcopy(base_model()).to(dev)
    opt = zf.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), **ADAMW),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        overlap_allgather=overlap_allgather,
        cpu_offload=cpu_offload,
        clip_grad_norm=MAX_NORM if clip else 0.0,
        reduce_bucket_size=BUCKET,
        forced_dtype=dtype if dtype != torch.float32 else None,
        module=model,
    )
    pinned_before = _pinned_requests()
    for step, x, y in _data(dev, dtype):
        opt.backward(_loss(model(x, gate_used(step)), y))
        opt.step()
        opt.zero_grad()
        assert not opt.last_step_info.skipped, f"step {step} skipped"
    opt.wait_params()  # overlap_allgather: the last gather lands before the params are read
    pinned_after = _pinned_requests()
    pinned = None if pinned_before is None or pinned_after is None else pinned_after - pinned_before
    state = opt.state
    full = opt.state_dict()
    names = full["zerofn"]["names"]
    return {
        "params": _params_of(model),
        "master": {n: full["zerofn"]["master"][n] for n in names},
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "state_devices": sorted({str(t.device) for t in _tensors((state.master, state.opt_state)) if t.dim() > 0}),
        "pinned_requests": pinned,
    }


def train_functional(device: str, dtype: torch.dtype, clip: bool, *, stage: int) -> dict[str, Any]:
    """The functional loop: ``torch.func.grad`` of a ``functional_call`` loss, then
    ``reduce_grads`` -> ``step_shards`` -> ``gather_params`` over the default group.

    bf16: the params in bf16, fp32 master shards (``shard_params``' default master dtype),
    the working dtype on the wire. Returns the params and the full fp32 masters (CPU).
    """
    model = copy.deepcopy(base_model()).to(device_here(device), dtype)
    params = _params_of(model)
    state = zf.shard_params(params, zf.optim.adamw(**ADAMW))

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, use_gate: bool) -> torch.Tensor:
        return _loss(functional_call(model, params, (x,), {"use_gate": use_gate}), y)

    for step, x, y in _data(device_here(device), dtype):
        use_gate = gate_used(step)
        grads = dict(grad(loss)(params, x, y, use_gate))
        for name in list(grads):  # what autograd leaves as None in a module: no gradient this step
            if name.startswith("unused.") or (name.startswith("gate.") and not use_gate):
                del grads[name]
        shards = zf.reduce_grads(grads, state.layout, stage=stage, bucket_numel=BUCKET)
        state, info = zf.step_shards(state, shards, max_norm=MAX_NORM if clip else None)
        assert not info.skipped, f"step {step} skipped"
        params = zf.gather_params(state, bucket_numel=BUCKET)
    full = zf.checkpoint.full_state_dict(state)
    return {"params": params, "master": dict(full["zerofn"]["master"])}


def on_cpu(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU, to send back from a rank (the test
    process then never touches CUDA)."""
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def run_trainers(device: str, jobs: dict[Any, tuple[str, tuple, dict]]) -> dict[Any, Any]:
    """On every rank: ``{key: trainer(device, *args, **kwargs)}`` for ``jobs`` = ``{key:
    (trainer name, args, kwargs)}``, the results on the CPU. One ``World.run`` for many runs.

    A job that raises becomes ``{"error": its traceback}`` and the next job runs, so one
    broken configuration fails its own test only (see :func:`result`) instead of every
    test of the module re-running the lot. The jobs run the same code on every rank, so a
    job fails on all ranks alike and the group stays in step.
    """
    import traceback

    trainers = {"torch": train_torch, "facade": train_facade, "functional": train_functional}
    out: dict[Any, Any] = {}
    for key, (name, args, kwargs) in jobs.items():
        try:
            out[key] = on_cpu(trainers[name](device, *args, **kwargs))
        except Exception:
            out[key] = {"error": f"rank {dist.get_rank()}, job {key!r}:\n{traceback.format_exc()}"}
    return out


def result(results: dict[Any, Any], key: Any) -> dict[str, Any]:
    """``results[key]``, or a test failure with the rank's traceback if that job raised."""
    got = results[key]
    if "error" in got:
        pytest.fail(got["error"], pytrace=False)
    return got


def cached_run(cache: dict[str, Any], world_name: str, jobs: dict[Any, tuple[str, tuple, dict]]) -> list[dict]:
    """Per-rank ``run_trainers`` results of ``jobs`` on pool ``world_name``, computed once:
    a failure of the run itself (a worker died, a timeout) is kept and raised again, not
    retried by every test that asks."""
    if "error" in cache:
        raise cache["error"]
    if "results" not in cache:
        world = get_world(world_name)
        try:
            cache["results"] = world.run(run_trainers, world.device, jobs)
        except Exception as exc:
            cache["error"] = exc
            raise
    return cache["results"]


def _tensors(tree: Any) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _pinned_requests() -> int | None:
    """Pinned host blocks handed out so far by torch's caching host allocator.

    Requests, not blocks created: a request served from the allocator's cache counts too.
    0 on a process without CUDA; None where this torch does not expose the counter (its
    name depends on the version), so that only the test that needs it fails, saying so.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    for key in ("active_requests.allocated", "allocation.allocated"):
        if key in stats:
            return int(stats[key])
    return None
