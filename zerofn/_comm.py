"""The collectives zerofn sends: the bucket collectives, the scalars and the small checks.

With :mod:`zerofn._comm_count`, :mod:`zerofn._comm_join` and :mod:`zerofn._comm_dcp`, the
only modules that talk to ``torch.distributed``: this is where to look for "where does
the all-gather happen".

Realisations
------------
The algorithm needs two bucket collectives: a *sum of rows* (each rank ends with the
sum over ranks of its own row of a ``(world_size, S)`` buffer: a reduce-scatter) and a
*gather of rows* (every rank ends with all ranks' rows: an all-gather). Each can be
realised in more than one way, and which is fastest depends on the backend:

=================  ============================  =====================================
collective         realisation                   bytes each rank sends (ring / flat)
=================  ============================  =====================================
sum of rows        ``reduce_scatter``            (N-1)/N * N*S * b
sum of rows        ``all_to_all`` + rank-order   (N-1) * S * b
sum of rows        ``all_reduce`` + own row      2(N-1)/N * N*S * b
gather of rows     ``all_gather``                (N-1)/N * N*S * b
gather of rows     ``broadcast`` (one per rank)  (N-1) * S * b  (as root of its own row)
=================  ============================  =====================================

NCCL implements reduce-scatter and all-gather natively and they are byte-optimal, so
``CommPolicy()`` picks them there. gloo runs its reduce-scatter, all-reduce and
all-gather in several steps (each a round of thread wake-ups) and its all-to-all and
broadcasts in one (the figures: docs/functional-loop.md), so on gloo the default policy
sends the same bytes through those. ``CommPolicy.byte_optimal()`` forces reduce-scatter
+ all-gather anywhere.

Bytes
-----
Every collective here reports the bytes this rank sends to :mod:`zerofn._comm_count`,
whose ``count_bytes()`` adds them up. Joining a group in bounded time lives in
:mod:`zerofn._comm_join`, and the DCP calls of the checkpoints in :mod:`zerofn._comm_dcp`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from zerofn._comm_count import record, ring_share

__all__ = [
    "CommPolicy",
    "Pending",
    "all_gather_ints",
    "all_reduce_scalars",
    "exchange_rows",
    "gather_rows",
    "group_from_name",
    "group_name",
    "group_rank",
    "group_size",
    "launch_gather_ints",
    "rank_order_sum",
    "sum_across",
    "sum_rows",
    "tracing",
]

Group = dist.ProcessGroup | None

_c10d = torch.ops._c10d_functional  # the functional collective ops themselves (launch and wait apart)

# torch >= 2.10 renames the flat-tensor collectives to *_single and deprecates the old
# names; older torch (down to 2.4) only has the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tracing() -> bool:
    """True while ``torch.compile`` traces the caller (then collectives are functional).

    Eagerly every collective here is a c10d call (with work handles for overlap); under
    tracing it is the matching functional collective (``_c10d_functional.*`` and
    ``wait_tensor``), which the compiler keeps in the graph, so one compiled step holds
    every collective of the step and no graph break.
    """
    return torch.compiler.is_compiling()


def group_name(group: Group) -> str | None:
    """A name that finds ``group`` again in this process (:func:`group_from_name`); ``None`` for the default."""
    return None if group is None else group.group_name


def group_from_name(name: str | None) -> Group:
    """The process group :func:`group_name` named (``None``: the default group)."""
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def initialized() -> bool:
    """Whether this process has a default process group (``init_process_group`` ran). No communication."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: Group) -> int:
    """Ranks in ``group`` (``None``: the default group). No communication."""
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside ``group``; raises if it is not a member. No communication."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the process group it was given; "
            "call zerofn only with groups this rank belongs to"
        )
    return rank


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class CommPolicy:
    """How the two bucket collectives are realised.

    Attributes:
      reduce: ``"reduce_scatter"``, ``"all_to_all"``, ``"all_reduce"`` or ``"auto"``
        (reduce-scatter on NCCL and other backends, all-to-all on gloo). ``"all_to_all"``
        hands each rank its row of every rank's bucket in one exchange and the owner adds
        the ``N`` rows in rank order: the bytes of a reduce-scatter, in one step; gloo's
        own reduce-scatter and all-reduce take several steps, each a round of thread
        wake-ups, and were slower from a few scalars to 16 MiB buckets
        (docs/functional-loop.md).
      gather: ``"all_gather"``, ``"broadcast"`` or ``"auto"`` (all-gather on NCCL and
        other backends, one broadcast per rank on gloo).
    """

    reduce: Literal["auto", "reduce_scatter", "all_to_all", "all_reduce"] = "auto"
    gather: Literal["auto", "all_gather", "broadcast"] = "auto"

    def __post_init__(self) -> None:
        if self.reduce not in ("auto", "reduce_scatter", "all_to_all", "all_reduce"):
            raise ValueError(
                f"CommPolicy.reduce must be auto, reduce_scatter, all_to_all or all_reduce, got {self.reduce!r}"
            )
        if self.gather not in ("auto", "all_gather", "broadcast"):
            raise ValueError(f"CommPolicy.gather must be auto, all_gather or broadcast, got {self.gather!r}")

    @staticmethod
    def byte_optimal() -> CommPolicy:
        """reduce-scatter + all-gather on every backend: 2(N-1)/N·Ψ·b per rank per step."""
        return CommPolicy("reduce_scatter", "all_gather")

    def resolve(self, group: Group) -> tuple[str, str]:
        """The concrete ``(reduce, gather)`` realisations for ``group``'s backend."""
        gloo = dist.get_backend(group) == "gloo"
        reduce = self.reduce if self.reduce != "auto" else ("all_to_all" if gloo else "reduce_scatter")
        gather = self.gather if self.gather != "auto" else ("broadcast" if gloo else "all_gather")
        return reduce, gather


# --------------------------------------------------------------------------- collectives


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result.

    Launching and waiting are separate so that callers can overlap communication with
    computation (``async_op=True`` work handles on gloo, the comm stream on NCCL).
    """

    __slots__ = ("_finish", "_handles", "_result", "_traced")

    def __init__(self, handles: list, finish: Callable[[], torch.Tensor], *, traced: bool = False) -> None:
        self._handles = handles
        self._finish = finish
        self._result: torch.Tensor | None = None
        # A functional collective in a graph being traced: whether it has finished is a
        # question for run time, so a pipeline keeps it pending until its depth or its end.
        self._traced = traced

    def done(self) -> bool:
        """True once the collective has finished (``wait()`` would not block); never while traced."""
        if self._result is not None:
            return True
        return not self._traced and all(h is None or h.is_completed() for h in self._handles)

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        """The same collective, finished by ``fn`` of this one's result (this one is not waited)."""
        return Pending(self._handles, lambda: fn(self._finish()))

    def wait(self) -> torch.Tensor:
        if self._result is None:
            for h in self._handles:
                if h is not None:
                    h.wait()
            self._handles = []
            self._result = self._finish()
        return self._result


def sum_rows(
    rows: torch.Tensor,
    group: Group,
    how: str,
    *,
    async_op: bool = False,
    whole: bool = False,
    received: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> Pending:
    """Sum a rank-major ``(N, S)`` buffer over the group and keep this rank's row.

    Args:
      rows: ``(world_size, S)`` contiguous buffer, any floating dtype. It is consumed:
        the all-reduce and all-to-all realisations write the sum into it.
      group: the process group, ``None`` for the default.
      how: ``"reduce_scatter"``, ``"all_to_all"`` or ``"all_reduce"`` (see :class:`CommPolicy`).
      async_op: launch and return at once; ``wait()`` on the result.
      whole: keep every row of the sum (the all-reduce realisation only).
      received: an ``(N, S)`` buffer of ``rows``' dtype the all-to-all receives into, free
        again once ``wait()`` has returned (a staging buffer: fresh multi-MB rows every
        step fault in new pages); default a new one. The other realisations need none.
      out: an ``(S,)`` contiguous tensor of ``rows``' dtype the row of the sum lands in
        (where the caller keeps it, so that nothing copies it there afterwards): the
        reduce-scatter's output, the all-to-all's rank-order sum. Not with ``whole``
        (``ValueError`` before the collective, as for another shape or dtype); ignored
        under tracing (a graph plans its buffers).

    Returns:
      A :class:`Pending` whose ``wait()`` gives the ``(S,)`` sum of row ``rank`` over all
      ranks, in ``rows.dtype`` (``out`` when given; with ``whole``: the ``(N, S)`` sum,
      ``rows`` itself).

    The all-to-all realisation adds the ``N`` rows it receives in rank order, one add at a
    time, into ``out`` or ``rows[rank]`` (sent by then): the same bits on every rank and in
    a compiled step; at ``N = 2`` the bits of an all-reduce (one add, which commutes).

    Collectives: one ``reduce_scatter``, ``all_to_all_single`` or ``all_reduce`` of ``N*S`` elements.
    """
    n, s = rows.shape
    rank = group_rank(group)
    elem = rows.element_size()
    if whole and how != "all_reduce":
        raise ValueError(f"sum_rows: whole=True keeps every row of an all-reduce; {how!r} leaves one row per rank")
    if out is not None and (whole or out.shape != (s,) or out.dtype != rows.dtype or not out.is_contiguous()):
        raise ValueError(  # before the collective: a bad destination must not leave the other ranks waiting
            f"sum_rows: out= takes this rank's row of the sum, a contiguous ({s},) {rows.dtype} tensor, not with "
            f"whole=True; got {tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()}, whole={whole})"
        )
    traced = tracing()
    if traced:
        out = None  # a graph plans its own buffers

    def own_row(summed: torch.Tensor) -> torch.Tensor:  # the realisations that sum elsewhere: copied into ``out``
        return summed if out is None else out.copy_(summed)

    if n == 1:
        return Pending([], (lambda: rows) if whole else (lambda: own_row(rows[0])))
    if traced:
        return _sum_rows_traced(rows, group, how, rank, whole)
    if how == "reduce_scatter":
        dest = torch.empty(s, dtype=rows.dtype, device=rows.device) if out is None else out
        handle = _reduce_scatter_flat(dest, rows.view(-1), group=group, async_op=async_op)
        record("reduce_scatter", ring_share(n, n * s, elem))
        return Pending([handle], lambda: dest)
    if how == "all_to_all":
        received = torch.empty_like(rows) if received is None else received
        handle = dist.all_to_all_single(received.view(-1), rows.view(-1), group=group, async_op=async_op)
        record("all_to_all", ring_share(n, n * s, elem))
        return Pending([handle], lambda: rank_order_sum(received, out=rows[rank] if out is None else out))
    if how == "all_reduce":
        handle = dist.all_reduce(rows, group=group, async_op=async_op)
        record("all_reduce", 2 * ring_share(n, n * s, elem))
        return Pending([handle], (lambda: rows) if whole else (lambda: own_row(rows[rank])))
    raise ValueError(f"unknown reduce realisation {how!r}")


def rank_order_sum(rows: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows[0] + rows[1] + ... + rows[N-1]`` (``N >= 2``), one add at a time, into ``out``
    when given: every rank and a compiled graph add in this order, so the bits are the same."""
    total = torch.add(rows[0], rows[1], out=out) if out is not None else rows[0] + rows[1]
    for r in range(2, len(rows)):
        total = total.add_(rows[r]) if out is not None else total + rows[r]
    return total


def _functional_group(group: Group) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _launched(out: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Pending:
    """A functional collective's output in a traced graph, with its ``wait_tensor`` at ``wait()``.

    ``torch.distributed._functional_collectives`` waits on its result at once under tracing,
    so the graph would wait for each bucket before launching the next; the
    ``_c10d_functional`` ops themselves launch, and the wait goes where the pipeline settles.
    """
    return Pending([], lambda: finish(_c10d.wait_tensor(out)), traced=True)


def _sum_rows_traced(rows: torch.Tensor, group: Group, how: str, rank: int, whole: bool) -> Pending:
    """:func:`sum_rows` under tracing: the functional collective, waited on at ``wait()``."""
    n, name = rows.shape[0], _functional_group(group).group_name
    if how == "reduce_scatter":
        return _launched(_c10d.reduce_scatter_tensor(rows.reshape(-1), "sum", n, name))
    if how == "all_to_all":
        splits = [rows.shape[1]] * n
        received = _c10d.all_to_all_single(rows.reshape(-1), splits, splits, name)
        return _launched(received, lambda t: rank_order_sum(t.view(n, -1)))
    if how == "all_reduce":
        summed = _c10d.all_reduce(rows, "sum", name)
        return _launched(summed) if whole else _launched(summed, lambda t: t[rank])
    raise ValueError(f"unknown reduce realisation {how!r}")


def sum_across(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum a contiguous tensor in place over ``group`` (the replicas of a hybrid layout).

    Returns ``t``. Collectives: one ``all_reduce`` of ``t.numel()`` elements (none for a
    group of one or ``None``, which here means "no replicas", not the default group).
    """
    if group is None:
        return t
    n = group_size(group)
    if n > 1 and tracing():
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))
    if n > 1:
        dist.all_reduce(t, group=group)
        record("all_reduce", 2 * ring_share(n, t.numel(), t.element_size()))
    return t


def gather_rows(
    row: torch.Tensor, group: Group, how: str, *, async_op: bool = False, out: torch.Tensor | None = None
) -> Pending:
    """Gather every rank's ``(S,)`` row on every rank: into an ``(N, S)`` buffer, or the ``N`` rows apart.

    Args:
      row: this rank's ``(S,)`` contiguous row, any dtype; read, never written, until the
        gather completes. With the broadcast realisation it may be ``out[rank]`` itself.
      group: the process group, ``None`` for the default.
      how: ``"all_gather"`` or ``"broadcast"`` (see :class:`CommPolicy`).
      async_op: launch and return at once; ``wait()`` on the result.
      out: a contiguous ``(N, S)`` buffer of ``row``'s dtype and device to receive into
        (reused between steps by the facade: a fresh one faults in new pages every
        time); default a new one.

    Returns:
      A :class:`Pending` whose ``wait()`` gives, row ``r`` from rank ``r``:

      - all-gather: the ``(N, S)`` buffer (``out`` if given);
      - broadcasts: the ``N`` rows apart, a list: row ``rank`` is ``row`` itself, sent from
        where it lies (a range of the master buffer: no copy of it into ``out``), the
        others are ``out``'s rows. :func:`~zerofn.buckets.unpack_rows` reads them where
        they are.

      Under ``torch.compile`` a list either way: the ``(N, S)`` buffer alone (all-gather),
      or the ``N`` rows (broadcasts: each lands in a tensor of its own).

    Collectives: one ``all_gather`` of ``N*S`` elements, or ``N`` broadcasts of ``S``.
    """
    (s,) = row.shape
    n = group_size(group)
    rank = group_rank(group)
    elem = row.element_size()
    if tracing():
        return _gather_rows_traced(row, group, how, n, rank, out)
    if out is None:
        out = torch.empty(n, s, dtype=row.dtype, device=row.device)
    elif out.shape != (n, s) or out.dtype != row.dtype or out.device != row.device or not out.is_contiguous():
        raise ValueError(
            f"gather_rows: out must be a contiguous ({n}, {s}) {row.dtype} buffer on {row.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if how == "all_gather":
        if row.data_ptr() == out[rank].data_ptr():
            raise ValueError("gather_rows: only the broadcast realisation gathers from a row packed into out[rank]")
        if n == 1:
            out[0].copy_(row)
            return Pending([], lambda: out)
        handle = _all_gather_flat(out.view(-1), row, group=group, async_op=async_op)
        record("all_gather", ring_share(n, n * s, elem))
        return Pending([handle], lambda: out)
    if how == "broadcast":
        # This rank's row is sent from where it lies and read from there: a copy into
        # out[rank] would be one more pass over S elements, for nothing.
        rows = [row if r == rank else out[r] for r in range(n)]
        if n == 1:
            return Pending([], lambda: rows)  # type: ignore[arg-type,return-value]
        handles = []
        for r in range(n):
            src = r if group is None else dist.get_global_rank(group, r)
            handles.append(dist.broadcast(rows[r], src=src, group=group, async_op=async_op))
        record("broadcast", (n - 1) * s * elem)
        return Pending(handles, lambda: rows)  # type: ignore[arg-type,return-value]
    raise ValueError(f"unknown gather realisation {how!r}")


def _gather_rows_traced(
    row: torch.Tensor, group: Group, how: str, n: int, rank: int, out: torch.Tensor | None
) -> Pending:
    """:func:`gather_rows` under tracing: functional collectives; ``wait()`` gives a list, the
    new ``(N, S)`` buffer alone or its ``N`` rows apart (one per broadcast).

    ``out`` is not written (a compiled graph plans its own buffers); a row packed into
    ``out[rank]`` is read from there.
    """
    (s,) = row.shape
    if n == 1:
        return Pending([], lambda: [row.reshape(1, s)])  # type: ignore[arg-type,return-value]
    name = _functional_group(group).group_name
    if how == "all_gather":
        return _launched(_c10d.all_gather_into_tensor(row.contiguous(), n, name), lambda t: [t.view(n, s)])  # type: ignore[arg-type,return-value]
    if how == "broadcast":
        sent = [row if r == rank else torch.empty_like(row) for r in range(n)]
        rows = [_c10d.broadcast(sent[r], r, name) for r in range(n)]  # c10d roots are group ranks
        return Pending([], lambda: [_c10d.wait_tensor(t) for t in rows], traced=True)  # type: ignore[arg-type,return-value]
    raise ValueError(f"unknown gather realisation {how!r}")


def all_reduce_scalars(values: torch.Tensor, op: str, group: Group) -> torch.Tensor:
    """All-reduce a small 1-D tensor (norms, flags) with ``op`` in ``{"sum", "max"}``.

    Returns a new tensor; ``values`` is not changed. On gloo every rank's values are
    all-gathered and added in rank order, one add at a time (or their maximum taken): one
    step where gloo's all-reduce takes several, and the same bits on every rank, eagerly
    and compiled. Collectives: one ``all_reduce`` (gloo: one ``all_gather``).
    """
    n = group_size(group)
    if n == 1:
        return values.clone()
    gathered = dist.get_backend(group) == "gloo"
    if tracing():
        if not gathered:
            return funcol.wait_tensor(funcol.all_reduce(values, op, _functional_group(group)))
        rows = funcol.wait_tensor(funcol.all_gather_tensor(values, 0, _functional_group(group))).view(n, -1)
        return rank_order_sum(rows) if op == "sum" else rows.amax(0)
    if gathered:
        rows = torch.empty(n, values.numel(), dtype=values.dtype, device=values.device)
        _all_gather_flat(rows.view(-1), values, group=group)
        record("scalars", ring_share(n, rows.numel(), rows.element_size()))
        return rank_order_sum(rows) if op == "sum" else rows.amax(0)
    out = values.clone()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(out, op=reduce_op, group=group)
    record("scalars", 2 * ring_share(n, out.numel(), out.element_size()))
    return out


def all_gather_ints(values: list[int], group: Group, device: torch.device | str = "cpu") -> torch.Tensor:
    """Every rank's list of ``k`` int64 values, as an ``(N, k)`` tensor. One ``all_gather``."""
    return launch_gather_ints(values, group, device).wait()


def launch_gather_ints(values: list[int], group: Group, device: torch.device | str = "cpu") -> Pending:
    """:func:`all_gather_ints`, launched: ``wait()`` gives the ``(N, k)`` int64 table.

    Eagerly the all-gather runs while the caller computes (``async_op=True``); under
    tracing it is the functional collective, waited in the graph.
    """
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    n = group_size(group)
    if n == 1:
        return Pending([], lambda: mine.unsqueeze(0))
    if tracing():
        gathered = funcol.all_gather_single(mine, 0, _functional_group(group))
        table = funcol.wait_tensor(gathered).view(n, mine.numel())
        return Pending([], lambda: table)
    out = torch.empty(n, mine.numel(), dtype=torch.int64, device=device)
    handle = _all_gather_flat(out.view(-1), mine, group=group, async_op=True)
    record("check", ring_share(n, out.numel(), 8))
    return Pending([handle], lambda: out)


def exchange_rows(rows: torch.Tensor, group: Group) -> Pending:
    """Send row ``k`` of ``(N - 1, W)`` uint8 ``rows`` to the k-th other rank (rank order,
    this rank left out); ``wait()`` gives the ``(N - 1, W)`` rows received, by source rank.

    Every rank passes the same ``W`` (agreed before: a mismatch inside the collective
    hangs). Bytes cross as uint8 because gloo refuses float8 tensors.

    Collectives: one ``all_to_all_single`` of ``(N - 1) W`` bytes each way, recorded as
    ``"all_to_all"``.
    """
    n, rank = group_size(group), group_rank(group)
    width = rows.shape[1]
    splits = [0 if j == rank else width for j in range(n)]
    received = torch.empty_like(rows)
    handle = dist.all_to_all_single(received.view(-1), rows.view(-1), splits, splits, group=group, async_op=True)
    record("all_to_all", rows.numel())
    return Pending([handle], lambda: received)
