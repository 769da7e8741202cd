"""Params are the user's: what the facade last wrote into the model's params, and what changed since.

The facade holds every param twice: the model's (working) tensor and, sharded, the master
copy the optimizer updates; ``step`` writes the masters back into the model. A write the
user makes to a param between steps (``model.load_state_dict(pretrained)``, ``p.copy_(x)``
or any in-place op under ``no_grad``, loading a checkpoint into the model) would be
silently reverted by that write-back. :class:`ParamGuard` notices such writes first, and
the masters follow them (:func:`adopt_params`), on every rank alike.

How a write is seen: every tensor has a version counter that autograd bumps on each
in-place write (``copy_``, ``mul_``, ``load_state_dict``'s copies). The guard records each
param's version and storage pointer after every write the facade makes itself
(construction, the gather at the end of ``step``, each bucket ``overlap_allgather``'s
forward pre-hooks write, ``load_checkpoint``) and compares them at the start of ``step``:
two list comprehensions over the params (``benchmarks/guard_cost.py`` times them). A new storage with the
same shape, dtype and device (``p.data = tensor``) counts as a write too.

The gap: writes *through* ``p.data`` (``p.data.copy_(x)``, ``p.data.clamp_(...)``) go to
a tensor with its own version counter and are invisible here. Code that writes that way
calls :meth:`ZeroOptimizer.check_params` (compares bytes) or
:meth:`ZeroOptimizer.update_master_params` (takes every param as it is) afterwards.

What is refused: a param whose shape, dtype or device changed (``model.to(torch.float64)``,
``model.half()``, ``model.cuda()`` after building the optimizer), a param of ``module=``
replaced by another tensor (a new ``nn.Parameter`` or submodule assigned), a write made
while ``overlap_allgather``'s gather of that param was still pending through a view made
before the last step (the write saw the values from before that step; writes to the param
itself wait for the gather, :mod:`~._prefetch`), and ranks that changed different params or the same
params differently. Each raises :class:`ParamsChangedError` on every rank, saying what to
do, with the state unchanged.

Every rank decides alike: ``step`` passes this rank's report as the ``veto`` of
:func:`~zerofn.step_shards`, whose one scalar all-reduce carries the flag; only when some
rank saw a change does one object all-gather bring every report to every rank. In a
hybrid layout (``sub_dp_size`` / ``replicate_group``) that verdict is taken within each
shard group: a change made on the ranks of some shard groups only is not compared
across the replicas.

Precision: with float32 masters of float32 params the masters take the written values
exactly. With bfloat16/float16 params and float32 masters, a master element keeps its
value when the param's element is still that value rounded to the working dtype (nothing
was written there, or the same value was written back, e.g. a checkpoint of this run),
and otherwise takes the written working-dtype value: the extra precision the master held
for those elements is dropped, as it is not in the params the user wrote.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from zerofn._tree import FrozenDict
from zerofn.buckets import cut_shard
from zerofn.state import ZeroState

__all__ = [
    "ParamGuard",
    "ParamsChangedError",
    "adopt_params",
    "byte_report",
    "byte_verdict",
    "check_module",
    "params_verdict",
]


class ParamsChangedError(RuntimeError):
    """The model's params changed in a way the optimizer cannot follow; raised on every rank alike."""


_WRAPPED = (
    "ZeroOptimizer: module= is a {kind}; its gradients would be reduced twice (by {kind}'s hooks and by the "
    "optimizer's). Pass the inner model instead (module=model.module) and drop the {kind} wrapper: the optimizer "
    "does the data-parallel reduction itself."
)


def check_module(module: torch.nn.Module | None) -> None:
    """Refuse a model still wrapped for data parallelism (gradients would be reduced twice)."""
    if module is None:
        return
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    for sub in module.modules():
        if isinstance(sub, DistributedDataParallel):
            raise ValueError(_WRAPPED.format(kind="DistributedDataParallel"))
        if isinstance(sub, DataParallel):
            raise ValueError(_WRAPPED.format(kind="DataParallel"))


def _digest(t: torch.Tensor) -> str:
    """A digest of ``t``'s bytes (to compare params across ranks, only when something changed)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(raw.tobytes(), digest_size=16).hexdigest()


def _bindings(module: torch.nn.Module | None, params: Mapping[str, torch.Tensor]) -> list[tuple[dict, str, Any, str]]:
    """(container, key, expected object, path) for every edge from ``module`` down to the optimizer's params.

    The containers are the modules' ``_modules`` and ``_parameters`` dicts: a new submodule
    or parameter assigned anywhere on a param's path replaces an entry in one of them.
    """
    if module is None:
        return []
    ours = {id(p) for p in params.values()}
    edges: dict[tuple[int, str], tuple[dict, str, Any, str]] = {}
    for path, p in module.named_parameters():
        if id(p) not in ours:
            continue
        *mods, leaf = path.split(".")
        owner, prefix = module, ""
        for key in mods:
            child = owner._modules[key]
            edges.setdefault((id(owner), key), (owner._modules, key, child, prefix + key))
            owner, prefix = child, prefix + key + "."
        edges.setdefault((id(owner), leaf), (owner._parameters, leaf, p, path))
    return list(edges.values())


class ParamGuard:
    """Each param's version counter and storage as the facade last wrote them, and the checks against them.

    Args:
      params: name -> the model's param (layout order), as the optimizer was built.
      module: the model (``module=``), to notice params replaced by new tensors; optional.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], module: torch.nn.Module | None) -> None:
        self._names = tuple(params)
        self._tensors = tuple(params.values())
        self._index = {n: i for i, n in enumerate(self._names)}
        self._meta = [(tuple(p.shape), p.dtype, p.device) for p in self._tensors]
        self._bindings = _bindings(module, params)
        # What each binding holds, by identity (the objects are kept alive by the bindings).
        self._bound_ids = [id(obj) for _, _, obj, _ in self._bindings]
        self._stale: set[str] = set()  # written while overlap_allgather's gather was pending
        self._versions: list[int] = []
        self._ptrs: list[int] = []
        self.record()

    def _span(self, names: tuple[str, ...]) -> tuple[int, int] | None:
        """``(start, stop)`` when ``names`` are the params ``start:stop`` in order (a bucket's), else ``None``."""
        start = self._index[names[0]] if names else 0
        stop = start + len(names)
        return (start, stop) if self._names[start:stop] == names else None

    def record(self, names: Iterable[str] | None = None) -> None:
        """The facade has just written these params (default: all): their current state is its own."""
        if names is None:
            self._versions = [p._version for p in self._tensors]
            self._ptrs = [p.data_ptr() for p in self._tensors]
            self._stale.clear()
            return
        names = tuple(names)
        if self._stale:
            self._stale.difference_update(names)
        span = self._span(names)
        if span is not None:  # a bucket: two list reads of its params, written over the range
            start, stop = span
            tensors = self._tensors[start:stop]
            self._versions[start:stop] = [p._version for p in tensors]
            self._ptrs[start:stop] = [p.data_ptr() for p in tensors]
            return
        for n in names:
            i = self._index[n]
            self._versions[i] = self._tensors[i]._version
            self._ptrs[i] = self._tensors[i].data_ptr()

    def written_since(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, those written by someone else since the facade's last write."""
        names = tuple(names)
        span = self._span(names)
        if span is not None:  # a bucket: compared as two lists first, the common case being no change
            start, stop = span
            tensors = self._tensors[start:stop]
            versions = [p._version for p in tensors]
            ptrs = [p.data_ptr() for p in tensors]
            if versions == self._versions[start:stop] and ptrs == self._ptrs[start:stop]:
                return []
        out = []
        for n in names:
            i = self._index[n]
            p = self._tensors[i]
            if p._version != self._versions[i] or p.data_ptr() != self._ptrs[i]:
                out.append(n)
        return out

    def mark_stale(self, names: Iterable[str]) -> None:
        """These params were written while their gathered values were pending (``overlap_allgather``)."""
        self._stale.update(names)

    def check_structure(self, where: str) -> None:
        """Raise :class:`ParamsChangedError` if a param was moved, cast or replaced (not for value writes).

        Local, before any collective of ``backward``: such a model would otherwise fail in
        the reduction with a message about gradient dtypes. Every rank running the same
        script finds the same. Cost when nothing moved: one pointer read per param and one
        dict lookup per module/param edge (a cast or move always makes new storage).
        """
        ptrs = [p.data_ptr() for p in self._tensors]
        if ptrs == self._ptrs and self._bound():
            return
        problems = self._structure_problems()
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ParamsChangedError(f"{where}: {problems[0]}{more}.")

    def _bound(self) -> bool:
        """Every module/param edge of ``module=`` still holds the object it held at construction."""
        return [id(c.get(k)) for c, k, _, _ in self._bindings] == self._bound_ids

    def _structure_problems(self) -> list[str]:
        problems = [
            f"{path!r} of module= is no longer the {'parameter' if isinstance(obj, torch.Tensor) else 'submodule'} "
            "the optimizer was built with (a new nn.Parameter or module was assigned to the model after building "
            "the optimizer), so the optimizer would go on training the old tensor. Build the ZeroOptimizer after "
            "changing the model (a new one, if the model changes during training)"
            for container, key, obj, path in self._bindings
            if container.get(key) is not obj
        ]
        for i, p in enumerate(self._tensors):
            shape, dtype, device = self._meta[i]
            if (tuple(p.shape), p.dtype, p.device) != (shape, dtype, device):
                problems.append(
                    f"param {self._names[i]!r} is now {tuple(p.shape)} {p.dtype} on {p.device}; the optimizer was "
                    f"built for {shape} {dtype} on {device} (model.to(...), .half(), .cuda() or a p.data of another "
                    "shape after building the optimizer). Move or cast the model first, then build the ZeroOptimizer"
                )
        return problems

    def inspect(self) -> dict[str, Any] | None:
        """This rank's report of what changed since the facade's last write, or ``None`` (the common case).

        The report (picklable, to travel to every rank): ``problems`` (changes the optimizer
        cannot follow, as messages), ``stale`` (names written while a gather was pending) and
        ``changed`` (name -> digest of the param's bytes, for names written by the user).
        Cost when nothing changed: one version and one pointer read per param, one dict
        lookup per module/param edge of ``module=``. When something changed: a digest of
        each changed param's bytes (copied to the CPU first for device params), about a
        second per GB on the CPU, paid once, on the step after e.g. a checkpoint load.
        No collectives.
        """
        versions = [p._version for p in self._tensors]
        ptrs = [p.data_ptr() for p in self._tensors]
        bound = self._bound()
        if versions == self._versions and ptrs == self._ptrs and bound and not self._stale:
            return None
        problems = self._structure_problems()
        changed = [n for i, n in enumerate(self._names) if versions[i] != self._versions[i] or ptrs[i] != self._ptrs[i]]
        return {
            "problems": problems,
            "stale": sorted(self._stale, key=self._index.__getitem__),
            "changed": {} if problems else {n: _digest(self._tensors[self._index[n]]) for n in changed},
        }


def _listing(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(repr(n) for n in names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def params_verdict(
    reports: Sequence[dict[str, Any] | None], order: Sequence[str], where: str = "ZeroOptimizer.step"
) -> list[str]:
    """Every rank's :meth:`ParamGuard.inspect` report -> the params whose masters follow, or raise.

    A pure function of the list, which every rank holds alike (it travelled in one
    all-gather), so every rank returns the same names or raises the same
    :class:`ParamsChangedError`.
    """
    empty: dict[str, Any] = {"problems": [], "stale": [], "changed": {}}
    full = [r if r is not None else empty for r in reports]
    for rank, rep in enumerate(full):
        if rep["problems"]:
            more = f" (and {len(rep['problems']) - 1} more)" if len(rep["problems"]) > 1 else ""
            raise ParamsChangedError(f"{where}: on rank {rank}, {rep['problems'][0]}{more}.")
    for rank, rep in enumerate(full):
        if rep["stale"]:
            raise ParamsChangedError(
                f"{where}: on rank {rank}, params {_listing(rep['stale'])} were written in place after "
                "the last step() and before their gathered values were written (overlap_allgather), through a "
                "tensor that shares their storage made before that step (a view or p.detach() kept from earlier), "
                "so the write was made to the values from before the step. Take such views again after step() (a "
                "write to the param itself waits for its gather), or call optimizer.wait_params() first; to keep "
                "the params as they are now, call optimizer.update_master_params() on every rank, then step() again"
            )
    first = full[0]["changed"]
    for rank, rep in enumerate(full[1:], start=1):
        if rep["changed"] == first:
            continue
        mine, theirs = sorted(first), sorted(rep["changed"])
        if mine != theirs:
            what = (
                f"rank 0 changed {_listing(mine) if mine else 'no param'} since the last step, rank {rank} "
                f"{_listing(theirs) if theirs else 'no param'}"
            )
        else:
            differ = [n for n in order if n in first and first[n] != rep["changed"][n]]
            what = f"ranks 0 and {rank} wrote different values into {_listing(differ)}"
        raise ParamsChangedError(
            f"{where}: {what}. The params are replicated: every rank must make the same change (load "
            "the same weights on every rank, not only on rank 0), or the masters would mix the ranks' values. "
            "Make the params equal on every rank, then call optimizer.update_master_params() on every rank and "
            "step() again"
        )
    return [n for n in order if n in first]


def adopt_params(state: ZeroState, params: Mapping[str, torch.Tensor], names: Iterable[str]) -> ZeroState:
    """``state`` with the master shards of ``names`` taken from the model's params (nothing else changes).

    Per element of this rank's shard: a master element whose value, rounded to the param's
    working dtype, is bitwise the param's element is kept (no loss of master precision
    where nothing changed); the others take the param's element (the working-dtype value,
    widened exactly). With float32 masters of float32 params that is the param exactly.
    The optimizer state, step count and loss scale are kept, as torch keeps them when the
    model's weights are loaded. Pure: new master tensors, ``state`` is not changed.

    Collectives: none (every rank cuts its own shards from its own copy of the params).
    """
    master = dict(state.master)
    layout = state.layout
    for name in names:
        spec = layout[name]
        if name not in master:  # a whole param another rank owns
            continue
        old = master[name]
        work = cut_shard(params[name], spec, state.rank, device=old.device)  # working dtype
        rounded = old.to(work.dtype)
        keep = _bits(rounded) == _bits(work)
        master[name] = torch.where(keep, old, work.to(old.dtype))
    return state.replace(master=FrozenDict(master))  # (ZeroState packs the shards flat again)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s elements (compares -0.0 and +0.0, and NaNs, by their bits)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints)


def byte_report(state: ZeroState, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """For the explicit check: the params whose bytes on this rank's shards differ from the masters', and digests.

    Compares each param's part on this rank with the master rounded to the working
    dtype (what the last write-back put there), bitwise. ``digests`` (name -> digest of the
    whole param) let every rank check that the params are equal everywhere. No collectives.
    """
    differ = []
    for name, old in state.master.items():
        work = cut_shard(params[name], state.layout[name], state.rank, device=old.device)
        if not torch.equal(_bits(old.to(work.dtype)), _bits(work)):
            differ.append(name)
    return {"differ": differ, "digests": {n: _digest(p) for n, p in params.items()}}


def byte_verdict(reports: Sequence[dict[str, Any]], order: Sequence[str]) -> list[str]:
    """Every rank's :func:`byte_report` -> names to adopt (union of the differing), or raise alike."""
    for rank, rep in enumerate(reports[1:], start=1):
        differ = [n for n in order if rep["digests"][n] != reports[0]["digests"][n]]
        if differ:
            raise ParamsChangedError(
                f"ZeroOptimizer: ranks 0 and {rank} hold different values in {_listing(differ)}. The params are "
                "replicated: make them equal on every rank (load the same weights everywhere), then check again"
            )
    union = {n for rep in reports for n in rep["differ"]}
    return [n for n in order if n in union]
