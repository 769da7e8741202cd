"""The systems under test and the per-rank commands the orchestrator calls.

Everything here runs inside a rank process of :class:`benchmarks._pool.Pool`. A rank holds
one :class:`Context` (model config, device, this rank's batches) and any number of built
systems at once, so the orchestrator can interleave them: ``build`` each, then
``run_block`` them in turn, round after round.

A system is one way of training the same model on the same per-rank batches with AdamW
(same hyperparameters everywhere). Its ``step(x, y)`` is a whole training step: forward,
backward, gradient communication, optimizer, whatever parameter communication it needs,
and zeroing the gradients, and returns the detached local loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import zerofn as zf
from benchmarks import _count, models
from zerofn.buckets import plan_buckets

__all__ = ["SYSTEMS", "SystemInfo", "deepspeed_available"]

LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01


def _adamw_kwargs(kernel: str | None) -> dict[str, Any]:
    """AdamW's settings; ``kernel=None``: the single-tensor kernel (what a compiled step traces)."""
    return dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **({kernel: True} if kernel else {}))


@dataclasses.dataclass(frozen=True)
class SystemInfo:
    """What the report says about a system.

    Attributes:
      name: short name used on the command line and in the tables.
      label: one line of what it is.
      family: ``"ddp"``, ``"peer"`` or ``"zerofn"``.
      sharded: optimizer state sharded over the ranks (for the theoretical state bytes).
      comm_visible: its collectives go through Python (counted by :mod:`benchmarks._count`);
        False for the part that DDP's C++ reducer issues, which the report states from theory.
    """

    name: str
    label: str
    family: str
    sharded: bool
    comm_visible: bool


SYSTEMS: dict[str, SystemInfo] = {
    s.name: s
    for s in (
        SystemInfo("ddp-fused", "DDP + torch.optim.AdamW(fused=True)", "ddp", False, False),
        SystemInfo("ddp-foreach", "DDP + torch.optim.AdamW(foreach=True)", "ddp", False, False),
        SystemInfo(
            "ddp-compiled",
            "torch.compile(DDP(model)) (inductor) + torch.optim.AdamW(fused=True): the model's own compile cost",
            "ddp",
            False,
            False,
        ),
        SystemInfo("zero-redundancy", "DDP + ZeroRedundancyOptimizer(AdamW, fused=True)", "peer", True, False),
        SystemInfo("fsdp2", "fully_shard(reshard_after_forward=False) + AdamW(fused=True)", "peer", True, True),
        SystemInfo("deepspeed-z1", "DeepSpeed ZeRO-1 + AdamW(fused=True) (client optimizer)", "peer", True, True),
        SystemInfo("deepspeed-z2", "DeepSpeed ZeRO-2 + AdamW(fused=True) (client optimizer)", "peer", True, True),
        SystemInfo("zerofn-fn-pure", "zerofn functional loop, stage 2, donate=False", "zerofn", True, True),
        SystemInfo(
            "zerofn-fn-donated",
            "zerofn functional loop, stage 2, donate=True, out=params, staging=StagingPool()",
            "zerofn",
            True,
            True,
        ),
        SystemInfo(
            "zerofn-fn-overlap",
            "zerofn functional loop as zerofn-fn-donated, the gradients from value_and_reduced_grads "
            "(each bucket reduced during the backward)",
            "zerofn",
            True,
            True,
        ),
        SystemInfo(
            "zerofn-fn-compiled",
            "zerofn functional loop (donated, as zerofn-fn-donated) compiled: torch.compile(fullgraph=True, "
            "backend='aot_eager')",
            "zerofn",
            True,
            True,
        ),
        SystemInfo(
            "zerofn-fn-compiled-inductor",
            "zerofn functional loop (donated) compiled with inductor: torch.compile(fullgraph=True)",
            "zerofn",
            True,
            True,
        ),
        SystemInfo("zerofn-s1", "zerofn ZeroOptimizer stage 1, overlap off", "zerofn", True, True),
        SystemInfo("zerofn-s1-overlap", "zerofn ZeroOptimizer stage 1, overlap on", "zerofn", True, True),
        SystemInfo("zerofn-s2", "zerofn ZeroOptimizer stage 2, overlap off", "zerofn", True, True),
        SystemInfo("zerofn-s2-overlap", "zerofn ZeroOptimizer stage 2, overlap on", "zerofn", True, True),
        SystemInfo(
            "zerofn-s2-overlap-ag",
            "zerofn ZeroOptimizer stage 2, overlap on, overlap_allgather (gather hidden behind the next forward)",
            "zerofn",
            True,
            True,
        ),
        SystemInfo(
            "zerofn-s2-compiled",
            "zerofn ZeroOptimizer stage 2, overlap off, compile=True (the step after backward as one graph; "
            "AdamW's single-tensor kernel, traced)",
            "zerofn",
            True,
            True,
        ),
        SystemInfo(
            "zerofn-s2-byteopt",
            "zerofn ZeroOptimizer stage 2, overlap off, CommPolicy.byte_optimal() (reduce-scatter + all-gather)",
            "zerofn",
            True,
            True,
        ),
    )
}


def deepspeed_available() -> str | None:
    """None if DeepSpeed can be imported here, else why not (a note for the report)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed in this Python (pip install deepspeed, see benchmarks/README.md)"
    return None


# ----------------------------------------------------------------------------- per-rank context


@dataclasses.dataclass
class Context:
    cfg: models.ModelConfig
    seed: int
    device: torch.device
    rank: int
    world: int
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    kernel: str  # "fused" or "foreach": the AdamW kernel of every system but ddp-foreach
    bucket_numel: int | None = None  # zerofn's bucket size (None: its default)

    def bucket_kwargs(self, name: str) -> dict[str, int]:
        """``{name: bucket_numel}`` when a bucket size was asked for, else nothing (zerofn's default)."""
        return {} if self.bucket_numel is None else {name: self.bucket_numel}


_CTX: Context | None = None
_BUILT: dict[str, System] = {}


def _ctx() -> Context:
    if _CTX is None:
        raise RuntimeError("benchmarks.systems.setup must run first")
    return _CTX


_PROFILING = False


def _phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``bench.<name>`` range in torch.profiler traces (a no-op unless profiling)."""
    return torch.profiler.record_function(f"bench.{name}") if _PROFILING else contextlib.nullcontext()


def _sync() -> None:
    if _ctx().device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- systems


class System:
    """Base: a built system on this rank."""

    info: SystemInfo

    def __init__(self, info: SystemInfo, ctx: Context) -> None:
        self.info = info
        self.ctx = ctx
        self.steps_done = 0
        self.loss = models.loss_fn(ctx.cfg)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int | None]:
        """``opt_state`` (moments, step counters), ``master`` (the weights the optimizer
        kernel writes, on this rank) and ``params`` (full working weights resident between
        steps, when they are a separate copy from ``master``)."""
        raise NotImplementedError

    def zerofn_layout(self) -> zf.ShardLayout | None:
        return None

    def full_params(self) -> dict[str, torch.Tensor] | None:
        """Full params (for checks); may issue collectives on every rank."""
        return None

    def settle(self) -> None:
        """End of a block (untimed): finish work a step left in flight for the next one."""

    def compile_times(self) -> dict[str, float] | None:
        """Seconds spent compiling (a compiled system), else None."""
        return None

    def close(self) -> None:
        pass


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return _count._nbytes(obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _opt_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_tensor_bytes(s) for s in opt.state.values())


def _param_bytes(params: Any) -> int:
    return sum(_count._nbytes(p) for p in params)


class DDPSystem(System):
    def __init__(self, info: SystemInfo, ctx: Context, kernel: str, zero: bool = False) -> None:
        super().__init__(info, ctx)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = models.build_model(ctx.cfg, ctx.seed, ctx.device)
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = DDP(self.model, device_ids=ids)
        if zero:
            self.opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                self.ddp.parameters(), optimizer_class=torch.optim.AdamW, **_adamw_kwargs(kernel)
            )
        else:
            self.opt = torch.optim.AdamW(self.ddp.parameters(), **_adamw_kwargs(kernel))
        self.zero = zero

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _phase("forward"):
            loss = self.loss(self.ddp(x), y)
        with _phase("backward"):
            loss.backward()
        with _phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def state_bytes(self) -> dict[str, int | None]:
        if self.zero:
            local = self.opt.optim  # type: ignore[attr-defined]
            mine = [p for g in local.param_groups for p in g["params"]]
            return {
                "opt_state": _opt_state_bytes(local),
                "master": _param_bytes(mine),
                "params": _param_bytes(self.model.parameters()) - _param_bytes(mine),
            }
        return {"opt_state": _opt_state_bytes(self.opt), "master": _param_bytes(self.model.parameters()), "params": 0}

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


def cold_compiles(rank: int) -> None:
    """Make this process's next compile start from nothing: a fresh inductor cache directory,
    and inductor's FX-graph cache and AOTAutograd's cache off (a warm cache turns minutes into
    seconds). :func:`warm_compiles` turns the caches back on."""
    import torch._functorch.config
    import torch._inductor.config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"zerofn-bench-inductor-r{rank}-")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def warm_compiles() -> None:
    """Inductor's FX-graph cache and AOTAutograd's cache on again (torch's defaults)."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


class DDPCompiled(DDPSystem):
    """``torch.compile(DDP(model))`` with inductor, and fused AdamW eagerly: the reference for
    zerofn's compile time (the same model's first forward, backward and optimizer step).

    Compile times, measured at build as ``zerofn-s2-compiled``'s: *cold*, a throwaway
    system's first step in this process from nothing (:func:`cold_compiles`) minus its
    second; *warm*, after ``torch._dynamo.reset()`` with the caches on, the first step of
    the system that is then timed, minus its second.
    """

    def __init__(self, info: SystemInfo, ctx: Context) -> None:
        cold_compiles(ctx.rank)
        torch._dynamo.reset()
        self._cold = self.first_minus_second(DDPSystem(info, ctx, "fused"), ctx)
        warm_compiles()
        torch._dynamo.reset()
        super().__init__(info, ctx, "fused")
        self.ddp = torch.compile(self.ddp)  # type: ignore[assignment]
        self._firsts: list[float] = []

    @staticmethod
    def first_minus_second(system: DDPSystem, ctx: Context) -> float:
        """A fresh ``torch.compile(system.ddp)``'s first step minus its second (its compile)."""
        compiled = torch.compile(system.ddp)
        firsts = []
        for x, y in ctx.batches[:2]:
            t0 = time.perf_counter()
            system.loss(compiled(x), y).backward()
            system.opt.step()
            system.opt.zero_grad(set_to_none=True)
            firsts.append(time.perf_counter() - t0)
        return firsts[0] - firsts[1]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = super().step(x, y)
        if len(self._firsts) < 2:
            self._firsts.append(time.perf_counter() - t0)
        return loss

    def compile_times(self) -> dict[str, float] | None:
        warm = self._firsts[0] - self._firsts[1] if len(self._firsts) == 2 else None
        return {"cold_s": self._cold, "warm_s": warm}  # type: ignore[dict-item]


class FSDP2System(System):
    def __init__(self, info: SystemInfo, ctx: Context, kernel: str) -> None:
        super().__init__(info, ctx)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.model = models.build_model(ctx.cfg, ctx.seed, ctx.device)
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        for blk in self.model.blocks:  # type: ignore[union-attr]
            fully_shard(blk, mesh=mesh, reshard_after_forward=False)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        self.opt = torch.optim.AdamW(self.model.parameters(), **_adamw_kwargs(kernel))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _phase("forward"):
            loss = self.loss(self.model(x), y)
        with _phase("backward"):
            loss.backward()
        with _phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def state_bytes(self) -> dict[str, int | None]:
        return {"opt_state": _opt_state_bytes(self.opt), "master": _param_bytes(self.model.parameters()), "params": 0}

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach() for n, p in self.model.named_parameters()}


class DeepSpeedSystem(System):
    def __init__(self, info: SystemInfo, ctx: Context, kernel: str, stage: int) -> None:
        super().__init__(info, ctx)
        import logging
        import warnings

        # DeepSpeed calls the deprecated all_gather_into_tensor on every step; not ours to fix.
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        self.model = models.build_model(ctx.cfg, ctx.seed, ctx.device)
        opt = torch.optim.AdamW(self.model.parameters(), **_adamw_kwargs(kernel))
        config = {
            "train_micro_batch_size_per_gpu": ctx.cfg.batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; no system here clips
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=self.model, optimizer=opt, config=config)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _phase("forward"):
            loss = self.loss(self.engine(x), y)
        with _phase("backward"):
            self.engine.backward(loss)
        with _phase("optimizer"):
            self.engine.step()
        return loss.detach()

    def state_bytes(self) -> dict[str, int | None]:
        zopt = self.engine.optimizer
        master = getattr(zopt, "single_partition_of_fp32_groups", None)
        inner = getattr(zopt, "optimizer", None)
        return {
            "opt_state": _opt_state_bytes(inner) if inner is not None else None,
            "master": _tensor_bytes(master) if master is not None else None,
            "params": _param_bytes(self.model.parameters()),
        }

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


class ZerofnFunctional(System):
    """``torch.func.grad`` + the four stage functions, as in zerofn's README."""

    def __init__(self, info: SystemInfo, ctx: Context, kernel: str, donate: bool, overlap: bool = False) -> None:
        super().__init__(info, ctx)
        self.model = models.build_model(ctx.cfg, ctx.seed, ctx.device)
        for p in self.model.parameters():
            p.requires_grad_(False)  # torch.func.grad differentiates the dict we pass in
        self.params: dict[str, torch.Tensor] = {n: p.detach() for n, p in self.model.named_parameters()}
        self.state = zf.shard_params(self.params, zf.optim.adamw(**_adamw_kwargs(kernel)))
        self.donate = donate
        # The donated loop also reuses its bucket buffers between steps (explicit, like `out=`).
        self.staging = zf.buckets.StagingPool() if donate else None
        loss, model = self.loss, self.model

        def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss(torch.func.functional_call(model, params, (x,)), y)

        self.grad_fn = torch.func.grad_and_value(loss_of)
        # overlap: the same reduction, launched bucket by bucket from the backward's hooks.
        self.value_and_grads = (
            zf.value_and_reduced_grads(
                loss_of, self.state.layout, stage=2, staging=self.staging, **ctx.bucket_kwargs("bucket_numel")
            )
            if overlap
            else None
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.value_and_grads is not None:
            with _phase("forward+backward+reduce_grads"):
                loss, gshards = self.value_and_grads(self.params, x, y)
            return self._step_on(gshards, loss)
        with _phase("forward+backward"):
            grads, loss = self.grad_fn(self.params, x, y)
        with _phase("reduce_grads"):
            bucket = self.ctx.bucket_kwargs("bucket_numel")
            gshards = zf.reduce_grads(grads, self.state.layout, stage=2, staging=self.staging, **bucket)
            del grads
        return self._step_on(gshards, loss)

    def _step_on(self, gshards: Any, loss: torch.Tensor) -> torch.Tensor:
        bucket = self.ctx.bucket_kwargs("bucket_numel")
        with _phase("step_shards"):
            self.state, _ = zf.step_shards(self.state, gshards, donate=self.donate)
        with _phase("gather_params"):
            out = self.params if self.donate else None
            self.params = zf.gather_params(self.state, out=out, staging=self.staging, **bucket)
        return loss.detach()

    def state_bytes(self) -> dict[str, int | None]:
        master = _tensor_bytes(dict(self.state.master))
        return {"opt_state": self.state.nbytes - master, "master": master, "params": _param_bytes(self.params.values())}

    def zerofn_layout(self) -> zf.ShardLayout:
        return self.state.layout

    def full_params(self) -> dict[str, torch.Tensor]:
        return dict(self.params)


class ZerofnFunctionalCompiled(ZerofnFunctional):
    """The donated functional loop as one ``torch.compile(fullgraph=True)`` graph.

    The whole step (``torch.func.grad_and_value``, ``reduce_grads``, ``step_shards``,
    ``gather_params(out=params)``, a ``StagingPool``) is compiled once with ``backend``
    (``aot_eager``: eager mode's kernels replayed from one graph; ``inductor``: generated
    kernels), the state in its tensor form (``as_tensors``) and the learning rate a 0-d
    tensor. The first call compiles (cold: a fresh process); then the graph is dropped
    (``torch._dynamo.reset()``) and compiled again on copies of the inputs (warm: the same
    process, torch's in-memory and on-disk caches filled), a throwaway step every rank
    takes alike. Both times are kept in ``compile_s`` (``compile_times``, the report's note).
    """

    def __init__(self, info: SystemInfo, ctx: Context, backend: str) -> None:
        import torch._dynamo

        super().__init__(info, ctx, "fused", donate=True)
        lr = torch.tensor(LR, dtype=torch.float64)
        kw = _adamw_kwargs("fused")  # the eager systems' kernel: one opaque op in the graph
        self.state = zf.shard_params(self.params, zf.optim.adamw(**{**kw, "lr": lr})).as_tensors()
        self.backend = backend
        self.compile_s: dict[str, float] = {}
        grad_fn, staging, bucket = self.grad_fn, self.staging, ctx.bucket_kwargs("bucket_numel")

        def train_step(state: zf.ZeroState, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
            grads, loss = grad_fn(params, x, y)
            gshards = zf.reduce_grads(grads, state.layout, stage=2, staging=staging, **bucket)
            state, _ = zf.step_shards(state, gshards, donate=True)
            return state, zf.gather_params(state, out=params, staging=staging, **bucket), loss.detach()

        self.train_step = train_step
        torch._dynamo.reset()
        self.compiled: Callable[..., Any] | None = None

    def _compile(self) -> Callable[..., Any]:
        return torch.compile(self.train_step, fullgraph=True, backend=self.backend)

    def compile_times(self) -> dict[str, float] | None:
        return {"cold_s": self.compile_s.get("cold"), "warm_s": self.compile_s.get("warm")}  # type: ignore[dict-item]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import torch._dynamo

        if self.compiled is None:  # cold, then warm (a throwaway step on copies)
            cold_compiles(self.ctx.rank)
            self.compiled = self._compile()
            t0 = time.perf_counter()
            self.compiled(_clone_tree(self.state), {n: p.clone() for n, p in self.params.items()}, x, y)
            self.compile_s["cold"] = time.perf_counter() - t0
            warm_compiles()
            if os.environ.get("ZEROFN_BENCH_WARM_COMPILE") != "0":  # "0": compile once (e.g. a --profile run)
                torch._dynamo.reset()
                self.compiled = self._compile()
                t0 = time.perf_counter()
                self.compiled(_clone_tree(self.state), {n: p.clone() for n, p in self.params.items()}, x, y)
                self.compile_s["warm"] = time.perf_counter() - t0
        with _phase("compiled step"):
            self.state, self.params, loss = self.compiled(self.state, self.params, x, y)
        return loss


def _clone_tree(tree: Any) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


class ZerofnFacade(System):
    """``ZeroOptimizer`` around ``torch.optim.AdamW`` in an ordinary ``nn.Module`` loop."""

    def __init__(
        self,
        info: SystemInfo,
        ctx: Context,
        kernel: str,
        stage: int,
        overlap: bool,
        byte_optimal: bool = False,
        allgather: bool = False,
        compile_: bool | str = False,
    ) -> None:
        super().__init__(info, ctx)
        self.model, self.opt = _facade(ctx, kernel, stage, overlap, byte_optimal, allgather, compile_)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _phase("forward"):
            loss = self.loss(self.model(x), y)
        with _phase("backward"):
            self.opt.backward(loss)
        with _phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad()
        return loss.detach()

    def state_bytes(self) -> dict[str, int | None]:
        state = self.opt.state
        master = _tensor_bytes(dict(state.master))
        return {"opt_state": state.nbytes - master, "master": master, "params": _param_bytes(self.model.parameters())}

    def zerofn_layout(self) -> zf.ShardLayout:
        return self.opt.state.layout

    def full_params(self) -> dict[str, torch.Tensor]:
        self.opt.wait_params()  # overlap_allgather: the last step's gather may still be in flight
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def settle(self) -> None:
        # overlap_allgather: the last step's gather, which the next forward would complete;
        # finished here so that it does not run beside another system's block. Each timed
        # step still completes one gather (the previous step's) in its forward.
        self.opt.wait_params()

    def close(self) -> None:
        self.opt.close()


def _facade(
    ctx: Context,
    kernel: str | None,
    stage: int,
    overlap: bool,
    byte_optimal: bool = False,
    allgather: bool = False,
    compile_: bool | str = False,
) -> tuple[torch.nn.Module, zf.ZeroOptimizer]:
    model = models.build_model(ctx.cfg, ctx.seed, ctx.device)
    topt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(kernel))
    opt = zf.ZeroOptimizer(
        topt,
        partition_grad=stage == 2,
        overlap_communication=overlap,
        overlap_allgather=allgather,
        module=model,
        comm_policy=zf.CommPolicy.byte_optimal() if byte_optimal else None,
        compile=compile_,
        **ctx.bucket_kwargs("reduce_bucket_size"),
    )
    return model, opt


class ZerofnFacadeCompiled(ZerofnFacade):
    """``ZeroOptimizer(compile=True)``: ``zerofn-s2`` with the step after backward compiled.

    AdamW runs torch's fused kernel, as the eager systems (one opaque op in the graph).
    Compile times, measured at build: *cold*, a first facade's first step
    in this process with an empty inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR`` per
    rank), minus its second step; *warm*, after ``torch._dynamo.reset()``, the first step of
    the facade that is then timed (dynamo traces again, inductor's caches hold the graph),
    minus its second step.
    """

    def __init__(self, info: SystemInfo, ctx: Context) -> None:
        cold_compiles(ctx.rank)
        torch._dynamo.reset()
        backend = os.environ.get("ZEROFN_BENCH_COMPILE_BACKEND") or True  # run.py's --compile-backend
        model, opt = _facade(ctx, "fused", 2, False, compile_=backend)
        firsts = []
        for x, y in ctx.batches[:2]:
            t0 = time.perf_counter()
            opt.backward(models.loss_fn(ctx.cfg)(model(x), y))
            opt.step()
            opt.zero_grad()
            firsts.append(time.perf_counter() - t0)
        opt.close()
        del model, opt
        self._cold = firsts[0] - firsts[1]
        warm_compiles()
        torch._dynamo.reset()
        super().__init__(info, ctx, "fused", 2, overlap=False, compile_=backend)
        self._firsts: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = super().step(x, y)
        if len(self._firsts) < 2:
            self._firsts.append(time.perf_counter() - t0)
        return loss

    def compile_times(self) -> dict[str, float] | None:
        warm = self._firsts[0] - self._firsts[1] if len(self._firsts) == 2 else None
        return {"cold_s": self._cold, "warm_s": warm}  # type: ignore[dict-item]


def _make(name: str, ctx: Context) -> System:
    info = SYSTEMS[name]
    k = ctx.kernel
    builders: dict[str, Callable[[], System]] = {
        "ddp-fused": lambda: DDPSystem(info, ctx, "fused"),
        "ddp-foreach": lambda: DDPSystem(info, ctx, "foreach"),
        "ddp-compiled": lambda: DDPCompiled(info, ctx),
        "zero-redundancy": lambda: DDPSystem(info, ctx, k, zero=True),
        "fsdp2": lambda: FSDP2System(info, ctx, k),
        "deepspeed-z1": lambda: DeepSpeedSystem(info, ctx, k, 1),
        "deepspeed-z2": lambda: DeepSpeedSystem(info, ctx, k, 2),
        "zerofn-fn-pure": lambda: ZerofnFunctional(info, ctx, k, donate=False),
        "zerofn-fn-donated": lambda: ZerofnFunctional(info, ctx, k, donate=True),
        "zerofn-fn-overlap": lambda: ZerofnFunctional(info, ctx, k, donate=True, overlap=True),
        "zerofn-fn-compiled": lambda: ZerofnFunctionalCompiled(info, ctx, "aot_eager"),
        "zerofn-fn-compiled-inductor": lambda: ZerofnFunctionalCompiled(info, ctx, "inductor"),
        "zerofn-s1": lambda: ZerofnFacade(info, ctx, k, 1, overlap=False),
        "zerofn-s1-overlap": lambda: ZerofnFacade(info, ctx, k, 1, overlap=True),
        "zerofn-s2": lambda: ZerofnFacade(info, ctx, k, 2, overlap=False),
        "zerofn-s2-overlap": lambda: ZerofnFacade(info, ctx, k, 2, overlap=True),
        "zerofn-s2-overlap-ag": lambda: ZerofnFacade(info, ctx, k, 2, overlap=True, allgather=True),
        "zerofn-s2-byteopt": lambda: ZerofnFacade(info, ctx, k, 2, overlap=False, byte_optimal=True),
        "zerofn-s2-compiled": lambda: ZerofnFacadeCompiled(info, ctx),
    }
    return builders[name]()


# ----------------------------------------------------------------------------- rank commands


def _proc_status() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes (Linux), else ru_maxrss for the peak."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def setup(
    cfg: models.ModelConfig, seed: int, n_batches: int, kernel: str, bucket_numel: int | None = None
) -> dict[str, Any]:
    """Make this rank's context: device, batches, zerofn's bucket size. Returns the model's size."""
    global _CTX
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    batches = models.make_batches(cfg, seed, rank, n_batches, device)
    _CTX = Context(cfg, seed, device, rank, world, batches, kernel, bucket_numel)
    probe = models.build_model(cfg, seed, torch.device("cpu"))
    psi, n_params = models.param_count(probe)
    del probe
    # Page in the kernels and libraries a first training step loads (oneDNN, autograd, gloo
    # buffers) with a tiny model, so the RSS taken now is a baseline every system shares.
    tiny = models.model_config(cfg.name, quick=True)
    warm = models.build_model(tiny, seed, device)
    x, y = models.make_batches(tiny, seed, rank, 1, device)[0]
    models.loss_fn(tiny)(warm(x), y).backward()
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    del warm, x, y, t
    return {"psi": psi, "n_params": n_params, "device": str(device), "rss": _proc_status()}


def build(name: str) -> dict[str, Any]:
    """Build system ``name`` on this rank (every rank must call it)."""
    ctx = _ctx()
    if name in _BUILT:
        raise ValueError(f"system {name} is already built")
    _BUILT[name] = _make(name, ctx)
    return {"name": name}


def run_block(name: str, count: int, untimed: int = 0) -> dict[str, Any]:
    """Run ``untimed + count`` steps of ``name``; time the last ``count``.

    Returns this rank's step times (s), losses (all steps), the bytes sent per timed
    step, counted by zerofn (``zerofn``) and by the Python collective wrapper (``python``),
    and the minor page faults per timed step (``minor_faults``: the process's, gloo's
    threads included; each is a fresh page the allocator handed out and the kernel had to
    map and zero, the cost of buffers that are not reused between steps).
    """
    ctx = _ctx()
    system = _BUILT[name]
    losses: list[float] = []
    times: list[float] = []
    zbytes = pbytes = faults = 0
    by_collective: dict[str, int] = {}
    zby_collective: dict[str, int] = {}
    dist.barrier()
    for i in range(untimed + count):
        x, y = ctx.batches[system.steps_done % len(ctx.batches)]
        timed = i >= untimed
        with zf.count_bytes() as zc, _count.counting() as pc:
            _sync()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            loss = system.step(x, y)
            _sync()
            t1 = time.perf_counter()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        system.steps_done += 1
        losses.append(float(loss))
        if timed:
            times.append(t1 - t0)
            faults += f1 - f0
            zbytes += zc.bytes_sent
            pbytes += pc.bytes_sent
            for k, v in pc.by_collective.items():
                by_collective[k] = by_collective.get(k, 0) + v
            for k, v in zc.by_collective.items():
                zby_collective[k] = zby_collective.get(k, 0) + v
    system.settle()
    per = max(count, 1)
    return {
        "times": times,
        "losses": losses,
        "zerofn_bytes": zbytes / per if count else None,
        "python_bytes": pbytes / per if count else None,
        "python_by_collective": {k: v / per for k, v in by_collective.items()},
        "zerofn_by_collective": {k: v / per for k, v in zby_collective.items()},
        "minor_faults": faults / per if count else None,
    }


def describe(name: str) -> dict[str, Any]:
    """State bytes, zerofn's layout facts and memory of this rank for ``name``."""
    system = _BUILT[name]
    out: dict[str, Any] = {"state": system.state_bytes(), "steps_done": system.steps_done}
    out["compile"] = system.compile_times()
    layout = system.zerofn_layout()
    if layout is not None:
        out["shard_elems"] = sum(s.shard_numel for s in layout.params)
        out["padded_elems"] = sum(s.padded_numel for s in layout.params)
        out["elem_size"] = layout.params[0].dtype.itemsize
    return out


def eval_loss(name: str) -> float:
    """Loss of ``name``'s current full params on batch 0 of this rank (no grad)."""
    ctx = _ctx()
    system = _BUILT[name]
    params = system.full_params()
    if params is None:
        return math.nan
    ref = models.build_model(ctx.cfg, ctx.seed, ctx.device)
    x, y = ctx.batches[0]
    with torch.no_grad():
        return float(system.loss(torch.func.functional_call(ref, params, (x,)), y))


def drop(name: str) -> None:
    system = _BUILT.pop(name, None)
    if system is not None:
        system.close()


def memory() -> dict[str, int]:
    """This process's RSS and peak RSS (VmHWM), and the CUDA peak when on a GPU."""
    out = _proc_status()
    if _ctx().device.type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def profile(name: str, steps: int, untimed: int, row_limit: int = 45) -> dict[str, Any]:
    """Profile ``name`` on every rank: ``steps`` steps under torch.profiler (with ``bench.*``
    phase ranges), then ``steps`` more under cProfile (Python functions). Tables as text."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    global _PROFILING
    run_block(name, 0, untimed)
    plain = run_block(name, steps)["times"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _ctx().device.type == "cuda" else [])
    _PROFILING = True
    try:
        with tprofile(activities=activities) as tp:
            traced = run_block(name, steps)["times"]
    finally:
        _PROFILING = False
    prof = cProfile.Profile()
    prof.enable()
    run_block(name, steps)
    prof.disable()
    texts = {}
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(row_limit)
        texts[key] = buf.getvalue()
    events = tp.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key.startswith("bench.")}
    return {
        "times": plain,
        "traced_times": traced,
        "phases_ms": phases,
        "torch": events.table(sort_by="self_cpu_time_total", row_limit=row_limit),
        "torch_total": events.table(sort_by="cpu_time_total", row_limit=row_limit),
        "cprofile_cumulative": texts["cumulative"],
        "cprofile_tottime": texts["tottime"],
    }


def parts(reps: int, bucket_numel: int | None = None) -> list[tuple[str, float, float]]:
    """Each part of a zerofn stage-2 step and of a DDP step, timed alone: min over ``reps`` (ms).

    Two figures per part: wall time, and the process's CPU time (``time.process_time``:
    every thread of the rank, gloo's communication threads and the kernel's copies for
    the loopback sockets included). The minimum is the figure least disturbed by other
    load on the machine. Collective parts start after a barrier, so they time the
    collective, not the wait for the slowest rank. The bucket parts are the pieces of
    :mod:`zerofn.buckets` that every path (functional and facade) runs.
    """
    from zerofn import stages

    ctx = _ctx()
    n, device = ctx.world, ctx.device
    bucket_numel = bucket_numel or ctx.bucket_numel or stages.DEFAULT_BUCKET_NUMEL  # what the systems ran with
    model = models.build_model(ctx.cfg, ctx.seed, device)
    lossf = models.loss_fn(ctx.cfg)
    x, y = ctx.batches[0]
    params = dict(model.named_parameters())
    out: list[tuple[str, float, float]] = []

    def timed(label: str, fn: Callable[[], Any], collective: bool = False) -> None:
        best = cpu = math.inf
        for _ in range(reps):
            if collective:
                dist.barrier()
            _sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            _sync()
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        out.append((label, best * 1e3, cpu * 1e3))

    def fwd() -> None:
        lossf(model(x), y)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        lossf(model(x), y).backward()

    timed("model: forward (graph built, then dropped)", fwd)
    timed("model: forward + backward (no hooks, no DDP)", fwd_bwd)
    fwd_bwd()
    grads = {name: p.grad.detach().clone() for name, p in params.items()}
    detached = {name: p.detach().clone() for name, p in params.items()}
    state = zf.shard_params(detached, zf.optim.adamw(**_adamw_kwargs("fused")))
    layout = state.layout
    buckets = plan_buckets(layout, bucket_numel)
    dtype = torch.float32
    out.append(
        (f"  ({len(buckets)} buckets of <= {bucket_numel:,} elements, {len(layout.params)} params)", math.nan, math.nan)
    )

    def flatten() -> list[torch.Tensor]:
        return [zf.buckets.pack_grads(grads, layout, b) for b in buckets]

    timed("zerofn reduce: pack grads into rank-major buckets, x1/N fused (fresh rows)", flatten)
    staging = torch.empty(max(n * b.shard_numel for b in buckets), dtype=dtype, device=device)

    def flatten_reused() -> None:
        for b in buckets:
            zf.buckets.pack_grads(grads, layout, b, out=staging[: n * b.shard_numel].view(n, b.shard_numel))

    timed("zerofn reduce: the same into one reused buffer (the facade's staging)", flatten_reused)
    rows = flatten()

    def reduce_each(how: str) -> None:
        for b, r in zip(buckets, rows, strict=True):
            zf.buckets.launch_reduce(r, layout, b, None, how).wait()

    timed(
        "zerofn reduce: all_to_all of the buckets, rows added in rank order (gloo default)",
        lambda: reduce_each("all_to_all"),
        True,
    )
    timed("zerofn reduce: all_reduce of the buckets (stage 1)", lambda: [dist.all_reduce(r) for r in rows], True)

    def all_reduce_async() -> None:
        for h in [dist.all_reduce(r, async_op=True) for r in rows]:
            h.wait()

    timed("zerofn reduce: the same, all launched async, then waited", all_reduce_async, True)
    timed("zerofn reduce: reduce_scatter of the buckets (byte-optimal)", lambda: reduce_each("reduce_scatter"), True)
    present = set(layout.names)
    shards: dict[str, torch.Tensor] = {}

    def split() -> None:
        for b, r in zip(buckets, rows, strict=True):
            shards.update(zf.buckets.split_row(r[ctx.rank], layout, b, present))

    timed("zerofn reduce: cut own row into shards (clone)", split)
    timed("zerofn reduce: reduce_grads() whole (check + all above)", lambda: zf.reduce_grads(grads, layout), True)
    timed("zerofn reduce: check_ranks_agree (tiny all_gather)", lambda: zf.check_ranks_agree(layout, None, "x"), True)
    gshards = zf.reduce_grads(grads, layout)
    timed(
        "zerofn step: global norm (float64 sums) + scalar all_reduce",
        lambda: stages.global_grad_norm(gshards, None, device=device),
        True,
    )
    st = {"s": state}

    def adam_shards() -> None:
        s = st["s"]
        master, opt_state = s.optimizer.update(gshards, s.opt_state, s.master, donate=True)
        st["s"] = s.replace(master=master, opt_state=opt_state)

    timed("zerofn step: fused AdamW kernel on the shards (Ψ/N)", adam_shards)
    timed(
        "zerofn step: step_shards() whole (donate=True)",
        lambda: st.update(s=zf.step_shards(st["s"], dict(gshards), donate=True)[0]),
        True,
    )
    s = st["s"]
    cat_rows = [zf.buckets.pack_shards(s.master, layout, b, dtype=dtype) for b in buckets]
    timed(
        "zerofn gather: pack master shards into bucket rows",
        lambda: [zf.buckets.pack_shards(s.master, layout, b, dtype=dtype) for b in buckets],
    )
    timed(
        "zerofn gather: one broadcast per rank per bucket (gloo default)",
        lambda: [zf.buckets.launch_gather(r, None, "broadcast").wait() for r in cat_rows],
        True,
    )

    def broadcast_async() -> None:
        for p in [zf.buckets.launch_gather(r, None, "broadcast", async_op=True) for r in cat_rows]:
            p.wait()

    timed("zerofn gather: the same, all launched async (overlap_allgather), then waited", broadcast_async, True)
    timed(
        "zerofn gather: all_gather per bucket (byte-optimal)",
        lambda: [zf.buckets.launch_gather(r, None, "all_gather").wait() for r in cat_rows],
        True,
    )
    gathered = [zf.buckets.launch_gather(r, None, "broadcast").wait() for r in cat_rows]

    def unflatten() -> None:
        with torch.no_grad():
            for b, g in zip(buckets, gathered, strict=True):
                zf.buckets.unpack_rows(g, layout, b, params)

    timed("zerofn gather: copy gathered rows into the params", unflatten)
    timed("zerofn gather: gather_params(out=params) whole", lambda: zf.gather_params(s, out=params), True)
    # DDP's side: one all-reduce of Ψ in its 25 MiB buckets, AdamW over all of Ψ.
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    chunk = 25 * 2**20 // 4
    ddp_buckets = [flat[i : i + chunk].clone() for i in range(0, flat.numel(), chunk)]
    timed(
        f"DDP: all_reduce of Ψ in {len(ddp_buckets)} x 25 MiB buckets",
        lambda: [dist.all_reduce(b) for b in ddp_buckets],
        True,
    )
    flat2 = torch.empty_like(flat)
    timed("DDP: copy grads into / out of its buckets (2 x Ψ memcpy)", lambda: [flat2.copy_(flat), flat.copy_(flat2)])
    for name, p in params.items():
        p.grad = grads[name]
    for kernel in ("fused", "foreach"):
        opt = torch.optim.AdamW(params.values(), **_adamw_kwargs(kernel))
        opt.step()  # state
        timed(f"DDP: AdamW({kernel}=True) on all of Ψ", opt.step)
    return out
