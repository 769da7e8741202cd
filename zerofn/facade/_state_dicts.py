"""``ZeroOptimizer``'s state dicts and checkpoints: the torch.optim format and sharded saves.

A mixin of :class:`~zerofn.facade.optimizer.ZeroOptimizer` (kept apart so the class reads
as construction + training loop): every method here waits for pending param gathers,
brings the live ``param_groups`` hyperparameters into the state, and hands the work to
:mod:`zerofn.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from zerofn import _comm as comm
from zerofn import checkpoint, optim, torch_optim
from zerofn.checkpoint import _async
from zerofn.state import ZeroState

__all__ = ["StateDictMethods"]


class _Host(Protocol):
    """What the methods below read from the ZeroOptimizer they are mixed into."""

    _state: ZeroState
    _params: dict[str, torch.Tensor]
    _group: comm.Group
    _replicate: comm.Group
    _bucket_numel: int
    _group_names: list[list[str]]
    _hp_cache: tuple[Any, ...] | None
    _reducer: Any
    _module: torch.nn.Module | None
    _entry: Any
    param_groups: list[dict[str, Any]]

    def wait_params(self) -> None: ...

    def _current_optimizer(self) -> optim.Optimizer: ...

    def _adopt(self, new: ZeroState) -> None: ...

    def _master_dtype(self) -> torch.dtype: ...

    def _params_written(self) -> None: ...

    def _fold_writes(self, where: str) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...


class StateDictMethods:
    """``state_dict`` / ``load_state_dict`` / ``state_dict_shard`` / ``save_checkpoint`` / ``load_checkpoint``."""

    def state_dict(self: _Host) -> dict[str, Any] | list[dict[str, Any]]:  # type: ignore[override]
        """The whole optimizer state in ``torch.optim`` format (see ``zerofn.checkpoint``).

        Over a list of torch optimizers (``ZeroOptimizer([muon, adamw], ...)``): a list of
        such dicts, one per wrapped optimizer in order, each numbering only its params, so
        ``muon.load_state_dict(sd[0])`` works on a plain ``torch.optim.Muon`` over the same
        params.

        Weights written into the model since the last step (``model.load_state_dict``,
        in-place edits) are first taken into the masters, as ``step`` would take them.

        Collective: every rank gathers the full state (all ranks must call it; on some
        ranks only it raises :class:`~zerofn.NotJoinedError` after ``entry_timeout``:
        :mod:`zerofn.facade._entry`). Before the gathers: the entry wait (one monitored
        barrier) and one scalar all-reduce (did any rank's params change since the step).
        """
        self._entry.join("state_dict")  # a collective: every rank must call it (bounded wait)
        self._fold_writes("ZeroOptimizer.state_dict")
        self._state = self._state.replace(optimizer=self._current_optimizer())
        buffers = checkpoint.persistent_buffers(self._module) if self._module is not None else None
        return checkpoint.full_state_dict(self._state, self._group, bucket_numel=self._bucket_numel, buffers=buffers)

    def load_state_dict(self: _Host, state_dict: Mapping[str, Any] | list[Mapping[str, Any]]) -> None:  # type: ignore[override]
        """Load a state dict from ``state_dict()`` (any world size) or from a torch optimizer.

        As in torch, the saved hyperparameters replace those in ``param_groups``. Master
        weights come from the state dict's ``zerofn`` entry when present, else from the
        model's current params; with ``module=``, the model's persistent buffers take the
        ones saved in that entry (a dict without them leaves the buffers as they are). Over
        a list of torch optimizers it takes a list of state
        dicts, one per wrapped optimizer in order (from ``state_dict()``, or each from the
        matching plain torch optimizer), and each wrapped optimizer's ``param_groups`` take
        its dict's hyperparameters.

        Everything is validated before anything changes (per-param state keys, shapes and
        dtypes against what the optimizer declares, param counts per group, hyperparameters:
        :mod:`zerofn._state_dict_checks`): on failure every rank raises
        :class:`~zerofn.checkpoint.CheckpointError` and the state, the masters, the
        ``param_groups`` and the model are what they were.

        Collectives: one all-gather of each rank's verdict (a few bytes) over the shard
        group (and the replicate group of a hybrid layout), so a rank whose state dict does
        not load makes every rank raise instead of leaving the others to train on.
        """
        # master weights may come from the params (the user's writes first), and a late gather would overwrite them
        self._entry.join("load_state_dict")  # a collective: every rank must call it (bounded wait)
        self._fold_writes("ZeroOptimizer.load_state_dict")
        try:
            sizes = _check_list_shape(self, state_dict)
            new = checkpoint.shard_state_dict(
                state_dict,
                self._params,
                self._group,
                optimizer=self._state.optimizer,
                master_dtype=self._master_dtype(),
                group_sizes=sizes,
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
        self._adopt(new)
        if buffers is not None and self._module is not None:  # the model's buffers, as saved with the state
            mine = checkpoint.persistent_buffers(self._module)
            with torch.no_grad():
                for name, value in buffers.items():
                    mine[name].copy_(value)
        dicts = state_dict if isinstance(state_dict, (list, tuple)) else [state_dict]
        saved_groups = [g for d in dicts for g in d["param_groups"]]
        if len(saved_groups) == len(self.param_groups):  # a functional partition has one group of all params
            for group, saved in zip(self.param_groups, saved_groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})

    def _master_dtype(self: _Host) -> torch.dtype:
        """The masters' dtype (a rank holding no master shard: the policy's for the first param)."""
        if self._state.master:
            return next(iter(self._state.master.values())).dtype
        layout = self._state.layout
        return self._state.precision.master_dtype_for(layout[layout.names[0]].dtype)

    def _adopt(self: _Host, new: ZeroState) -> None:
        """Take a loaded state's contents, keeping this facade's static settings."""
        fields = ("optimizer", "master", "opt_state", "step", "loss_scale")
        self._state = self._state.replace(**{f: getattr(new, f) for f in fields if hasattr(new, f)})
        self._hp_cache = None
        self._reducer.drop_shards()

    def state_dict_shard(self: _Host, max_shard_size: int = 1024) -> Iterator[tuple[dict[Any, dict[str, Any]], int]]:
        """Yield ``(block, numel)``: the torch-format ``state`` entries in size-bounded blocks.

        ``max_shard_size`` counts tensor elements per block (a param larger than it forms a
        block of its own). Params without optimizer state yet are simply absent, as in
        torch. Keys are the torch indices; over a list of torch optimizers they are
        ``(position of the optimizer, index in its state dict)``. Collective: every rank
        must iterate it to the end.
        """
        full = self.state_dict()
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

    def save_checkpoint(
        self: _Host,
        path: str,
        *,
        with_model: bool = True,
        extra: Mapping[str, Any] | None = None,
        rng: bool = True,
        async_save: bool = False,
        safe_globals: Sequence[Any] = (),
    ) -> str | _async.PendingCheckpoint:
        """Sharded, atomic checkpoint of the optimizer state (and the model weights) at ``path``.

        With ``with_model`` and ``module=``, the model's persistent buffers (BatchNorm
        running stats) are saved too (rank 0's, as DDP's rank-0 ``model.state_dict()``).

        ``extra``: the rest of the training state, name -> any object with ``state_dict()``
        and ``load_state_dict()`` (an LR scheduler, a data loader, a counter), saved per
        rank; ``rng``: each rank's RNG states (torch, CUDA, ``random``, NumPy) too. What
        restores at which world size: :func:`zerofn.checkpoint.load`.

        See :func:`zerofn.checkpoint.save`. Weights written into the model since the last
        step are first taken into the masters (as ``step`` would), so the checkpoint holds
        what the model holds. Every rank must call it.

        With ``async_save=True`` it returns a :class:`~zerofn.checkpoint.PendingCheckpoint`
        once this rank's state is copied into CPU memory, and the files are written in the
        background while training goes on; ``path`` moves to the new checkpoint when every
        rank's files are complete. The next save (or load, or :meth:`close`) waits for it.
        ``extra`` and the RNG are captured at the call too. Returns the committed directory
        otherwise.

        ``safe_globals``: the classes beyond data an extra's ``state_dict()`` may pickle
        (admitted by name; recorded, and needed again on load): :func:`zerofn.checkpoint.save`.
        """
        self._entry.join("save_checkpoint")  # a collective: every rank must call it (bounded wait)
        self._fold_writes("ZeroOptimizer.save_checkpoint")
        self._state = self._state.replace(optimizer=self._current_optimizer())
        buffers = checkpoint.persistent_buffers(self._module) if with_model and self._module is not None else None
        return checkpoint.save(
            path,
            self._state,
            self._group,
            params=self._params if with_model else None,
            buffers=buffers,
            replicate_group=self._replicate,
            extra=extra,
            rng=rng,
            async_save=async_save,
            safe_globals=safe_globals,
        )

    def load_checkpoint(
        self: _Host,
        path: str,
        *,
        with_model: bool = True,
        extra: Mapping[str, Any] | None = None,
        rng: bool = True,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        """Resume from :meth:`save_checkpoint` (any world size): state, hyperparameters, weights, buffers.

        With ``with_model`` and ``module=``, the model's persistent buffers take the saved
        ones (names, shapes and dtypes checked first); a checkpoint saved without buffers
        leaves them as they are. ``extra``: the objects to restore the saved extras into,
        exactly the names saved (``None``: none restored); ``rng``: restore each rank's RNG
        (at the saved world size; at another only if it was the same on every rank).
        Every file is read as data; ``safe_globals`` admits by name the classes a checkpoint
        saved with ``safe_globals=`` pickles in its extras (only for a checkpoint you trust).

        Validated before anything changes (:func:`zerofn.checkpoint.load`): on failure every
        rank raises :class:`~zerofn.checkpoint.CheckpointError` and the state, the masters,
        the ``param_groups``, the model, the extras and the RNG are what they were.
        """
        self._entry.join("load_checkpoint")  # a collective: every rank must call it (bounded wait)
        self._fold_writes("ZeroOptimizer.load_checkpoint")  # waits for a late gather, which would overwrite them
        params_out = self._params if with_model else None
        buffers_out = checkpoint.persistent_buffers(self._module) if with_model and self._module is not None else None
        new = checkpoint.load(
            path,
            self._params,
            self._group,
            optimizer=self._state.optimizer,
            params_out=params_out,
            buffers_out=buffers_out,
            extra=extra,
            rng=rng,
            safe_globals=safe_globals,
        )
        self._adopt(new)
        if with_model:
            self._params_written()  # the loaded weights are the facade's own write, not the user's
        for i, group in enumerate(self.param_groups):
            names = self._group_names[i]
            if names:
                # A partition (a list of torch optimizers): the part that updates the group's params.
                opt = new.optimizer
                if opt.parts:
                    opt = opt.parts[opt.part_index(names[0])][1]
                group.update(torch_optim.group_hyperparams(opt, opt.hyperparams(names[0])))


def _saved_buffers(state_dict: Any) -> Mapping[str, torch.Tensor] | None:
    """The model buffers a state dict from ``state_dict()`` carries (``None``: none, e.g. a torch optimizer's)."""
    first = state_dict[0] if isinstance(state_dict, (list, tuple)) and state_dict else state_dict
    zmeta = first.get("zerofn") if isinstance(first, Mapping) else None
    return zmeta.get("buffers") if isinstance(zmeta, Mapping) else None


def _check_list_shape(host: _Host, state_dict: Any) -> list[int] | None:
    """The group sizes a single state dict must have; for a partition, the list checked here.

    A facade over ``k`` torch optimizers takes a list of ``k`` dicts, dict ``i`` with the
    param counts of optimizer ``i``'s groups (groups without trainable params aside, as
    :func:`zerofn.checkpoint.full_state_dict` leaves them out). Raises ``CheckpointError``
    naming the position; returns ``None`` (nothing left to check here) for a partition.
    """
    parts = host._state.optimizer.parts
    if not parts:
        if isinstance(state_dict, (list, tuple)):
            raise checkpoint.CheckpointError(
                f"got a list of {len(state_dict)} state dicts, but this ZeroOptimizer wraps one optimizer: pass "
                "the one dict its state_dict() returns"
            )
        return [len(names) for names in host._group_names]
    if not isinstance(state_dict, (list, tuple)) or len(state_dict) != len(parts):
        got = f"a list of {len(state_dict)}" if isinstance(state_dict, (list, tuple)) else "one dict"
        raise checkpoint.CheckpointError(
            f"this ZeroOptimizer wraps {len(parts)} optimizers: load_state_dict takes a list of {len(parts)} state "
            f"dicts, one per wrapped optimizer in order (as its state_dict() returns); got {got}"
        )
    spans = [len(part.groups) for _, part in parts]
    if sum(spans) != len(host._group_names):
        return None  # a functional partition: its parts' groups are not the facade's param_groups
    start = 0
    for i, (span, full) in enumerate(zip(spans, state_dict, strict=True)):
        want = [len(names) for names in host._group_names[start : start + span] if names]
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
