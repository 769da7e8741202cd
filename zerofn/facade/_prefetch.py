"""``overlap_allgather``: the param gathers launched by ``step``, written by the next forward or first use.

``step`` launches every bucket's gather asynchronously (:meth:`ParamPrefetcher.launch`:
``pack_shards`` and ``launch_gather`` into an ``(N, S)`` buffer borrowed from the gradient
reducer's staging pool, idle between ``step`` and the next ``backward``; with the
broadcast realisation this rank's row is sent from its range of the master shards, or
packed into its slot where a cast is needed) and returns. A forward
pre-hook on each module that owns params waits for exactly the buckets those params live
in and writes them into the params (``unpack_rows``: the same pieces, and so the same
bits, as :func:`~zerofn.gather_params`); the model's forward post-hook completes the rest.

Note (the guard): a param whose gather is in flight is never read or written stale. From
``launch`` until its bucket is written, each param of the bucket is of a *pending*
subclass of its own class (``p.__class__`` is swapped: the same tensor object, storage,
``.grad`` and hooks; ``isinstance(p, nn.Parameter)`` holds; ``type(p)`` is
``PendingParameter``). Its ``__torch_function__`` runs for every torch function, method
and attribute given such a param (``p.detach()``, ``p.data``, ``p.mul_(...)``,
``F.linear(x, p)``, ``torch._foreach_*``, ``p.norm()``, ``model.state_dict()``, a
validation forward through another path, ``torch.save``, ``copy.deepcopy``): it first
completes the gathers of the buckets of the params it was given, which makes them plain
params again, then calls the function as usual. So an EMA, logging, clamping, a state
dict, an evaluation or a checkpoint right after ``step`` sees the updated values, with
no ``wait_params()``. Writes are covered the same way (``p.mul_``, ``p.copy_``,
``p.data.copy_``: reaching ``p.data`` completes the bucket first, so the write lands on
the updated values, as with DDP). Reading only metadata (``.grad``, ``.shape``,
``.dtype``, ``.device``, ``.requires_grad``, ``size()``, ``numel()``, ``_version``,
``data_ptr()``, ``hash(p)``) does not wait, so ``zero_grad()`` and the facade's own
checks keep the overlap. The cost is a class swap per param at ``launch`` and at the
write (well under a microsecond each); torch functions on other tensors pay nothing.

What the guard cannot see: a write through an alias made *before* ``step`` (a view,
``p.detach()`` or ``p.data`` kept from earlier) while the gather is pending. Views and
detached aliases share the param's version counter, so the write is found when the
bucket is written: the hook keeps the user's values for those params, writes the
bucket's other members, and tells the :class:`~._guards.ParamGuard`, and the next
``step`` raises on every rank (the write was made to the values from before the step).
An old ``p.data`` alias has a version counter of its own: a write through it while the
gather is pending is overwritten by the gather (keep no ``p.data`` across ``step``).
A forward that reads such an alias is refused by the forward post-hook
(:meth:`ParamPrefetcher._finish_forward`).

Compiled models: the hooks and the guard run eagerly, outside any graph ``torch.compile``
makes of the model (``torch.compiler.disable``: a graph break). A graph traced before the
optimizer was built (the model ran compiled first) has none of its hooks, and dynamo does
not guard on hooks; but it guards on the type of each param it reads, so the pending
class makes it retrace on the next forward, which then sees the hooks. Without that, the
old graph read the stale params, saved them for backward, and the write that followed
(``backward`` waits) made autograd refuse them ("modified by an inplace operation").
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from zerofn import _comm as comm
from zerofn._comm import Group
from zerofn._offsets import Bucket
from zerofn.buckets import StagingPool, launch_gather, pack_shards, unpack_rows
from zerofn.facade._guards import ParamGuard
from zerofn.layout import ShardLayout
from zerofn.state import ZeroState

__all__ = ["PENDING_METADATA", "ParamPrefetcher"]


class ParamPrefetcher:
    """The gathers in flight between ``step`` and the next forward, and the hooks that write them.

    Args:
      params: name -> the model's param (layout order).
      layout: the state's layout; buckets: its bucket plan.
      group: the sharding group; how: the gather realisation.
      module: the model, which owns every param (checked by the options).
      guard: the facade's record of its own writes: each written bucket's params are
        recorded, and a param the user wrote while pending is left alone and reported.
      staging: the pool the receive buffers are borrowed from and given back to once
        written (the reducer's: a fresh multi-MB buffer per bucket and step would fault in
        new pages every step); ``None``: fresh ones.

    Memory: the gathered ``(N, S)`` buckets, Ψ·b bytes, from ``step`` until the forward
    writes them (the pool keeps a few of them idle afterwards, as it does after
    backward), plus per bucket of several params the ``(S,)`` row it sends when it cannot
    be packed in place (the all-gather realisation; reused). The hooks hold the
    prefetcher by weak reference.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        layout: ShardLayout,
        buckets: tuple[Bucket, ...],
        *,
        group: Group,
        how: str,
        module: torch.nn.Module,
        guard: ParamGuard | None = None,
        staging: StagingPool | None = None,
    ) -> None:
        self._params = params
        self._staging = staging
        self._guard = guard
        self._layout = layout
        self._buckets = buckets
        self._group, self._how = group, how
        self._name_of = {id(p): n for n, p in params.items()}
        self._members = [tuple(params[n] for n in b.names) for b in buckets]  # each bucket's params
        self._position = {name: i for i, name in enumerate(layout.names)}
        # Per bucket: the gather launched by the last step and not yet written (its Pending,
        # the row it sends, kept alive until then, and the borrowed receive buffer), or None.
        self._gathers: list[tuple[comm.Pending, torch.Tensor, torch.Tensor | None] | None] = [None] * len(buckets)
        self.pending = 0  # gathers not yet written
        # Per bucket of several params: the row it sends, reused every step.
        self._rows: list[torch.Tensor | None] = [None] * len(buckets)
        self._hooks: list[Any] = []
        self._me = weakref.ref(self)
        _check_guardable(params)
        self._attach(module)

    def launch(self, state: ZeroState) -> None:
        """Launch every bucket's gather of ``state``'s master shards, without waiting; guard its params.

        Each bucket's params become ``Pending*`` until the bucket is written (the guard,
        in the module docstring). Collectives: per bucket one all-gather (or one broadcast
        per rank), asynchronous.
        """
        device = state.work_device
        n = self._layout.world_size
        for b, bucket in enumerate(self._buckets):
            dtype = self._layout[bucket.names[0]].dtype
            s = bucket.shard_numel
            borrowed = self._staging.take(n * s, dtype, device) if self._staging is not None else None
            recv = borrowed[: n * s].view(n, s) if borrowed is not None else None
            if recv is not None and self._how == "broadcast":
                out = recv[state.rank]  # where a cast is needed: no separate row (else the master is sent)
            else:
                out = self._send_row(b, bucket, dtype, state)
            row = pack_shards(state.master, self._layout, bucket, dtype=dtype, device=device, out=out, rank=state.rank)
            pending = launch_gather(row, self._group, self._how, async_op=True, out=recv)
            self._gathers[b] = (pending, row, borrowed)
            self.pending += 1
            members = self._members[b]
            for p in members:  # the guard: a read or write of these waits for this gather
                p.__class__ = _pending_class(type(p))
            _IN_FLIGHT.update(dict.fromkeys(map(id, members), (self._me, b)))

    def _send_row(self, b: int, bucket: Bucket, dtype: torch.dtype, state: ZeroState) -> torch.Tensor | None:
        """Bucket ``b``'s ``(S,)`` send row, reused every step; ``None`` where ``pack_shards`` needs none.

        A fresh row would fault in new pages each time; the previous step's gather from it
        has completed (``step`` waits first). A lone param's shard is its own row (no copy:
        nothing writes the master shards before this gather completes), and under CPU
        offload ``pack_shards`` stages the row itself.
        """
        device = state.work_device
        if len(bucket.names) == 1 or state.state_device != device:
            return None
        row = self._rows[b]
        if row is None or row.dtype != dtype or row.device != device:
            row = self._rows[b] = torch.empty(bucket.shard_numel, dtype=dtype, device=device)
        return row

    def complete(self, buckets: Iterable[int]) -> None:
        """Wait for these buckets' gathers (those still pending) and write them into the params."""
        apart = self._how == "broadcast"  # broadcasts give the rows apart (gather_rows)
        with torch.no_grad():  # the params are leaves that require grad
            for b in buckets:
                entry = self._gathers[b]
                if entry is None:
                    continue
                self._gathers[b] = None
                self.pending -= 1
                names = self._buckets[b].names
                for p in self._members[b]:  # plain params again, before anything here reads or writes them
                    _unguard(p)
                rows = entry[0].wait()
                if self._guard is not None:
                    written = self._guard.written_since(names)  # by the user, after the step: keep theirs
                    if written:
                        self._guard.mark_stale(written)
                        names = tuple(n for n in names if n not in written)
                bucket = self._buckets[b]
                # The views the bucket's params are written through, made once (every member written).
                targets = None
                if self._staging is not None and len(names) == len(bucket.names):
                    targets = self._staging.unpack_targets(self._layout, bucket, self._params, separate=apart)
                unpack_rows(rows, self._layout, bucket, self._params, names=names, targets=targets)
                if self._guard is not None:
                    self._guard.record(names)
                if entry[2] is not None and self._staging is not None:
                    self._staging.give(entry[2])  # written into the params: free for the next bucket

    def wait(self) -> None:
        """Complete every pending gather (``wait_params``). Not a collective."""
        if self.pending:
            self.complete(range(len(self._buckets)))

    def row_bytes(self) -> int:
        """Bytes of the reused send rows."""
        return sum(r.numel() * r.element_size() for r in self._rows if r is not None)

    def close(self) -> None:
        """Remove the hooks and drop the reused rows (after :meth:`wait`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._rows = [None] * len(self._buckets)

    def _attach(self, module: torch.nn.Module) -> None:
        """Forward pre-hooks that write the buckets of each module's own params before it runs.

        A param's hook sits on the module that owns it, or, when that module has no
        ``forward`` of its own (``nn.ParameterList``, ``nn.ParameterDict``, ``nn.ModuleList``,
        ...: its params are read by the parent's ``forward``), on the nearest ancestor that
        has one. The hook waits for exactly the buckets those params live in (writing every
        member of those buckets). The root's forward post-hook completes whatever is left
        (:meth:`_finish_forward`); ``state_dict`` / ``load_state_dict`` pre-hooks wait too.
        """
        me = weakref.ref(self)
        bucket_of = {name: i for i, b in enumerate(self._buckets) for name in b.names}
        parent: dict[int, torch.nn.Module] = {}
        for mod in module.modules():
            for child in mod.children():
                parent.setdefault(id(child), mod)
        buckets_of: dict[int, set[int]] = {}
        owner_of: dict[int, torch.nn.Module] = {}
        finish = _finish_hook(me)
        for mod in module.modules():
            owned = {self._name_of.get(id(p)) for p in mod.parameters(recurse=False)}
            mine = {bucket_of[n] for n in owned if n in bucket_of}
            if not mine:
                continue
            owner = mod
            while type(owner).forward is torch.nn.Module.forward and id(owner) in parent:
                owner = parent[id(owner)]  # a container: its params are read by its parent's forward
            buckets_of.setdefault(id(owner), set()).update(mine)
            owner_of[id(owner)] = owner
            self._hooks.append(mod.register_state_dict_pre_hook(finish))
            self._hooks.append(mod.register_load_state_dict_pre_hook(finish))
        for key, owner in owner_of.items():
            self._hooks.append(owner.register_forward_pre_hook(_pre_hook(me, tuple(sorted(buckets_of[key])))))
        self._hooks.append(module.register_state_dict_pre_hook(finish))
        self._hooks.append(module.register_load_state_dict_pre_hook(finish))
        self._hooks.append(module.register_forward_hook(_after_forward_hook(me)))

    def _finish_forward(self, output: Any) -> None:
        """End of the model's forward with gathers still pending: write them, and check none was read.

        Buckets still pending here were never touched in this forward: no pre-hook waited
        for them, and no torch function was given one of their params (the guard would
        have). Params that took no part (layer drop, unused layers) are fine; a param that
        reached the autograd graph of ``output`` all the same was read through an alias made
        before the last step (a view or ``p.detach()`` kept from earlier): that is an error
        (raised after the params are written), as it would otherwise train on stale weights
        silently. Forwards without autograd (``no_grad``) cannot be checked this way.
        """
        pending = {
            id(self._params[name]): name
            for b, entry in enumerate(self._gathers)
            if entry is not None
            for name in self._buckets[b].names
        }
        self.wait()
        stack = [t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        seen: set[Any] = set()
        stale: list[str] = []
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf tensor
            if var is not None and id(var) in pending:
                stale.append(pending[id(var)])
            stack.extend(f for f, _ in fn.next_functions)
        if stale:
            stale.sort(key=self._position.__getitem__)
            listing = ", ".join(repr(n) for n in stale[:5]) + (", ..." if len(stale) > 5 else "")
            raise RuntimeError(
                f"ZeroOptimizer(overlap_allgather=True): this forward read {len(stale)} param(s) ({listing}) before "
                "their gathered values were written, through a tensor that shares their storage made before the last "
                "step (a view, p.detach() or p.data kept from earlier): such an alias is not the param, so reading it "
                "cannot wait for the param's gather. The forward's result used the weights from before the last step; "
                "they are current now. Take the view again after step() (or call optimizer.wait_params() before such "
                "a forward), or leave overlap_allgather off for this model."
            )


# The hooks wait for collectives and write params in place: under torch.compile they run
# eagerly (a graph break), never traced into a graph. Traced, their writes would become
# in-graph mutations of params the graph also saves for backward ("modified by an inplace
# operation"), and a graph traced with nothing pending would skip them on later calls. A
# graph traced before the hooks existed is retraced (the guard's class swap fails dynamo's
# type guards on the params), and then sees them.


def _pre_hook(me: weakref.ref[ParamPrefetcher], buckets: tuple[int, ...]) -> Any:
    @torch.compiler.disable
    def pre(mod: torch.nn.Module, args: Any) -> None:
        prefetch = me()
        if prefetch is not None and prefetch.pending:
            prefetch.complete(buckets)

    return pre


def _finish_hook(me: weakref.ref[ParamPrefetcher]) -> Any:
    @torch.compiler.disable
    def finish(*args: Any) -> None:
        prefetch = me()
        if prefetch is not None:
            prefetch.wait()

    return finish


def _after_forward_hook(me: weakref.ref[ParamPrefetcher]) -> Any:
    @torch.compiler.disable
    def after_forward(mod: torch.nn.Module, args: Any, output: Any) -> None:
        prefetch = me()
        if prefetch is not None and prefetch.pending:
            prefetch._finish_forward(output)

    return after_forward


# ------------------------------------------------------------------------------ the guard
# (the module docstring's note says what it does and why)

# Torch functions and attributes that read no values of a param: they pass a pending param
# without waiting for its gather (zero_grad, the facade's checks, hashing it as a dict key).
PENDING_METADATA: frozenset[Any] = frozenset(
    [
        *(
            getattr(torch.Tensor, attr).__get__
            for attr in (
                "grad",
                "_version",
                "shape",
                "dtype",
                "device",
                "layout",
                "requires_grad",
                "is_leaf",
                "grad_fn",
                "ndim",
                "is_cuda",
                "itemsize",
                "nbytes",
            )
        ),
        torch.Tensor.grad.__set__,
        torch.Tensor.grad.__delete__,
        torch.Tensor.__hash__,
        torch.Tensor.data_ptr,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.element_size,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.get_device,
    ]
)

# id(param) -> (its prefetcher, its bucket) while the bucket's gather is in flight.
_IN_FLIGHT: dict[int, tuple[weakref.ref[ParamPrefetcher], int]] = {}
_PENDING_OF: dict[type, type] = {}  # a param class -> its pending subclass
_BASE_OF: dict[type, type] = {}  # a pending subclass -> the param class it stands in for


def _land(objs: Iterable[Any]) -> None:
    """Complete the gathers of the pending params among ``objs`` (their whole buckets); they are plain after."""
    for t in objs:
        base = _BASE_OF.get(type(t))
        if base is None:
            continue
        entry = _IN_FLIGHT.get(id(t))
        prefetch = entry[0]() if entry is not None else None
        if prefetch is not None and entry is not None:
            prefetch.complete((entry[1],))
        _unguard(t)  # e.g. a copy made of a pending param, or one whose optimizer is gone


def _unguard(p: torch.Tensor) -> None:
    """``p`` back to its own class, out of the in-flight registry."""
    base = _BASE_OF.get(type(p))
    if base is not None:
        p.__class__ = base
    _IN_FLIGHT.pop(id(p), None)


def _pending_torch_function(
    cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> Any:
    """A pending param's ``__torch_function__``: land the gathers of the params given, then call ``func``."""
    kwargs = {} if kwargs is None else kwargs
    if func in PENDING_METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    _land(pytree.tree_leaves((args, kwargs)))
    return func(*args, **kwargs)  # every param given is plain now: torch dispatches as usual


def _pending_deepcopy(self: torch.Tensor, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy`` of a pending param: land it first, so the copy is of the updated, plain param."""
    _land((self,))
    return self.__deepcopy__(memo)  # its own class's now


def _pending_class(cls: type) -> type:
    """The pending subclass of the param class ``cls`` (made once per class)."""
    cls = _BASE_OF.get(cls, cls)
    sub = _PENDING_OF.get(cls)
    if sub is None:
        namespace = {
            "__module__": __name__,
            "__doc__": f"A {cls.__name__} whose gathered value is in flight (overlap_allgather): first use waits.",
            # A graph break under torch.compile: it waits and writes params, eagerly. Made
            # here, at the first overlap_allgather step, not at import: torch.compiler.disable
            # imports dynamo, half of zerofn's import time in every process.
            "__torch_function__": classmethod(torch.compiler.disable(_pending_torch_function)),
            "__deepcopy__": _pending_deepcopy,
        }
        sub = type(cls)(f"Pending{cls.__name__}", (cls,), namespace)
        _PENDING_OF[cls], _BASE_OF[sub] = sub, cls
    return sub


def _check_guardable(params: Mapping[str, torch.Tensor]) -> None:
    """Refuse params whose class cannot be swapped for its pending subclass (e.g. one with ``__slots__``)."""
    seen: set[type] = set()
    for name, p in params.items():
        cls = type(p)
        if cls in seen:
            continue
        seen.add(cls)
        try:
            p.__class__ = _pending_class(cls)
        except TypeError as e:
            raise ValueError(
                f"ZeroOptimizer(overlap_allgather=True): param {name!r} is a {cls.__name__}, whose objects cannot "
                f"take a subclass for the time their gathered values are in flight ({e}). Leave overlap_allgather "
                "off for this model"
            ) from None
        p.__class__ = cls
