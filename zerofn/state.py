"""``ZeroState``: everything one rank holds between steps, as an immutable value."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from zerofn import flat
from zerofn._torch_driver import state_for_compile
from zerofn.layout import DEFAULT_BUCKET_NUMEL, ShardLayout
from zerofn.lowbit import state_nbytes
from zerofn.optim import Optimizer
from zerofn.precision import LossScaleState, PrecisionPolicy

__all__ = ["DEFAULT_POLICY", "StepInfo", "ZeroState"]

# The policy of a state built without one: every param keeps its own dtype, float32
# master shards next to the params, no loss scaling, non-finite steps skipped.
DEFAULT_POLICY = PrecisionPolicy(mixed_dtypes="keep")
NO_LOSS_SCALE = LossScaleState(1.0, 0, 0)


_NOT_A_DICT = (
    "optimizer.state is a zerofn.ZeroState, not torch's dict param -> {key: tensor}: each rank holds only its "
    "shards of the optimizer state. For the whole state in torch's format use optimizer.state_dict()['state'] "
    "(entries by param index, as torch numbers them; a collective: call it on every rank). For this rank's "
    "shards read the ZeroState's fields: state.opt_state (e.g. state.opt_state.exp_avg[name]), "
    "state.master[name], state.step, with the names in state.layout.names"
)


@dataclasses.dataclass(frozen=True)
class ZeroState:
    """One rank's ZeRO state: its master shards, optimizer-state shards and loss scale.

    A pytree whose leaves are the tensors, the step count and the three 0-d tensors of the
    loss-scale state; ``layout``, ``optimizer``, ``rank``, ``precision``, ``param_device`` and
    ``bucket_numel`` are static metadata carried in the tree's context, so ``tree_map`` over a state
    touches tensors only.

    Attributes:
      layout: the :class:`~zerofn.layout.ShardLayout` every rank agrees on.
      optimizer: the functional optimizer that ``step_shards`` applies.
      rank: this rank's index in the sharding group; ``master`` holds chunk ``rank``.
      master: name -> ``(shard_numel,)`` master shard, padding zero, for a split param;
        the full-shape master of a whole param this rank owns (absent if another rank
        owns it). In
        ``precision.master_dtype_for`` its working dtype (float32 by default, float64 for a
        float64 param), or in the param's working dtype
        when ``precision.master_weights`` is False; on ``precision.state_device`` (the CPU for
        CPU offload) or else on the params' device.
      opt_state: the optimizer's state NamedTuple over the same shard shapes (same device).
      step: completed (not skipped) optimizer steps, a 0-d int64 tensor (as ``torch.optim``
        keeps its ``step``), so one step body serves eager and compiled calls;
        ``int(state.step)`` reads it. It and the loss-scale state live on the params'
        device (:attr:`work_device`), with the gradients and the scalar all-reduce they
        meet, also under CPU offload.
      loss_scale: the loss scaler's :class:`~zerofn.precision.LossScaleState`, its three
        fields 0-d tensors (float64 scale, int64 counters) on the params' device; advanced
        by every ``step_shards``, skipped steps included (that is how the scaler backs off).
      precision: the :class:`~zerofn.precision.PrecisionPolicy` the state was built with
        (static): its loss scaler, ``nonfinite`` rule and dtypes drive ``step_shards``.
      param_device: where the full (working) params live, as a string: gradients come
        from there and ``gather_params`` puts params there. ``None``: the master's device.
      residual: with a compressed wire and error feedback (``precision.wire``), what
        quantization lost of the gradient chunks this rank sends: per bucket of
        ``plan_buckets(layout, bucket_numel)``, an ``(N - 1, c)`` float32 tensor over its ``c``
        compressed columns, on the params' device, in the loss scale's units; ``()``
        otherwise. ``reduce_grads`` adds it before quantizing and returns the next one,
        which ``step_shards`` keeps unless the step is skipped.
      bucket_numel: padded elements per bucket of ``gather_params`` when it is not given
        one (static; ``shard_params(bucket_numel=...)`` sets it).
      agreed_in: not ``None`` when every rank of a group confirmed, in the scalar all-reduce
        of the ``step_shards`` that returned this state, that it holds a state of this
        layout and ``bucket_numel``: the group's name (``""`` for the default group). Then
        ``gather_params`` with the state's buckets needs no agreement of its own. Not part
        of the pytree (a state rebuilt from its leaves is unconfirmed), nor compared;
        :meth:`replace` drops it when the layout, rank or bucket size changes.
    """

    layout: ShardLayout
    optimizer: Optimizer
    rank: int
    master: flat.FlatDict
    opt_state: Any
    step: torch.Tensor | int = 0  # a state built by hand may pass numbers: see as_tensors
    loss_scale: LossScaleState = NO_LOSS_SCALE
    precision: PrecisionPolicy = DEFAULT_POLICY
    param_device: str | None = None
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    residual: tuple[torch.Tensor, ...] = ()
    agreed_in: str | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # One representation: the master shards are a FlatDict on the rank's flat layout. Shards
        # given per name (a state built by hand, or read from a checkpoint) are packed here, once.
        master, opt_state = flat.held_flat(self.layout, self.rank, self.master, self.opt_state)
        if master is not self.master:
            object.__setattr__(self, "master", master)
            object.__setattr__(self, "opt_state", opt_state)

    def replace(self, **changes: Any) -> ZeroState:
        if "agreed_in" not in changes and changes.keys() & {"layout", "rank", "bucket_numel"}:
            changes["agreed_in"] = None  # what the ranks confirmed no longer describes the state
        return dataclasses.replace(self, **changes)

    # A torch optimizer's ``state`` is a dict param -> {key: tensor}; code ported from one
    # (``opt.state[p]["exp_avg"]``, ``for s in opt.state.values()``) gets told where to look.
    def __getitem__(self, key: Any) -> Any:
        raise TypeError(_NOT_A_DICT)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(_NOT_A_DICT)

    def __contains__(self, key: Any) -> bool:
        raise TypeError(_NOT_A_DICT)

    def get(self, key: Any, default: Any = None) -> Any:
        raise TypeError(_NOT_A_DICT)

    def keys(self) -> Any:
        raise TypeError(_NOT_A_DICT)

    def values(self) -> Any:
        raise TypeError(_NOT_A_DICT)

    def items(self) -> Any:
        raise TypeError(_NOT_A_DICT)

    def _with_tensor_numbers(self) -> ZeroState:
        """This state with its step count and loss-scale state as 0-d tensors (itself if they are).

        ``shard_params`` and the checkpoint loaders make them so; a state built by hand
        with Python numbers gets an int64 ``step`` and a float64 scale and two int64
        counters on the params' device (:attr:`work_device`). Nothing else is copied.
        """
        if isinstance(self.step, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in self.loss_scale):
            return self
        step, loss_scale = tensor_numbers(self.step, self.loss_scale, self.work_device)
        return self.replace(step=step, loss_scale=loss_scale)

    def as_tensors(self) -> ZeroState:
        """This state ready for a compiled step; with most optimizers the state itself.

        The step count and the loss-scale state are 0-d tensors already, from
        ``shard_params`` on (a state built by hand with Python numbers gets them here, on
        the params' device, as ``step_shards`` converts them eagerly). Optimizer state
        that torch creates lazily as zeros at a param's first step (``torch.optim.Muon``'s
        momentum buffers, through :func:`~zerofn.torch_optim.from_torch`) is created here,
        as the same zeros, so that the compiled step's state keeps one structure. Tensors are shared, nothing is copied.
        """
        state = self._with_tensor_numbers()
        opt_state = state_for_compile(state.optimizer, state.opt_state, state.master)
        return state if opt_state is state.opt_state else state.replace(opt_state=opt_state)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this rank holds: master shards, optimizer state (a
        low-bit state tensor counts its codes, block scales and code table, not the fp32 it
        appears as) and the compressed wire's residual."""
        leaves = pytree.tree_leaves((self.master, self.opt_state, self.residual))
        return sum(state_nbytes(t) for t in leaves if isinstance(t, torch.Tensor))

    @property
    def state_device(self) -> torch.device:
        """Where the master shards and the optimizer state live.

        A rank that holds no master tensor (every param whole and owned elsewhere) reports
        ``precision.state_device``, else the params' device.
        """
        if self.master:
            return next(iter(self.master.values())).device
        if self.precision.state_device is not None:
            return torch.device(self.precision.state_device)
        return torch.device(self.param_device or "cpu")

    @property
    def work_device(self) -> torch.device:
        """Where the full params and gradients live (``param_device``, else the state's device)."""
        return torch.device(self.param_device) if self.param_device is not None else self.state_device


def tensor_numbers(
    step: torch.Tensor | int, loss_scale: LossScaleState, device: torch.device | str
) -> tuple[torch.Tensor, LossScaleState]:
    """``step`` as a 0-d int64 tensor and ``loss_scale`` as a float64 scale and two int64 counters, on ``device``.

    Fields that are tensors already are kept as they are.
    """

    def tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        return torch.tensor(float(value) if dtype.is_floating_point else int(value), dtype=dtype, device=device)

    scale, tracker, left = loss_scale
    return tensor(step, torch.int64), LossScaleState(
        tensor(scale, torch.float64), tensor(tracker, torch.int64), tensor(left, torch.int64)
    )


pytree.register_pytree_node(
    ZeroState,
    lambda s: (
        [s.master, s.opt_state, s.step, s.loss_scale, s.residual],
        (s.layout, s.optimizer, s.rank, s.precision, s.param_device, s.bucket_numel),
    ),
    # A leaf-by-leaf copy gives every name its own step count: shared again here, where that happens.
    lambda children, ctx: ZeroState(
        ctx[0],
        ctx[1],
        ctx[2],
        children[0],
        flat.reshare_steps(children[1]),
        *children[2:4],
        precision=ctx[3],
        param_device=ctx[4],
        bucket_numel=ctx[5],
        residual=tuple(children[4]),
    ),
    serialized_type_name="zerofn.ZeroState",
)


class StepInfo(NamedTuple):
    """What ``step_shards`` found out on the way.

    In a compiled step (``torch.compile``) the three fields are 0-d tensors (float64,
    bool, float64) with the same values: reading them as numbers is the host sync the
    graph leaves to its caller.

    Attributes:
      grad_norm: the global norm of the true (unscaled) mean gradient over the group,
        before clipping, a float; ``inf`` when some gradient element was not finite.
      skipped: True when the step was not applied (a non-finite gradient on any rank).
      clip_coef: the clipping factor applied to the true gradients (1.0 when not
        clipped); the gradients themselves were multiplied by ``clip_coef / loss scale``.
    """

    grad_norm: float
    skipped: bool
    clip_coef: float
