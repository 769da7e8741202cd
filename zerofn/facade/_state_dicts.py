"""``ZeroOptimizer``'s state dicts and checkpoints: the torch.optim format and sharded saves.

A :class:`StateDicts` hands the work to :mod:`zerofn.checkpoint` and takes loaded states
in, keeping the facade's static settings; the facade first brings the user's param writes
into the masters (:mod:`~zerofn.facade._writes`) and the live ``param_groups``
hyperparameters into the state (:mod:`~zerofn.facade._hyperparams`), so what is saved is
what the model and the scheduler hold. Each method takes the current
:class:`~zerofn.state.ZeroState`; the loads return the one to keep.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from zerofn import _comm as comm
from zerofn import checkpoint, optim
from zerofn.checkpoint import _async
from zerofn.facade._hyperparams import LiveHyperparams
from zerofn.facade._reducer import GradReducer
from zerofn.state import ZeroState

__all__ = ["StateDicts", "state_dict_blocks"]


class StateDicts:
    """The facade's state dicts and checkpoints (see the module docstring).

    Args:
      params: name -> the model's param (layout order).
      group: the sharding group; replicate: the replicas' group of a hybrid layout or None.
      bucket_numel: the gathers' bucket size.
      group_names: per param group, the names of its params.
      module: the model (``module=``) whose persistent buffers travel with the state, or None.
      reducer: the facade's reducer (a loaded state drops the shards it holds).
      hyperparams: the live hyperparameters (a loaded state resets their cache).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        group: comm.Group,
        replicate: comm.Group,
        *,
        bucket_numel: int,
        group_names: list[list[str]],
        module: torch.nn.Module | None,
        reducer: GradReducer,
        hyperparams: LiveHyperparams,
    ) -> None:
        self._params, self._group, self._replicate = params, group, replicate
        self._bucket_numel, self._group_names, self._module = bucket_numel, group_names, module
        self._reducer, self._hyperparams = reducer, hyperparams

    def full(self, state: ZeroState) -> dict[str, Any] | list[dict[str, Any]]:
        """``state_dict()``: the full state in torch's format (a collective: every rank gathers it)."""
        return checkpoint.full_state_dict(
            state, self._group, bucket_numel=self._bucket_numel, buffers=self._buffers(with_model=True)
        )

    def load(self, state: ZeroState, state_dict: Mapping[str, Any] | list[Mapping[str, Any]]) -> ZeroState:
        """``load_state_dict``: the loaded state (and the model's buffers), validated on every rank first.

        Collectives: one all-gather of each rank's verdict over the shard group (and the
        replicate group), so every rank raises :class:`~zerofn.checkpoint.CheckpointError`
        alike, with nothing changed.
        """
        try:
            sizes = _check_list_shape(state.optimizer, self._group_names, state_dict)
            new = checkpoint.shard_state_dict(
                state_dict,
                self._params,
                self._group,
                optimizer=state.optimizer,
                master_dtype=_master_dtype(state),
                group_sizes=sizes,
                **_residual_options(state),
            )
            buffers = _saved_buffers(state_dict)
            if buffers is not None and self._module is not None:
                checkpoint.check_buffers(
                    {n: [list(b.shape), str(b.dtype).removeprefix("torch.")] for n, b in buffers.items()},
                    checkpoint.persistent_buffers(self._module),
                    "ZeroOptimizer.load_state_dict",
                )
            failure: Exception | None = None
        except (checkpoint.CheckpointError, KeyError, TypeError, ValueError) as e:
            failure = e
        replicas = () if self._replicate is None else (self._replicate,)
        checkpoint.raise_alike(failure, (self._group, *replicas), "ZeroOptimizer.load_state_dict")
        state = self.adopt(state, new)
        if buffers is not None and self._module is not None:  # the model's buffers, as saved with the state
            mine = checkpoint.persistent_buffers(self._module)
            with torch.no_grad():
                for name, value in buffers.items():
                    mine[name].copy_(value)
        return state

    def adopt(self, state: ZeroState, new: ZeroState) -> ZeroState:
        """``state`` with a loaded state's contents, keeping this facade's static settings."""
        fields = ("optimizer", "master", "opt_state", "step", "loss_scale") + (("residual",) if state.residual else ())
        self._hyperparams.reset()
        self._reducer.drop_shards()
        return state.replace(**{f: getattr(new, f) for f in fields if hasattr(new, f)})

    def save(self, state: ZeroState, path: str, *, with_model: bool, **options: Any) -> str | _async.PendingCheckpoint:
        """``save_checkpoint``: :func:`zerofn.checkpoint.save` of ``state`` (and the model); a collective.

        ``options``: ``save_checkpoint``'s ``extra``, ``rng``, ``async_save`` and ``safe_globals``, as given.
        """
        return checkpoint.save(
            path,
            state,
            self._group,
            params=self._params if with_model else None,
            buffers=self._buffers(with_model),
            replicate_group=self._replicate,
            **options,
        )

    def load_checkpoint(self, state: ZeroState, path: str, *, with_model: bool, **options: Any) -> ZeroState:
        """``load_checkpoint``: :func:`zerofn.checkpoint.load` into the params and buffers; the state to keep.

        ``options``: ``load_checkpoint``'s ``extra``, ``rng`` and ``safe_globals``, as given.
        """
        new = checkpoint.load(
            path,
            self._params,
            self._group,
            optimizer=state.optimizer,
            params_out=self._params if with_model else None,
            buffers_out=self._buffers(with_model),
            **options,
            **_residual_options(state),
        )
        return self.adopt(state, new)

    def _buffers(self, with_model: bool) -> dict[str, torch.Tensor] | None:
        """The module's persistent buffers, which travel with the state (``None``: no module, or not ``with_model``)."""
        return checkpoint.persistent_buffers(self._module) if with_model and self._module is not None else None


def _residual_options(state: ZeroState) -> dict[str, Any]:
    """What a load needs to restore the compressed wire's residual (saved per param): the
    policy that keeps it and the buckets it is cut for. Nothing without one."""
    if not state.residual:
        return {}
    return {"precision": state.precision, "bucket_numel": state.bucket_numel}


def state_dict_blocks(
    full: dict[str, Any] | list[dict[str, Any]], max_shard_size: int
) -> Iterator[tuple[dict[Any, dict[str, Any]], int]]:
    """``(block, numel)``: the ``state`` entries of ``full`` in blocks of at most ``max_shard_size`` elements.

    A param larger than it forms a block of its own. Keys are the torch indices; over a list
    of dicts ``(position of the dict, index in its state)``. Nothing here communicates.
    """
    if isinstance(full, list):
        entries = [((k, index), e) for k, d in enumerate(full) for index, e in d["state"].items()]
    else:
        entries = list(full["state"].items())
    block: dict[Any, dict[str, Any]] = {}
    size = 0
    for index, entry in entries:
        numel = sum(v.numel() for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        if block and size + numel > max_shard_size:
            yield block, size
            block, size = {}, 0
        block[index] = entry
        size += numel
    if block:
        yield block, size


def _master_dtype(state: ZeroState) -> torch.dtype:
    """The masters' dtype (a rank holding no master shard: the policy's for the first param)."""
    if state.master:
        return next(iter(state.master.values())).dtype
    layout = state.layout
    return state.precision.master_dtype_for(layout[layout.names[0]].dtype)


def _saved_buffers(state_dict: Any) -> Mapping[str, torch.Tensor] | None:
    """The model buffers a state dict from ``state_dict()`` carries (``None``: none, e.g. a torch optimizer's)."""
    first = state_dict[0] if isinstance(state_dict, (list, tuple)) and state_dict else state_dict
    zmeta = first.get("zerofn") if isinstance(first, Mapping) else None
    return zmeta.get("buffers") if isinstance(zmeta, Mapping) else None


def _check_list_shape(opt: optim.Optimizer, group_names: list[list[str]], state_dict: Any) -> list[int] | None:
    """The group sizes a single state dict must have; for a partition, the list checked here.

    A facade over ``k`` torch optimizers takes a list of ``k`` dicts, dict ``i`` with the
    param counts of optimizer ``i``'s groups (groups without trainable params aside, as
    :func:`zerofn.checkpoint.full_state_dict` leaves them out). Raises ``CheckpointError``
    naming the position; returns ``None`` (nothing left to check here) for a partition.
    """
    parts = opt.parts
    if not parts:
        if isinstance(state_dict, (list, tuple)):
            raise checkpoint.CheckpointError(
                f"got a list of {len(state_dict)} state dicts, but this ZeroOptimizer wraps one optimizer: pass "
                "the one dict its state_dict() returns"
            )
        return [len(names) for names in group_names]
    if not isinstance(state_dict, (list, tuple)) or len(state_dict) != len(parts):
        got = f"a list of {len(state_dict)}" if isinstance(state_dict, (list, tuple)) else "one dict"
        raise checkpoint.CheckpointError(
            f"this ZeroOptimizer wraps {len(parts)} optimizers: load_state_dict takes a list of {len(parts)} state "
            f"dicts, one per wrapped optimizer in order (as its state_dict() returns); got {got}"
        )
    spans = [len(part.groups) for _, part in parts]
    if sum(spans) != len(group_names):
        return None  # a functional partition: its parts' groups are not the facade's param_groups
    start = 0
    for i, (span, full) in enumerate(zip(spans, state_dict, strict=True)):
        want = [len(names) for names in group_names[start : start + span] if names]
        start += span
        groups = full.get("param_groups") if isinstance(full, Mapping) else None
        if not isinstance(groups, (list, tuple)):
            raise checkpoint.CheckpointError(
                f"state dict [{i}] has no 'param_groups' list (from optimizer.state_dict())"
            )
        found = [len(g["params"]) for g in groups if len(g.get("params", ()))]
        if found != want:
            raise checkpoint.CheckpointError(
                f"state dict [{i}] has param groups of {found} params, but wrapped optimizer [{i}] has groups of "
                f"{want} trainable params: it was saved from another optimizer"
            )
    return None
