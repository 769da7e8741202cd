"""``overlap_allgather``: the param gathers launched by ``step``, written by the next forward.

``step`` launches every bucket's gather asynchronously (:meth:`ParamPrefetcher.launch`:
``pack_shards`` and ``launch_gather`` into an ``(N, S)`` buffer borrowed from the gradient
reducer's staging pool, idle between ``step`` and the next ``backward``; with the
broadcast realisation this rank's row is packed straight into it) and returns. A forward
pre-hook on each module that owns params waits for exactly the buckets those params live
in and writes them into the params (``unpack_rows``: the same pieces, and so the same
bits, as :func:`~zerofn.gather_params`); the model's forward post-hook completes the rest
and refuses a forward that read a param whose gather was still pending.

A param written by the user while its gather is pending (an in-place op after ``step``,
before the forward) is not overwritten: the hook writes the bucket's other members and
tells the :class:`~._guards.ParamGuard`, and the next ``step`` raises on every rank (the
write was made to the values from before the step). ``model.load_state_dict`` is safe:
its pre-hook completes the gathers first.

The hooks are compile-safe: they run eagerly, outside any graph ``torch.compile`` makes
of the model (``torch.compiler.disable``), so a model compiled before or after building
the optimizer gets its params written before each compiled region reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from zerofn import _comm as comm
from zerofn._comm import Group
from zerofn.buckets import StagingPool, launch_gather, pack_shards, unpack_rows
from zerofn.facade._guards import ParamGuard
from zerofn.layout import Bucket, ShardLayout
from zerofn.state import ZeroState

__all__ = ["ParamPrefetcher"]


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
        new pages, about 10 ms a step on the benchmark transformer); ``None``: fresh ones.

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
        self._position = {name: i for i, name in enumerate(layout.names)}
        # Per bucket: the gather launched by the last step and not yet written (its Pending,
        # the row it sends, kept alive until then, and the borrowed receive buffer), or None.
        self._gathers: list[tuple[comm.Pending, torch.Tensor, torch.Tensor | None] | None] = [None] * len(buckets)
        self.pending = 0  # gathers not yet written
        # Per bucket of several params: the row it sends, reused every step.
        self._rows: list[torch.Tensor | None] = [None] * len(buckets)
        self._hooks: list[Any] = []
        self._attach(module)

    def launch(self, state: ZeroState) -> None:
        """Launch every bucket's gather of ``state``'s master shards, without waiting.

        Collectives: per bucket one all-gather (or one broadcast per rank), asynchronous.
        """
        device = state.work_device
        n = self._layout.world_size
        for b, bucket in enumerate(self._buckets):
            dtype = self._layout[bucket.names[0]].dtype
            s = bucket.shard_numel
            borrowed = self._staging.take(n * s, dtype, device) if self._staging is not None else None
            recv = borrowed[: n * s].view(n, s) if borrowed is not None else None
            if recv is not None and self._how == "broadcast":
                out = recv[state.rank]  # packed where the gather wants it: no separate row, no copy
            else:
                out = self._send_row(b, bucket, dtype, state)
            row = pack_shards(state.master, self._layout, bucket, dtype=dtype, device=device, out=out, rank=state.rank)
            pending = launch_gather(row, self._group, self._how, async_op=True, out=recv)
            self._gathers[b] = (pending, row, borrowed)
            self.pending += 1

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
        with torch.no_grad():  # the params are leaves that require grad
            for b in buckets:
                entry = self._gathers[b]
                if entry is None:
                    continue
                self._gathers[b] = None
                self.pending -= 1
                rows = entry[0].wait()
                names = self._buckets[b].names
                if self._guard is not None:
                    written = self._guard.written_since(names)  # by the user, after the step: keep theirs
                    if written:
                        self._guard.mark_stale(written)
                        names = tuple(n for n in names if n not in written)
                unpack_rows(rows, self._layout, self._buckets[b], self._params, names=names)
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

        Buckets still pending here were never waited for in this forward, so any use of
        their params in it read the values from before the last step. Params that took no
        part (layer drop, unused layers) are fine; a param that reached the autograd graph
        of ``output`` is an error (raised after the params are written), as it would
        otherwise train on stale weights silently. Forwards without autograd (``no_grad``)
        cannot be checked this way.
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
                "their gathered values were written: the forward pre-hook that writes a param sits on the module "
                "that owns it, and that module's forward did not run before the param was used (e.g. "
                "F.linear(x, self.proj.weight) without calling self.proj). The forward's result used the weights "
                "from before the last step; they are current now. Call optimizer.wait_params() before such a "
                "forward, or leave overlap_allgather off for this model. Under torch.compile: a forward compiled "
                "before the optimizer was built runs without the hooks (dynamo does not guard on hooks added later); "
                "build the optimizer before the first compiled forward, or call torch._dynamo.reset()."
            )


# The hooks wait for collectives and write params in place: under torch.compile they run
# eagerly (a graph break), never traced into a graph. Traced, their writes would become
# in-graph mutations of params the graph also saves for backward ("modified by an inplace
# operation"), and a graph traced with nothing pending would skip them on later calls.


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
