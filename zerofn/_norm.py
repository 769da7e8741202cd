"""This rank's term of the global gradient norm, in float64, without a float64 copy of any gradient.

The global norm (:func:`zerofn.stages.global_grad_norm`, and the first thing
:func:`zerofn.stages.step_shards` computes) sums every rank's local term in one scalar
all-reduce. The local term is the sum of squares (2-norm) or the largest absolute value
(inf-norm) of this rank's gradient pieces. zerofn accumulates the squares in float64, so
that the reported norm and the clipping coefficient do not depend on how the gradients
are split into shards beyond float64 rounding.

``torch.linalg.vector_norm(g, dtype=torch.float64)`` does that on the CPU by first
converting all of ``g`` to a new float64 tensor: a copy of twice the gradient's size on
every step. Here the pieces stream through one small float64 buffer instead: a chunk of
elements is converted into it (cache resident), squared and summed with ``torch.dot``, and
the next chunk overwrites it; small pieces share a chunk, so a model of hundreds of
little tensors costs a few calls, not hundreds. Same float64 accumulation, a different
summation order (relative differences of order 1e-16 per element; the sum's rounding).
On CUDA, ``torch._foreach_norm`` with ``dtype=torch.float64`` reads the pieces in their
own dtype and accumulates in float64 in one fused launch, so it is used there.
The inf-norm is exact in any dtype (a maximum rounds nothing): no conversion at all.
A compiled step calls the same streamed code as one opaque op, ``zerofn::sum_of_squares``:
the eager bits under any backend, and no generated reduction kernel to compile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

#: Elements per float64 chunk: 512 KiB, inside a core's L2 cache, so a chunk is still cached
#: when ``torch.dot`` reads it back; a smaller chunk costs more calls per piece.
CHUNK_NUMEL = 2**16


def local_norm_term(pieces: Iterable[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the global ``norm_type`` norm, a 0-d float64 tensor on ``device``.

    Args:
      pieces: this rank's gradient pieces (shards, or views of owned ranges), any shapes,
        any floating dtypes; each on its own device (CPU offload may put them elsewhere).
      norm_type: 2.0 (returns the sum of squares) or ``math.inf`` (the largest absolute value).
      device: where the result goes (the params' device, where the all-reduce runs).

    Returns:
      A 0-d float64 tensor: ``sum(x**2)`` accumulated in float64, or ``max(|x|)``; 0 with
      no elements; ``inf``/``nan`` if an element is not finite.

    Collectives: none.
    """
    tensors = [t.detach() for t in pieces if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    if norm_type != math.inf and not all(t.is_cuda for t in tensors):
        if torch.compiler.is_compiling():  # the eager code, as one opaque node: the same bits
            return _sum_of_squares_op(tensors).to(device)
        return _eager_sum_of_squares(tensors).to(device)
    if not torch.compiler.is_compiling():  # storage addresses exist only eagerly
        tensors = _coalesced(tensors)
    if norm_type == math.inf:
        maxima = torch._foreach_norm(tensors, math.inf)
        return torch.stack([m.to(device, torch.float64) for m in maxima]).max()
    return _fused_sum_of_squares(tensors).to(device)


def _eager_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum(x**2)`` in float64 over CPU pieces (some may live elsewhere): streamed, adjacent pieces merged."""
    return _streamed_sum_of_squares(_coalesced(tensors))


@torch.library.custom_op("zerofn::sum_of_squares", mutates_args=())
def _sum_of_squares_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    return _eager_sum_of_squares(tensors)


@_sum_of_squares_op.register_fake
def _(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0].new_empty((), dtype=torch.float64, device="cpu")


def _coalesced(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each run of back-to-back pieces of one storage merged into one flat view.

    The reducer's stage-2 shards are consecutive views of one reduced bucket row (each
    member's shard, padding included, right after the previous one): a model of a
    thousand small params then costs a few norm calls, not a thousand. Only exactly
    adjacent, contiguous pieces of the same storage, dtype and device merge, so every
    element is still counted once.
    """
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []

    def close_run() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            total = sum(t.numel() for t in run)
            out.append(run[0].reshape(-1).as_strided((total,), (1,)))  # adjacent pieces of one storage
        run.clear()

    for t in tensors:
        if run and _follows(run[-1], t):
            run.append(t)
            continue
        close_run()
        run.append(t)
    close_run()
    return out


def _follows(prev: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` starts exactly where ``prev`` ends, in the same storage, both contiguous, same dtype and device."""
    return (
        t.dtype == prev.dtype
        and t.device == prev.device
        and t.is_contiguous()
        and prev.is_contiguous()
        and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        and t.data_ptr() == prev.data_ptr() + prev.numel() * prev.element_size()
    )


def _fused_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum(x**2)`` in float64 by ``_foreach_norm(dtype=float64)`` (one fused launch per dtype on CUDA)."""
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float64)
    return torch.stack([n.to(tensors[0].device) for n in norms]).square().sum()


def _streamed_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``sum(x**2)`` over ``tensors`` in float64, through one float64 buffer per device (a CPU 0-d result)."""
    total = torch.zeros((), dtype=torch.float64)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.reshape(-1))
    for device, flats in by_device.items():
        total += _sum_of_squares_on(flats, device).cpu()
    return total


def _sum_of_squares_on(flats: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Stream ``flats`` (1-D, one device) through a chunk buffer: copy in, ``dot`` with itself, add."""
    size = min(CHUNK_NUMEL, sum(f.numel() for f in flats))
    buf = torch.empty(size, dtype=torch.float64, device=device)
    acc = torch.zeros((), dtype=torch.float64, device=device)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    fill = 0

    def flush() -> None:
        nonlocal fill
        torch._foreach_copy_(dst, src)  # the float32 -> float64 conversion, chunk by chunk
        used = buf[:fill]
        acc.add_(torch.dot(used, used))
        dst.clear()
        src.clear()
        fill = 0

    for flat in flats:
        start = 0
        while start < flat.numel():
            take = min(size - fill, flat.numel() - start)
            dst.append(buf[fill : fill + take])
            src.append(flat[start : start + take])
            fill += take
            start += take
            if fill == size:
                flush()
    if fill:
        flush()
    return acc


def exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a finite float64 tensor ``x >= 0``: ``math.sqrt``'s bits.

    torch's CPU ``sqrt`` of float64 may be a vector-library routine, off by one ulp from
    the IEEE square root for some inputs; the eager step takes ``math.sqrt`` of the
    all-reduced sum, so a compiled step must too. From ``torch.sqrt``'s guess ``y``, the
    neighbour of ``y`` (one ulp down, ``y``, one up) whose square is nearest to ``x`` is
    the correctly rounded root; each square's residual ``x - c*c`` is computed exactly
    with Dekker's product (Veltkamp split, only IEEE ``+ - *``, which round alike
    everywhere). Collectives: none.
    """
    guess = torch.sqrt(x)
    best, best_res = guess, _residual(x, guess)
    for direction in (-math.inf, math.inf):
        c = torch.clamp(torch.nextafter(guess, torch.full_like(guess, direction)), min=0.0)
        res = _residual(x, c)
        better = res < best_res
        best, best_res = torch.where(better, c, best), torch.where(better, res, best_res)
    return best


def _residual(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``|x - c*c|`` without rounding error in ``c*c`` (Dekker: ``c*c = p + e`` exactly)."""
    split = c * 134217729.0  # 2**27 + 1
    hi = split - (split - c)
    lo = c - hi
    p = c * c
    e = ((hi * hi - p) + 2.0 * hi * lo) + lo * lo
    return ((x - p) - e).abs()
