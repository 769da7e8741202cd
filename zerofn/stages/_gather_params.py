"""``gather_params``: every rank's master shards gathered into full params in their working dtypes."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zerofn import _agreement as agreement
from zerofn import _checks as checks
from zerofn import _comm as comm
from zerofn import flat
from zerofn._bucket_gather import rows_in_place
from zerofn._comm import CommPolicy, Group, Pending
from zerofn._offsets import Bucket, plan_buckets, sub_buckets
from zerofn.buckets import StagingPool, decode_bucket, encode_bucket, launch_gather, pack_shards, unpack_rows
from zerofn.layout import ShardLayout, live_layout
from zerofn.stages._pipeline import InFlight, _check_staging, check_bucket_numel, pipeline_pool
from zerofn.state import ZeroState

#: Params one ``zerofn::unpack_rows`` node of a compiled gather writes at most. The node
#: returns every tensor it writes, and inductor's passes visit each output together with
#: all its siblings, a cost quadratic in the outputs: on the benchmarks' 1,028-tensor MLP
#: (two buckets) the reinplacing pass took 35 s of the first compile with one node per
#: bucket, 2.6 s with one per 64 params. Each node is one op call at run time.
UNPACK_MEMBERS = 64


def gather_params(
    state: ZeroState,
    group: Group = None,
    *,
    bucket_numel: int | None = None,
    comm_policy: CommPolicy | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    check: bool = True,
    staging: StagingPool | None = None,
) -> dict[str, torch.Tensor]:
    """All ranks' master shards, gathered into full params in their working dtypes.

    Each bucket's shards are cast to the params' working dtype (the wire carries working
    precision; float32 masters are rounded to nearest), moved to the params' device if
    the state lives elsewhere (CPU offload: from a pinned buffer, non-blocking), gathered
    into a rank-major ``(N, S)`` buffer, and cut back into full tensors with the padding
    dropped.

    Args:
      state: the current state.
      group: the sharding process group (``None``: default).
      bucket_numel: padded elements per bucket; ``None``: ``state.bucket_numel``.
      comm_policy: how collectives are realised; default :class:`CommPolicy` (per backend).
      out: explicit donation of destination tensors: name -> tensor of the param's
        shape and dtype (e.g. the model's own parameters) to write into in place instead
        of allocating new ones. Validated before any collective.
      check: confirm with one tiny all-gather that every rank has the same layout and
        bucket size (the default), unless ``state`` comes from a ``step_shards`` over
        ``group`` that confirmed both (``state.agreed_in``) and the gather uses the state's
        bucket size (``bucket_numel`` ``None`` or ``state.bucket_numel``): then the step's
        own scalar all-reduce has, and a functional step runs one agreement in all. A
        caller that has confirmed it once for this layout and group, as the facade does at
        construction, may pass False to save the round trip. (Which path a gather takes
        must be the same on every rank: a bucket size other than the state's is passed on
        all ranks or on none.)
      staging: explicit buffer reuse: a :class:`~zerofn.buckets.StagingPool` the ``(N, S)``
        receive buffers are taken from and given back to (with the broadcast
        realisation this rank's row is sent from its range of the master buffer where no
        cast is needed, else packed into its slot); ``None``: fresh buffers. The
        returned params never alias its buffers.
    Returns:
      A new dict name -> full param (layout order, original shape, working dtype, on the
      params' device ``state.work_device``), equal on every rank. Without ``out`` the
      caller owns fresh tensors that nothing in ``state`` aliases; with ``out`` the
      values are ``out``'s tensors.

    A bucket that is one param without padding is gathered straight into that param's
    tensor (eagerly): nothing is staged or unpacked for it.

    Collectives: one tiny ``all_gather`` (rank agreement, unless ``check=False`` or the
    state's step confirmed it), then
    per bucket one ``all_gather`` (NCCL) or one ``broadcast`` per rank (gloo) of ``S``
    elements each.
    """
    layout = state.layout
    checks.validate_world(layout, group, "gather_params")
    bucket_numel = state.bucket_numel if bucket_numel is None else bucket_numel
    # The step confirmed state.bucket_numel on every rank: passing it again changes nothing.
    confirmed = bucket_numel == state.bucket_numel and state.agreed_in == agreement.agreement_key(group)
    check_bucket_numel(bucket_numel, "gather_params")
    device = state.work_device
    _check_staging(staging, "gather_params")
    if out is not None:
        checks.validate_out(out, layout, "gather_params")
    if check and not confirmed:
        settings = {"bucket_numel": bucket_numel}
        agreement.check_ranks_agree(layout, group, "gather_params", settings=settings, device=device)
    how = (comm_policy or CommPolicy()).resolve(group)[1]
    tracing = comm.tracing()
    result = dict(out) if out is not None else _fresh_params(layout, device, separate=tracing)
    # Without the caller's pool, one for this call: bucket k + 2 reuses bucket k's pages.
    # (Under torch.compile the compiler plans buffers: a caller's pool is left alone.)
    pool = staging if staging is not None and not tracing else pipeline_pool()
    kept = staging is not None and out is not None and not tracing
    apart = how == "broadcast"  # the broadcasts' rows are read where they lie (gather_rows)

    def write(item: tuple[Bucket, torch.Tensor | None], pending: Pending) -> None:
        bucket, borrowed = item
        rows = pending.wait()
        if borrowed is None:  # gathered into the param itself
            return
        with torch.no_grad():  # `out` may be leaf params that require grad
            if tracing:  # the eager copies as opaque nodes: memcpy, not a generated index loop per param
                _unpack_traced(rows, layout, bucket, result)
            else:  # copied out of the rows; into `out` through the views the caller's pool keeps
                targets = staging.unpack_targets(layout, bucket, result, separate=apart) if kept else None
                unpack_rows(rows, layout, bucket, result, targets=targets)
        pool.give(borrowed)

    # Pipelined: earlier buckets' rows are written into the params while this one is on
    # the wire; at most MAX_IN_FLIGHT + 1 gathered buffers exist at once.
    in_flight: InFlight[tuple[Bucket, torch.Tensor | None]] = InFlight(write, pool)
    n = layout.world_size
    for bucket in plan_buckets(layout, bucket_numel):
        dtype, n_s = layout[bucket.names[0]].dtype, n * bucket.shard_numel
        # A lone unpadded param receives its gather in its own storage (eagerly: a graph plans its buffers).
        recv = None if tracing else rows_in_place(layout, bucket, result)
        borrowed = None
        if recv is None:
            borrowed = pool.take(n_s, dtype, device)
            recv = borrowed[:n_s].view(n, bucket.shard_numel)
        in_place = recv[state.rank] if apart else None
        row = pack_shards(state.master, layout, bucket, dtype=dtype, device=device, out=in_place, rank=state.rank)
        if borrowed is None and in_place is not None and row.data_ptr() != in_place.data_ptr():
            row = in_place.copy_(row)  # the param's own chunk: nothing unpacks a bucket gathered in place
        in_flight.push((bucket, borrowed), launch_gather(row, group, how, async_op=True, out=recv))
    in_flight.settle()
    return result


def _fresh_params(layout: ShardLayout, device: torch.device, *, separate: bool = False) -> dict[str, torch.Tensor]:
    """New full params (layout order): views of one new buffer per dtype, each param at an
    aligned offset, so a gather allocates once per dtype, not once per param.

    ``separate``: one tensor per param instead, for a compiled graph (it plans its own
    buffers, and graph outputs that are views of one buffer are rebuilt view by view on
    every call).
    """
    if separate:
        return {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in layout.params}
    sizes, offsets = flat.full_param_offsets(layout)
    buffers = {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes}
    return {s.name: buffers[s.dtype][offsets[s.name] : offsets[s.name] + s.numel].view(s.shape) for s in layout.params}


def _unpack_traced(
    rows: list[torch.Tensor], layout: ShardLayout, bucket: Bucket, result: Mapping[str, torch.Tensor]
) -> None:
    """A compiled gather's rows of ``bucket`` into ``result``: one ``zerofn::unpack_rows`` node
    per run of at most :data:`UNPACK_MEMBERS` members, each reading its columns of the rows."""
    for sub, first in sub_buckets(layout, bucket, UNPACK_MEMBERS):
        part = rows
        if sub is not bucket:
            cols = slice(first, first + sub.shard_numel)
            part = [rows[0][:, cols]] if rows[0].dim() == 2 else [r[cols] for r in rows]
        _unpack_rows_op(part, [result[n] for n in sub.names], encode_bucket(layout, sub))


@torch.library.custom_op("zerofn::unpack_rows", mutates_args=("outs",))
def _unpack_rows_op(rows: list[torch.Tensor], outs: list[torch.Tensor], desc: str) -> None:
    """:func:`~zerofn.buckets.unpack_rows` of a bucket (:func:`~zerofn.buckets.encode_bucket`'s
    ``desc``) into ``outs``, its members' full tensors in bucket order. ``rows``: the
    gathered ``(N, S)`` buffer alone, or its ``N`` rows (one per broadcast)."""
    fingerprint, bucket, _ = decode_bucket(desc)
    layout = live_layout(fingerprint)
    unpack_rows(rows[0] if rows[0].dim() == 2 else rows, layout, bucket, dict(zip(bucket.names, outs, strict=True)))


@_unpack_rows_op.register_fake
def _(rows: list[torch.Tensor], outs: list[torch.Tensor], desc: str) -> None:
    del rows, outs, desc
