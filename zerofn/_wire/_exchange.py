"""The compressed reduce-scatter: every rank's mean gradient shard, sent as block-scaled codes.

Note: the scheme
----------------
Rank ``r`` holds a local gradient ``g`` of ``N * S`` float32 elements; chunk ``j`` (elements
``[j*S, (j+1)*S)``) belongs to rank ``j``'s shard. A reduce-scatter leaves on rank ``j`` the
mean over ranks of chunk ``j``. Here each chunk a rank sends (every ``j != r``) travels
quantized (:mod:`zerofn._wire._quant`), with *error feedback*: the rank keeps what the
quantization lost and adds it to the same chunk next step::

    c_j      = g_j + e_j                    (e_j: this rank's residual for chunk j, 0 at first)
    codes_j  = quantize(c_j)
    e_j'     = c_j - dequantize(codes_j)    (exact in float32: see _quant)

so that over ``T`` steps the sum of what each rank sent is ``sum_t g_t - e_T``: nothing is
lost, only delayed (the telescoping identity, tested exactly in tests/test_wire_exchange.py).
A rank's own chunk never leaves it: it is added unquantized and needs no residual.

On rank ``j`` the result is ``(sum over i = 0..N-1 of v_i) / N`` in float32, added in rank
order (``v_j``: its own chunk; ``v_i``: rank ``i``'s dequantized codes), one add at a time,
then one division by ``N``: deterministic, and the same bits on every rank and every CPU
kernel family. Nothing is summed in the compressed type.

Wire: one ``all_to_all_single`` of one packed uint8 buffer. The row a rank sends to rank
``j`` is chunk ``j``'s ``S`` code bytes followed by its ``ceil(S / block)`` fp32 scales as
bytes; the row to itself is empty (split size 0), so nothing is copied to itself. One packed
collective rather than one for codes and one for scales: the same bytes, half the
collective launches (each a round of ``N - 1`` pairwise messages on gloo), for one extra
copy of ``(N-1) * (S + 4 S/block)`` bytes, which is a small fraction of the quantization's
own passes over ``4 (N-1) S`` bytes of float32. Measured (quantize, exchange, dequantize;
int8, block 256; gloo on a shared 2-core CPU, N = 2, 3, 4): at S = 2**12 and 2**16 the packed
call took 0.45-0.8x the time of the two calls (the second launch dominates), at S = 2**20
the two were equal within the noise of the shared machine.

Note: memory
------------
The residual is ``(N - 1) * S`` float32: ``(N - 1) / N`` of the local gradient, i.e.
``4 (N - 1) / N`` bytes per parameter. At ``N = 4`` that is 3 bytes per parameter, as much as
the sharded fp32 master and AdamW's two moments together (``12 / 4``). It is per rank and
does not shrink with ``N``: it tends to the full 4 bytes per parameter.

Collectives go to ``torch.distributed`` from this module: ``zerofn._comm`` has no
all-to-all yet. The bytes are recorded under ``"all_to_all"`` in zerofn's byte counter
(``zerofn.count_bytes()``). Eager only: under ``torch.compile`` this would need the
functional ``all_to_all_single``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerofn._comm import group_rank, group_size
from zerofn._comm_count import record
from zerofn._wire._quant import WireFormat, dequantize_rows, quantize_rows

__all__ = ["bytes_sent", "compressed_reduce_scatter"]

Group = dist.ProcessGroup | None


def bytes_sent(numel_per_shard: int, world_size: int, fmt: WireFormat) -> int:
    """Bytes one rank hands to the collective per :func:`compressed_reduce_scatter` call.

    ``(N - 1) * (S + 4 * ceil(S / block))``: the codes and scales of the ``N - 1`` chunks
    it sends (a byte-optimal fp32 reduce-scatter sends ``(N - 1) * S * 4``). What
    ``zerofn.count_bytes()`` records for the call.
    """
    return (world_size - 1) * fmt.nbytes(numel_per_shard)


def _check(flat: torch.Tensor, residual: torch.Tensor | None, n: int, rank: int) -> int:
    """Validate shapes and dtypes before any collective (a mismatch inside one hangs); return ``S``."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.shape[0] % n:
        raise ValueError(
            f"compressed_reduce_scatter on rank {rank}: flat must be a 1-D float32 tensor of N * S "
            f"elements (N = {n}), got {flat.dtype} of shape {tuple(flat.shape)}; pad it to a multiple of N"
        )
    s = flat.shape[0] // n
    if residual is not None and (
        residual.dtype != torch.float32 or tuple(residual.shape) != ((n - 1) * s,) or residual.device != flat.device
    ):
        raise ValueError(
            f"compressed_reduce_scatter on rank {rank}: residual must be float32 of shape ({(n - 1) * s},) "
            f"((N - 1) * S, the chunks this rank sends) on {flat.device}, got {residual.dtype} "
            f"of shape {tuple(residual.shape)} on {residual.device}; pass None for the first step"
        )
    return s


def _exchange(packed: torch.Tensor, n: int, rank: int, group: Group) -> torch.Tensor:
    """All-to-all of ``(N-1, W)`` uint8 rows, row ``k`` to the k-th other rank; the rows received, by source.

    Collectives: one ``all_to_all_single`` of ``(N - 1) * W`` bytes each way.
    """
    width = packed.shape[1]
    splits = [0 if j == rank else width for j in range(n)]
    received = torch.empty_like(packed)
    dist.all_to_all_single(received.view(-1), packed.view(-1), splits, splits, group=group)
    record("all_to_all", packed.numel())
    return received


def compressed_reduce_scatter(
    flat: torch.Tensor, residual: torch.Tensor | None, fmt: WireFormat, group: Group = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over ranks of this rank's chunk, sent compressed with error feedback.

    Args:
      flat: ``(N * S,)`` float32, this rank's local gradient, finite (detect overflow
        first: quantizing inf or NaN gives meaningless codes); chunk ``j`` is rank ``j``'s
        shard. Every rank passes the same ``N * S``.
      residual: ``((N - 1) * S,)`` float32, this rank's error-feedback residual for the
        chunks it sends, in rank order skipping its own (chunk ``j`` at slot ``j`` if
        ``j < rank``, else ``j - 1``); ``None`` means zeros (the first step): the chunks are
        sent as they are (no add, so a ``-0.0`` stays ``-0.0``).
      fmt: the wire format (:class:`~zerofn._wire._quant.WireFormat`).
      group: the process group, ``None`` for the default.

    Returns:
      ``(shard_mean, new_residual)``: ``(S,)`` float32, ``(v_0 + v_1 + ... + v_{N-1}) / N``
      added in rank order (``v_rank`` this rank's own chunk, unquantized; ``v_i`` rank
      ``i``'s dequantized codes), the same bits on every rank; and the ``((N - 1) * S,)``
      float32 residual to pass next step, ``c - dequantize(quantize(c))`` for
      ``c = chunk + residual``. New tensors: ``flat`` and ``residual`` are not written.

    Memory: the residual is ``(N - 1) / N`` of the local gradient in fp32 (3 bytes per
    parameter at ``N = 4``, as much as the sharded fp32 master and AdamW moments, 12 / 4).

    Collectives: one ``all_to_all_single`` of :func:`bytes_sent` bytes (none at ``N = 1``),
    recorded as ``"all_to_all"`` by ``zerofn.count_bytes()``.
    """
    n, rank = group_size(group), group_rank(group)
    s = _check(flat, residual, n, rank)
    chunks = flat.view(n, s)
    if n == 1:
        return chunks[0] / 1, flat.new_empty(0)
    sent = torch.cat([chunks[:rank], chunks[rank + 1 :]])  # (N-1, S), a new tensor
    if residual is not None:
        sent = sent + residual.view(n - 1, s)
    payload, scales = quantize_rows(sent, fmt)
    new_residual = (sent - dequantize_rows(payload, scales, fmt)).view(-1)
    packed = torch.cat([payload, scales.view(torch.uint8)], dim=1)  # (N-1, S + 4 nb) bytes
    received = _exchange(packed, n, rank, group)
    nb = fmt.num_blocks(s)
    # A row's scale bytes start at byte S, not always 4-aligned: a fresh 1-D copy before the
    # fp32 view (clone() and contiguous() keep a single row's offset and stride).
    got_scales = received[:, s:].reshape(-1).clone().view(torch.float32).view(n - 1, nb)
    values = dequantize_rows(received[:, :s], got_scales, fmt)  # (N-1, S): row k from the k-th other rank
    total = chunks[0].clone() if rank == 0 else values[0].clone()
    for i in range(1, n):
        total += chunks[rank] if i == rank else values[i if i < rank else i - 1]
    return total.div_(n), new_residual
