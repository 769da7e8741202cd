"""What a sharded checkpoint holds: the one value a load reads and checks before any tensor.

:class:`Manifest` is ``zerofn.json`` parsed (or, on save, built from the state): the
params' names, shapes, dtypes and placements, how each param's optimizer state was
written (its *kinds*), the optimizer and its saved hyperparameters, the step, the
loss-scale state, and whether model weights and buffers are in it. Checkpoints written
before a field existed read with that field's old meaning (no ``placements``: every param
split; no ``part_groups``: the given partition's hyperparameters). No collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zerofn import optim
from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._format import EXTRAS_FORMAT, FORMAT_VERSION
from zerofn.checkpoint._optimizer import (
    group_plan,
    loss_scale_to_dict,
    optimizer_for,
    part_groups,
    saved_optimizer,
    with_part_groups,
)
from zerofn.state import ZeroState

__all__ = ["Manifest"]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A sharded checkpoint's metadata (``zerofn.json``), as one immutable value.

    Attributes:
      names: the params, in layout order; ``shapes`` and ``dtypes`` (``"float32"``) alike.
      master_dtypes: name -> dtype of the saved master weights.
      placements: name -> ``"split"``, ``"whole"`` or ``"blocked(B)"``.
      state_kinds: name -> state key -> how it was written: ``shard:<dtype>`` (per element,
        a DTensor over the flat param), ``lowbit:<kind>:<dtype>`` (quantized codes and
        scales), ``whole:<dtype>:<AxB>`` (a whole param's state, full-shaped),
        ``scalar:<dtype>:<device>`` (0-d) or ``json:<value>``.
      param_groups: the saved groups: ``{"params": [names], **hyperparameters}``.
      part_groups: a partition's parts, ``{"optimizer": name, "param_groups": [...]}`` each.
      optimizer: ``{"name": ..., "torch_class": ...}`` of the optimizer that saved it.
      step, loss_scale: the completed steps and the loss scaler's state (or ``None``).
      saved_world_size: the world size that wrote it (any world size reads it).
      model: the names of the saved model weights (``None``: saved without ``params=``).
      buffers: name -> ``[shape, dtype]`` of the saved buffers (``None``: none saved).
      extras: the ``extra=`` keys saved -> whether that state was the same on every rank
        (``None``: saved without extras, or before they existed); see ``_extras``.
      rng: whether the ranks' RNG states were all the same (``None``: RNG not saved).
      extras_format: how the extras files hold their states (``_format.EXTRAS_FORMAT``;
        1 for checkpoints written before the field: a pickled NumPy RNG key).
      pickled: the globals (``module.qualname``) beyond data that the extras files pickle,
        which the caller admitted with ``safe_globals=`` at save (``None``: none). A load
        asks its caller to admit them again; this record admits nothing by itself.
      residual: the compressed params whose wire residual was saved (``None``: none), each
        as the DCP entry ``residual/<name>``: float32 ``(saved_world_size, numel)``, row
        ``s`` written by rank ``s`` (:mod:`zerofn.checkpoint._residual`).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    master_dtypes: Mapping[str, str]
    placements: Mapping[str, str]
    state_kinds: Mapping[str, Mapping[str, str]]
    param_groups: tuple[Mapping[str, Any], ...]
    part_groups: tuple[Mapping[str, Any], ...] | None
    optimizer: Mapping[str, str]
    step: int
    loss_scale: Mapping[str, Any] | None
    saved_world_size: int
    model: tuple[str, ...] | None
    buffers: Mapping[str, list[Any]] | None
    extras: Mapping[str, bool] | None = None
    rng: bool | None = None
    extras_format: int = EXTRAS_FORMAT
    pickled: tuple[str, ...] | None = None
    residual: tuple[str, ...] | None = None

    @classmethod
    def of(
        cls,
        state: ZeroState,
        kinds: Mapping[str, Mapping[str, str]],
        master_dtypes: Mapping[str, str],
        model: list[str] | None,
        buffers: Mapping[str, list[Any]] | None,
        extras: Mapping[str, bool] | None = None,
        rng: bool | None = None,
        pickled: tuple[str, ...] | None = None,
        residual: tuple[str, ...] | None = None,
    ) -> Manifest:
        """What a save of ``state`` writes (``kinds`` and ``master_dtypes`` of every param)."""
        layout = state.layout
        return cls(
            names=tuple(layout.names),
            shapes=tuple(tuple(p.shape) for p in layout.params),
            dtypes=tuple(str(p.dtype).removeprefix("torch.") for p in layout.params),
            master_dtypes={n: master_dtypes[n] for n in layout.names},
            placements={p.name: p.placement for p in layout.params},
            state_kinds=kinds,
            param_groups=tuple({**hp, "params": names} for names, hp in group_plan(state.optimizer, layout.names)),
            # A partition's hyperparameters live in its parts (a list of torch optimizers in the facade).
            part_groups=tuple(part_groups(state.optimizer, layout.names)) if state.optimizer.parts else None,
            optimizer={"name": state.optimizer.name, "torch_class": state.optimizer.torch_class.__name__},
            step=int(state.step),
            loss_scale=loss_scale_to_dict(state),
            saved_world_size=layout.world_size,
            model=tuple(model) if model is not None else None,
            buffers=buffers,
            extras=extras,
            rng=rng,
            pickled=tuple(pickled) if pickled else None,
            residual=tuple(residual) if residual else None,
        )

    @classmethod
    def from_json(cls, meta: Mapping[str, Any]) -> Manifest:
        """Parse ``zerofn.json``. Raises :class:`CheckpointError` for another format version
        and ``KeyError`` / ``TypeError`` / ``ValueError`` for metadata that is not zerofn's."""
        version = meta["version"]
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"the checkpoint has format version {version!r}; this zerofn reads version {FORMAT_VERSION}: "
                "load it with the zerofn release that wrote it"
            )
        names = tuple(meta["names"])
        return cls(
            names=names,
            shapes=tuple(tuple(int(d) for d in s) for s in meta["shapes"]),
            dtypes=tuple(meta["dtypes"]),
            master_dtypes=dict(zip(names, meta["master_dtypes"], strict=True)),
            placements=dict(zip(names, meta.get("placements") or ["split"] * len(names), strict=True)),
            state_kinds={n: dict(k) for n, k in meta["state_kinds"].items()},
            param_groups=tuple(meta["param_groups"]),
            part_groups=tuple(meta["part_groups"]) if meta.get("part_groups") else None,
            optimizer=dict(meta["optimizer"]),
            step=int(meta["step"]),
            loss_scale=meta.get("loss_scale"),
            saved_world_size=int(meta["saved_world_size"]),
            model=tuple(meta["model"]) if meta.get("model") is not None else None,
            buffers=meta.get("buffers"),
            extras=meta.get("extras"),
            rng=meta.get("rng"),
            extras_format=int(meta.get("extras_format", 1)),
            pickled=tuple(str(n) for n in meta["pickled"]) if meta.get("pickled") else None,
            residual=tuple(str(n) for n in meta["residual"]) if meta.get("residual") else None,
        )

    def to_json(self) -> dict[str, Any]:
        """``zerofn.json``'s content (without ``files``, which the writer adds)."""
        return {
            "version": FORMAT_VERSION,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "master_dtypes": [self.master_dtypes[n] for n in self.names],
            "placements": [self.placements[n] for n in self.names],
            "state_kinds": {n: dict(k) for n, k in self.state_kinds.items()},
            "param_groups": list(self.param_groups),
            "part_groups": list(self.part_groups) if self.part_groups is not None else None,
            "optimizer": dict(self.optimizer),
            "step": self.step,
            "loss_scale": self.loss_scale,
            "saved_world_size": self.saved_world_size,
            "model": list(self.model) if self.model is not None else None,
            "buffers": self.buffers,
            "extras": self.extras,
            "rng": self.rng,
            "extras_format": self.extras_format,
            "pickled": list(self.pickled) if self.pickled else None,
            "residual": list(self.residual) if self.residual else None,
        }

    def params_meta(self) -> dict[str, list[Any]]:
        """``{"names", "shapes", "dtypes"}``, as :func:`~zerofn.checkpoint._validate.check_fits` reads them."""
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes)}

    def saved_kind(self) -> optim.Optimizer:
        """The saved kind of optimizer with its defaults (whose placement rule a load without
        ``optimizer=`` follows). Raises :class:`CheckpointError` for a partition."""
        return saved_optimizer({"optimizer": dict(self.optimizer)})

    def saved_optimizer(self, given: optim.Optimizer | None) -> optim.Optimizer:
        """The optimizer to continue with, built once: ``given`` (or the saved kind) with the
        saved hyperparameters of every param group (a partition's in each of its parts).

        Raises :class:`CheckpointError` when ``given`` is another kind than the saved one,
        or a partition of other parts; without ``given``, when the saved one cannot be
        rebuilt from its name (a partition).
        """
        given = given if given is not None else self.saved_kind()
        opt = optimizer_for([dict(g) for g in self.param_groups], list, {"optimizer": dict(self.optimizer)}, given)
        if opt.parts and self.part_groups:  # checkpoints written before part_groups keep the given ones
            opt = with_part_groups(opt, list(self.part_groups))
        return opt
