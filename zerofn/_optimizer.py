"""The functional optimizer as a value, and what every one of them shares.

:class:`Optimizer` (a name, hyperparameters per parameter group, pure ``init`` /
``update``), its :class:`ParamGroup`, the checks and helpers the optimizers of
:mod:`zerofn.optim`, :mod:`zerofn.lowbit` and :mod:`zerofn.torch_optim` build on, and
:func:`~zerofn.optim.partition`, which composes optimizers over one set of params. Import
the public names from :mod:`zerofn.optim`. Nothing here imports an optimizer
implementation, so each of them can import this module without a cycle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from zerofn import _traced, flat
from zerofn._tree import FrozenDict

__all__ = ["NameSelector", "Optimizer", "ParamGroup", "Params", "PartitionState", "partition", "select_unless"]

Params = Mapping[str, torch.Tensor]

#: Name tuples whose grouping one optimizer remembers (a run steps one or a few).
_GROUPINGS_KEPT = 16
NameSelector = Collection[str] | Callable[[str], bool]


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Hyperparameter overrides for the parameters ``select`` picks."""

    select: NameSelector
    hyperparams: Mapping[str, Any]

    def matches(self, name: str) -> bool:
        return self.select(name) if callable(self.select) else name in self.select


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A functional optimizer: hyperparameters plus pure ``init`` and ``update``.

    Build one with :func:`sgd`, :func:`adam` or :func:`adamw`. ``with_hyperparams`` returns
    a copy with new values (how an LR schedule drives it); the state never holds
    hyperparameters, so the same state continues under the new values.

    Attributes:
      name: ``"sgd"``, ``"adam"`` or ``"adamw"``; the torch.optim class it mirrors is
        ``torch_class``.
      defaults: hyperparameters for names no group selects.
      groups: per-group overrides, first match wins.
      static: settings fixed for the whole optimizer that are not hyperparameters of a
        group (a low-bit optimizer's block size); empty for the optimizers here.
    """

    name: str
    defaults: Mapping[str, Any]
    groups: tuple[ParamGroup, ...]
    _init: Callable[[Optimizer, Params], Any] = dataclasses.field(repr=False)
    _update: Callable[..., tuple[dict[str, torch.Tensor], Any]] = dataclasses.field(repr=False)
    torch_class: type[torch.optim.Optimizer] = dataclasses.field(repr=False, default=torch.optim.SGD)
    _place: Callable[[str, tuple[int, ...]], str] | None = dataclasses.field(repr=False, default=None)
    parts: tuple[tuple[NameSelector, Optimizer], ...] = dataclasses.field(repr=False, default=())
    _init_placed: Callable[[Optimizer, Params, Any], Any] | None = dataclasses.field(repr=False, default=None)
    static: Mapping[str, Any] = dataclasses.field(repr=False, default_factory=FrozenDict)
    # Whether ``_update`` honours ``skip=`` itself under the hyperparameters now in force.
    _skips: Callable[[Optimizer], bool] | None = dataclasses.field(repr=False, default=None)

    def placement(self, name: str, shape: tuple[int, ...]) -> str:
        """The placement this optimizer needs for param ``name`` of ``shape``.

        ``"split"`` when the update of every element reads only that element's gradient
        and state (so zerofn may run it on a 1/N shard), ``"whole"`` when it reads the
        whole tensor (Muon, Adafactor: the param then lives on one owner rank),
        ``"blocked(B)"`` when its state is quantized in blocks of ``B`` elements
        (:mod:`zerofn.lowbit`: every rank's chunk is then whole blocks). The
        element-wise optimizers of this module say ``"split"``.

        Raises:
          ValueError: the optimizer cannot update a param of this shape (Muon: not 2-D).
          KeyError: a :func:`partition` selects no optimizer for ``name``.
        """
        if self.parts:
            return self.parts[self.part_index(name)][1].placement(name, shape)
        return self._place(name, tuple(shape)) if self._place is not None else "split"

    def init(self, params: Params, *, layout: Any = None) -> Any:
        """Fresh optimizer state for ``params`` (name -> tensor); reads only shapes/dtypes/devices.

        ``layout``: the :class:`~zerofn.layout.ShardLayout` the params are shards of
        (``shard_params`` and checkpoint loads pass it). An optimizer whose state depends on
        the *global* param (a low-bit one quantizes exactly the params placed
        ``"blocked(B)"``) reads it; without it, ``params`` are taken as full tensors.
        """
        if self.parts:
            return _partition_init(self, params, layout)
        if layout is not None and self._init_placed is not None:
            return self._init_placed(self, params, layout)
        return self._init(self, params)

    def update(
        self, grads: Params, state: Any, params: Params, *, donate: bool = False, skip: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """One optimizer step for the names in ``grads``.

        Args:
          grads: name -> gradient, same shape and dtype as ``params[name]``. Names not in
            ``grads`` (no gradient this step) keep their params and state, as torch.optim
            skips params whose ``.grad`` is ``None``.
          state: from ``init`` or a previous ``update``.
          params: name -> current value.
          donate: if True, update ``params`` and ``state`` tensors in place and return
            them; the caller must not use the inputs afterwards. If False (default),
            nothing given is changed.
          skip: ``None``, or a 0-d bool tensor decided without a host read (a compiled
            step's overflow verdict): where it is true the returned params and state hold
            the values given. Adam and AdamW whose every group is ``fused=True`` pass it
            to torch's kernel as its ``found_inf`` (nothing is written); the others
            update copies (not donated), then select the given values back
            (:func:`select_unless`: ``torch.where`` over every tensor).

        Returns:
          ``(new_params, new_state)``: ``new_params`` is a dict over all names of
          ``params``; unchanged entries are the same tensor objects.
        """
        if skip is None:
            return self._update(self, grads, state, params, donate)
        if self._skips is not None and self._skips(self):
            return self._update(self, grads, state, params, donate, skip)
        # The select reads the given values after the update: they must survive it.
        new_params, new_state = self._update(self, grads, state, params, False)
        return select_unless(skip, self.name, params, state, new_params, new_state)

    def __post_init__(self) -> None:
        # Every group's hyperparameters merged once (the defaults last): the step asks per
        # name, and a merge per name per step is a cost that grows with the tensor count.
        merged = (*(FrozenDict({**self.defaults, **g.hyperparams}) for g in self.groups), FrozenDict(self.defaults))
        object.__setattr__(self, "_merged", merged)
        # Names -> their groups, for the few name tuples a training run steps (``_by_group``).
        object.__setattr__(self, "_grouped", {})
        # A compiled step reads each 0-d CPU tensor hyperparameter (a float64 lr a schedule
        # updates in place) through a (1,)-view of it, made here: dynamo gives a 0-d float64
        # CPU input a Python-float symbol that its graph never uses, and then restarts the
        # whole trace to specialize it (the first compile of a step paid twice its tracing).
        views = tuple(FrozenDict({k: v.view(1) for k, v in hp.items() if _symbolic_scalar(v)}) for hp in merged)
        object.__setattr__(self, "_scalar_views", views)

    def hyperparams(self, name: str) -> Mapping[str, Any]:
        """The hyperparameters in force for parameter ``name`` (a read-only mapping).

        Under ``torch.compile`` a 0-d CPU tensor among them is a 0-d view of the same
        storage (it reads the values the tensor holds when the graph runs), not the object.
        """
        i = self.group_index(name)
        views = self._scalar_views[i]
        if views and torch.compiler.is_compiling():
            hp = self._merged[i]
            return FrozenDict({k: views[k].view(()) if k in views else hp[k] for k in hp.keys()})
        return self._merged[i]

    def group_index(self, name: str) -> int:
        """Index of the group that selects ``name``; ``len(groups)`` for the defaults."""
        for i, group in enumerate(self.groups):
            if group.matches(name):
                return i
        return len(self.groups)

    def with_hyperparams(self, group: int | None = None, **changes: Any) -> Optimizer:
        """A copy with ``changes`` applied to group ``group`` (``None``: the defaults)."""
        if self.parts:
            raise TypeError(
                "with_hyperparams on a zerofn.optim.partition: change one part instead, "
                "opt.with_part(i, opt.parts[i][1].with_hyperparams(...))"
            )
        _check_hyperparams(self.name, changes)
        if group is None:
            return dataclasses.replace(self, defaults=FrozenDict({**self.defaults, **changes}))
        groups = list(self.groups)
        g = groups[group]
        groups[group] = ParamGroup(g.select, FrozenDict({**g.hyperparams, **changes}))
        return dataclasses.replace(self, groups=tuple(groups))

    def with_part(self, index: int, optimizer: Optimizer) -> Optimizer:
        """A :func:`partition` with part ``index``'s optimizer replaced (e.g. new hyperparameters).

        The state continues: each part's state holds no hyperparameters.
        """
        if not self.parts:
            raise TypeError(f"with_part: zerofn.optim.{self.name} is not a partition")
        parts = list(self.parts)
        parts[index] = (parts[index][0], optimizer)
        return dataclasses.replace(self, parts=tuple(parts))

    def part_index(self, name: str) -> int:
        """Which part of a :func:`partition` updates ``name`` (the first that selects it)."""
        for i, (select, _) in enumerate(self.parts):
            if select(name) if callable(select) else name in select:
                return i
        raise KeyError(
            f"zerofn.optim.partition: no part selects param {name!r}; every param needs an optimizer "
            "(add a last part with a predicate such as lambda name: True)"
        )


# --------------------------------------------------------------------------- helpers


def _check_hyperparams(name: str, hp: Mapping[str, Any]) -> None:
    """Reject values torch.optim would reject, with the name of the optimizer and field."""
    for key in ("lr", "weight_decay", "momentum", "dampening", "eps"):
        if key in hp:
            value = hp[key]
            # Adafactor's eps is a pair (eps1 or None, eps2): each part obeys the same rule.
            parts = value if key == "eps" and isinstance(value, (tuple, list)) else (value,)
            if key == "lr" and isinstance(value, torch.Tensor):
                # A schedule for a compiled step: a 0-d tensor the caller updates in place.
                if value.dim() != 0 or not value.is_floating_point():
                    raise ValueError(f"zerofn.optim.{name}: a tensor lr must be 0-d floating, got {value!r}")
                parts = (float(value),)
            if not all(
                (p is None and len(parts) > 1) or (isinstance(p, (int, float)) and math.isfinite(p) and p >= 0)
                for p in parts
            ):
                raise ValueError(f"zerofn.optim.{name}: {key} must be a finite number >= 0, got {value!r}")
    if "betas" in hp:
        betas = hp["betas"]
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"zerofn.optim.{name}: betas must be two numbers in [0, 1), got {betas!r}")


def _make_groups(name: str, param_groups: Sequence[Mapping[str, Any]] | None) -> tuple[ParamGroup, ...]:
    groups = []
    for i, g in enumerate(param_groups or ()):
        if "params" not in g:
            raise ValueError(f"zerofn.optim.{name}: param_groups[{i}] needs a 'params' entry (names or a predicate)")
        hp = {k: v for k, v in g.items() if k != "params"}
        _check_hyperparams(name, hp)
        select = g["params"]
        if isinstance(select, str):
            raise TypeError(
                f"zerofn.optim.{name}: param_groups[{i}]['params'] must be a collection of names, not a str"
            )
        groups.append(ParamGroup(select if callable(select) else frozenset(select), FrozenDict(hp)))
    return tuple(groups)


def _symbolic_scalar(value: Any) -> bool:
    """A tensor dynamo would give a Python-number symbol as a graph input: 0-d, on the CPU,
    float64 or a signed integer dtype."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.device.type == "cpu"
        and value.dtype in (torch.float64, torch.int64, torch.int32, torch.int16, torch.int8)
    )


def _by_group(opt: Optimizer, names: Sequence[str]) -> dict[int, list[str]]:
    """Names bucketed by group index, order kept, so each group is one kernel call.

    Eagerly remembered per names tuple (each step asks for the same names; the selectors
    are fixed): a new dict of the same lists each call, which callers must not change.
    """
    if not opt.groups:  # every name in the defaults' group
        return {0: list(names)} if names else {}
    key = tuple(names)
    cache: dict[tuple[str, ...], dict[int, list[str]]] = opt._grouped  # type: ignore[attr-defined]
    eager = not torch.compiler.is_compiling()  # a graph plans with constants: no cache to guard on
    hit = cache.get(key) if eager else None
    if hit is not None:
        return dict(hit)
    out: dict[int, list[str]] = {}
    for n in key:
        out.setdefault(opt.group_index(n), []).append(n)
    if eager and len(cache) < _GROUPINGS_KEPT:
        cache[key] = out
    return dict(out)


def _own(t: torch.Tensor, donate: bool) -> torch.Tensor:
    """A tensor the update may write into: ``t`` itself if donated, else a fresh copy."""
    return t if donate else t.clone()


def _grads_in_order(opt: Optimizer, grads: Params, params: Params) -> list[str]:
    if flat.same_flat_layout(grads, params):  # its names are the params' by construction
        return flat.names_with_values(grads, params)
    unknown = [n for n in grads if n not in params]
    if unknown:
        raise KeyError(f"zerofn.optim.{opt.name}.update: gradients for unknown params {unknown}")
    return flat.names_with_values(grads, params)


# --------------------------------------------------------------------------- partition


class PartitionState(NamedTuple):
    """State of :func:`partition`.

    Attributes:
      states: one state per part, in part order, each over the names that part updates.
    """

    states: tuple[Any, ...]


def _split_names(opt: Optimizer, tree: Params) -> list[Mapping[str, Any]]:
    """``tree`` cut by part (:func:`zerofn.flat.split`: a FlatDict into FlatDicts over its buffers)."""
    names: list[list[str]] = [[] for _ in opt.parts]
    for name in tree:
        names[opt.part_index(name)].append(name)
    return flat.split(tree, names)


def _partition_init(opt: Optimizer, params: Params, layout: Any = None) -> PartitionState:
    return PartitionState(
        tuple(
            part.init(sub, layout=layout) for (_, part), sub in zip(opt.parts, _split_names(opt, params), strict=True)
        )
    )


def _partition_update(
    opt: Optimizer, grads: Params, state: PartitionState, params: Params, donate: bool, skip: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], PartitionState]:
    new_params = dict(params)
    new_states = []
    sub_grads = _split_names(opt, grads)
    for (_, part), g, p, s in zip(opt.parts, sub_grads, _split_names(opt, params), state.states, strict=True):
        if g:
            p_new, s = part.update(g, s, p, donate=donate, skip=skip)
            new_params.update(p_new)
        new_states.append(s)
    return new_params, PartitionState(tuple(new_states))


def partition(parts: Sequence[tuple[NameSelector, Optimizer]]) -> Optimizer:
    """Several optimizers over one set of params, each updating the names it selects.

    The usual Muon recipe, Muon for the hidden weight matrices and AdamW for embeddings,
    head and 1-D params, is ``partition([(is_hidden_matrix, muon), (lambda n: True, adamw)])``.
    Each param belongs to the first part whose selector (a collection of names or a
    predicate ``name -> bool``) picks it; a param no part picks is an error. Each part's
    placement applies to its params (Muon's whole, AdamW's split), so one layout, one
    gradient reduction and one global norm serve all parts.

    Args:
      parts: ``(selector, optimizer)`` pairs, first match wins.

    Returns:
      An :class:`Optimizer` with state :class:`PartitionState`; ``opt.parts`` lists the
      pairs and :meth:`Optimizer.with_part` replaces one (an LR schedule per part).

    Examples:
      >>> import torch, zerofn as zf
      >>> opt = zf.optim.partition([(["w"], zf.optim.sgd(lr=0.5)), (lambda n: True, zf.optim.adamw())])
      >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
      >>> new, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> new["w"]
      tensor([0.5000, 0.5000])
    """
    checked = []
    for i, pair in enumerate(parts):
        select, part = pair
        if isinstance(select, str):
            raise TypeError(f"zerofn.optim.partition: parts[{i}]'s selector must be names or a predicate, not a str")
        if not isinstance(part, Optimizer):
            raise TypeError(f"zerofn.optim.partition: parts[{i}] needs a zerofn optimizer, got {type(part).__name__}")
        checked.append((select if callable(select) else frozenset(select), part))
    if not checked:
        raise ValueError("zerofn.optim.partition: give at least one (selector, optimizer) pair")
    return Optimizer(
        "partition",
        FrozenDict(),
        (),
        _partition_init,
        _partition_update,
        torch.optim.Optimizer,
        None,
        tuple(checked),
        _skips=lambda opt: True,  # each part's update honours the skip its own way
    )


# --------------------------------------------------------------------------- skip


def select_unless(
    skip: torch.Tensor, name: str, params: Params, state: Any, new_params: Params, new_state: Any
) -> tuple[Any, Any]:
    """The updated params and state where ``skip`` is false, the given ones where it is true.

    A 0-d tensor that several names share (a flat state's step count) stays shared: found
    with ``is`` (``id()`` would guard on the object under tracing).
    """
    chosen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def select(old: Any, new: Any) -> Any:
        if not (isinstance(new, torch.Tensor) and old is not None):
            return new
        if new.dim() != 0:
            return torch.where(skip, old, new)
        for o, n, picked in chosen:
            if o is old and n is new:
                return picked
        picked = torch.where(skip, old, new)
        chosen.append((old, new, picked))
        return picked

    old_leaves, spec = pytree.tree_flatten(state)
    new_leaves, new_spec = pytree.tree_flatten(new_state)
    if spec != new_spec or any(o is None and n is not None for o, n in zip(old_leaves, new_leaves, strict=True)):
        _traced.refuse(
            f"step_shards under torch.compile: zerofn.optim.{name}'s state changes its structure "
            "in a step (a buffer created on the first step); run one step eagerly before compiling"
        )
    new_state = pytree.tree_unflatten([select(o, n) for o, n in zip(old_leaves, new_leaves, strict=True)], spec)
    held = flat.hold_like(params, new_params)  # the given form: buffer by buffer where it is flat
    old_leaves, spec = pytree.tree_flatten(params)
    new_leaves, new_spec = pytree.tree_flatten(held)
    if spec == new_spec:
        selected = [select(o, n) for o, n in zip(old_leaves, new_leaves, strict=True)]
        return pytree.tree_unflatten(selected, spec), new_state
    return FrozenDict({n: select(params.get(n), t) for n, t in held.items()}), new_state
