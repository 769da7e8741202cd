"""Block-scaled quantization of a float32 gradient for the wire: int8 and fp8, with a proven bound.

Pure functions: no collectives, no host syncs, nothing mutated, every result a new tensor.

Note: vocabulary
----------------
* *block*: ``fmt.block`` consecutive elements of a 1-D tensor that share one fp32 *scale*;
  a tensor of ``n`` elements has ``ceil(n / block)`` blocks, the last one partial when
  ``block`` does not divide ``n``.
* *padding*: a partial last block is quantized as if it were padded with zeros to a whole
  block. Zeros change no absmax and encode as code 0, so the padding is never stored or
  sent: the *payload* has exactly ``n`` bytes, one code per element, and the scales
  ``ceil(n / block)`` fp32 values. Callers pass any length and need no padding rule.
* *payload*: the codes as ``uint8`` (gloo refuses int8-as-float8 tensors, and one byte type
  lets payload and scales share one buffer). int8 codes are the int8 values viewed as
  uint8; fp8 codes are the float8 bit patterns (``.view(torch.uint8)``).

The formats
-----------
``int8``: ``scale = absmax / 127`` per block; code ``q = round_half_even(x / scale)`` in
``[-127, 127]`` (symmetric: -128 is never used); ``deq = q * scale``.

``fp8_e4m3`` (``torch.float8_e4m3fn``, largest 448, no inf) and ``fp8_e5m2`` (largest
57344): ``scale = absmax / fmax``; code ``float8(x / scale)`` (round to nearest even,
clamped to ``[-fmax, fmax]`` first); ``deq = float32(code) * scale``.

Every division, product and cast above is one IEEE float32 operation (correctly
rounded), elementwise, so the results are the same bits on every CPU kernel family and
every rank. Two guards keep finite inputs finite, and keep the bound below true:

* a nonzero block's scale is at least ``2**-126`` (the smallest normal float32): a block
  whose absmax is below ``127 * 2**-126`` (about ``1.5e-36``; ``fmax * 2**-126`` for fp8)
  is quantized on that coarser grid rather than on a subnormal scale, whose rounding is
  absolute rather than relative (a subnormal ``absmax / 127`` can round to zero, or far
  enough down that ``absmax / scale`` leaves the code range);
* where ``fmax * scale`` would overflow to inf (absmax within a rounding of
  ``FLT_MAX``), the scale steps down by one ulp, so every ``deq`` is finite.

A zero block (absmax 0) has scale 0 and all codes 0; it dequantizes to zeros.

Non-finite input stays non-finite: a block holding inf or NaN gets that absmax (inf or
NaN) as its scale, so all of its elements dequantize to inf or NaN, and the step's overflow
check after the exchange skips the step on every rank. From finite input, quantize never
produces NaN or inf.

The bound (``error_bound``)
---------------------------
Let ``s`` be a block's stored scale, ``u = 2**-24`` (float32's unit roundoff) and ``x``
finite. With the guards above ``s`` is zero or normal, and ``|x / s| <= fmax(1 + 4u)``.

int8: ``t = fl(x / s)`` has ``|t - x/s| <= u|x/s|`` (or ``|x/s| < 2**-126`` and then
``q = 0``, error ``|x| < s/2``); ``|t - q| <= 1/2`` (round to nearest; ``t`` never exceeds
127.5, so the clamp does nothing); ``q * s`` is normal (``|q| >= 1``, ``s >= 2**-126``), so
``|fl(q s) - q s| <= u |q s| <= u (|x| + s/2 + u|x|)``. Adding up::

    |x - deq| <= (s / 2)(1 + u) + (2u + u**2) |x|.

fp8 with ``m`` mantissa bits (e4m3: 3, e5m2: 2), ``u8 = 2**-(m + 1)`` and ``eta`` half the
format's subnormal spacing (e4m3: ``2**-10``, e5m2: ``2**-17``): ``y = fl(x / s)`` has
``|x - s y| <= u|x|``; the cast has ``|z - y| <= max(u8 |y|, eta)`` (the clamp moves ``y``
by at most ``4u fmax``, well inside ``u8|y|``); ``fl(z s)`` adds ``u|z s|``, or at most
``2**-150`` where ``z s`` is a float32 subnormal. Adding up (``u8 u`` terms folded into
``u``)::

    |x - deq| <= (u8 + 3u) |x| + (1 + u) s eta + 2**-150.

``error_bound`` returns, in float64, slightly larger numbers than these (``s (1/2 +
2**-24) + 2**-22 |x|`` and ``(u8 + 2**-21)|x| + (1 + 2**-20) s eta + 2**-149``), so that its
own float64 roundings cannot push it below them.

The residual is exact: ``c - deq(q(c))`` computed in float32 is the exact difference
(``deq`` is 0, or within a factor 2 of ``c`` with ``c``'s sign: Sterbenz), which is what
makes error feedback telescope (:mod:`zerofn._wire._bucket`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["KINDS", "WireFormat", "dequantize", "error_bound", "quantize"]

Kind = Literal["int8", "fp8_e4m3", "fp8_e5m2"]

# kind -> (torch dtype of the codes, largest code magnitude, half the subnormal spacing
# of the codes (0: integers, no subnormals), unit roundoff of the codes (0: int8 rounds
# to integers, accounted for as s/2)).
_FORMATS: dict[str, tuple[torch.dtype, float, float, float]] = {
    "int8": (torch.int8, 127.0, 0.0, 0.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 2.0**-10, 2.0**-4),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2.0**-17, 2.0**-3),
}
KINDS: tuple[str, ...] = tuple(_FORMATS)

_MIN_SCALE = 2.0**-126  # smallest normal float32: scales are 0 or normal (module docstring)
_SCALE_BYTES = 4  # one float32 per block


@dataclass(frozen=True)
class WireFormat:
    """A compressed wire: codes of one byte per element plus one fp32 scale per block.

    Attributes:
      kind: ``"int8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
      block: elements per scale, a positive int (256 gives ``1 + 4/256`` bytes per element).

    Raises:
      ValueError: naming the bad kind or block.
    """

    kind: Kind = "int8"
    block: int = 256

    def __post_init__(self) -> None:
        if self.kind not in _FORMATS:
            raise ValueError(f"WireFormat.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        # bool is an int subclass, and True would quietly mean blocks of one element.
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"WireFormat.block must be a positive int (elements per scale), got {self.block!r}")

    @property
    def fmax(self) -> float:
        """The largest code magnitude: 127 (int8), 448 (e4m3), 57344 (e5m2)."""
        return _FORMATS[self.kind][1]

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype the uint8 payload is a view of: int8, float8_e4m3fn or float8_e5m2."""
        return _FORMATS[self.kind][0]

    def num_blocks(self, n: int) -> int:
        """Scales for ``n`` elements: ``ceil(n / block)``."""
        return -(-n // self.block)

    def nbytes(self, n: int) -> int:
        """Bytes of the payload and scales of ``n`` elements: ``n + 4 * ceil(n / block)``."""
        return n + _SCALE_BYTES * self.num_blocks(n)


def _blocks(x: torch.Tensor, fmt: WireFormat) -> torch.Tensor:
    """``(..., n)`` -> ``(..., nb, block)``, zero padded past ``n`` (a new tensor only when padding)."""
    n = x.shape[-1]
    nb = fmt.num_blocks(n)
    pad = nb * fmt.block - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, fmt.block)


def _scales(blocks: torch.Tensor, fmt: WireFormat) -> torch.Tensor:
    """Each block's scale ``absmax / fmax``, with the two guards of the module docstring. ``(..., nb)`` float32."""
    absmax = blocks.abs().amax(dim=-1)
    scale = (absmax / fmt.fmax).clamp_min(_MIN_SCALE)
    # fl(fmax * s) = inf only for an absmax within a rounding of FLT_MAX: one ulp down
    # keeps every deq finite and |x / s| <= fmax (1 + 4u), so the bound still holds.
    scale = torch.where(torch.isinf(scale * fmt.fmax), torch.nextafter(scale, torch.zeros_like(scale)), scale)
    scale = torch.where(absmax == 0, torch.zeros_like(scale), scale)
    # A block holding inf or NaN keeps that absmax as its scale, so every dequantized element
    # of it is inf or NaN and the overflow check after the exchange sees it (int8 has no inf).
    return torch.where(torch.isfinite(absmax), scale, absmax)


def _check_input(x: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32:
        raise ValueError(f"{what} takes float32 (the gradient's wire input), got {x.dtype}")


def quantize_rows(x: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of each row of a ``(R, n)`` float32 tensor: ``(R, n)`` uint8, ``(R, nb)`` float32.

    Blocks never straddle rows: each row is blocked (and padded) on its own.
    """
    _check_input(x, "quantize")
    n = x.shape[-1]
    blocks = _blocks(x, fmt)
    scale = _scales(blocks, fmt)
    # A zero block divides by 1 instead of 0: its elements are all zero, so its codes are 0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    scaled = blocks / divisor
    if fmt.kind == "int8":
        codes = torch.round(scaled).clamp_(-fmt.fmax, fmt.fmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-fmt.fmax, fmt.fmax).to(fmt.code_dtype)
    payload = codes.view(torch.uint8).reshape(*x.shape[:-1], -1)[..., :n]
    return payload.contiguous(), scale


def dequantize_rows(payload: torch.Tensor, scales: torch.Tensor, fmt: WireFormat) -> torch.Tensor:
    """:func:`dequantize` of each row: ``(R, n)`` uint8 codes and ``(R, nb)`` float32 scales -> ``(R, n)`` float32."""
    n = payload.shape[-1]
    if payload.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError(f"dequantize takes uint8 codes and float32 scales, got {payload.dtype} and {scales.dtype}")
    if scales.shape[-1] != fmt.num_blocks(n) or payload.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"dequantize: {tuple(payload.shape)} codes need {(*payload.shape[:-1], fmt.num_blocks(n))} scales "
            f"at block {fmt.block}, got {tuple(scales.shape)}"
        )
    codes = _blocks(payload.contiguous(), fmt).view(fmt.code_dtype)  # padding bytes are code 0
    values = codes.to(torch.float32) * scales.unsqueeze(-1)
    return values.reshape(*payload.shape[:-1], -1)[..., :n].contiguous()


def quantize(x: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float32 tensor in blocks of ``fmt.block`` elements.

    Args:
      x: ``(n,)`` float32, finite (callers detect overflow before quantizing), any ``n``:
        a partial last block is treated as zero padded (the module docstring), and the
        padding is not stored.
      fmt: the wire format.

    Returns:
      ``(payload, scales)``: ``(n,)`` uint8 codes (int8 values, or float8 bit patterns,
      viewed as bytes) and ``(ceil(n / block),)`` float32 scales. New tensors.

    The rule: ``scale = absmax / fmax`` per block (0 for a zero block, at least ``2**-126``
    otherwise); int8 codes ``round_half_even(x / scale)``, fp8 codes ``float8(x / scale)``.
    No collectives.
    """
    if x.dim() != 1:
        raise ValueError(f"quantize takes a 1-D tensor, got shape {tuple(x.shape)}")
    payload, scales = quantize_rows(x.unsqueeze(0), fmt)
    return payload[0], scales[0]


def dequantize(payload: torch.Tensor, scales: torch.Tensor, fmt: WireFormat) -> torch.Tensor:
    """The float32 values of :func:`quantize`'s ``(payload, scales)``: ``code * scale``, ``(n,)`` float32.

    Args:
      payload: ``(n,)`` uint8 codes.
      scales: ``(ceil(n / block),)`` float32 scales.
      fmt: the wire format they were quantized with.

    No collectives; a new tensor.
    """
    if payload.dim() != 1 or scales.dim() != 1:
        raise ValueError(f"dequantize takes 1-D codes and scales, got {tuple(payload.shape)} and {tuple(scales.shape)}")
    return dequantize_rows(payload.unsqueeze(0), scales.unsqueeze(0), fmt)[0]


def error_bound(x: torch.Tensor, fmt: WireFormat) -> torch.Tensor:
    """The proven bound on ``|x - dequantize(*quantize(x, fmt), fmt)|``, per element.

    Args:
      x: ``(n,)`` finite float32.
      fmt: the wire format.

    Returns:
      ``(n,)`` float64 (so that the bound itself is not rounded below the truth), from
      each element's magnitude and its block's scale, as derived in the module docstring:

      * int8: ``s (1/2 + 2**-24) + 2**-22 |x|``;
      * fp8: ``(u8 + 2**-21) |x| + (1 + 2**-20) s eta + 2**-149``, with ``u8 = 2**-4``
        and ``eta = 2**-10`` (e4m3), ``u8 = 2**-3`` and ``eta = 2**-17`` (e5m2).

    No collectives.
    """
    _check_input(x, "error_bound")
    if x.dim() != 1:
        raise ValueError(f"error_bound takes a 1-D tensor, got shape {tuple(x.shape)}")
    n = x.shape[0]
    scale = _scales(_blocks(x.unsqueeze(0), fmt), fmt)[0].double()
    s = scale.repeat_interleave(fmt.block)[:n]
    mag = x.double().abs()
    _, _, eta, u8 = _FORMATS[fmt.kind]
    if fmt.kind == "int8":
        return s * (0.5 + 2.0**-24) + mag * 2.0**-22
    return mag * (u8 + 2.0**-21) + s * (eta * (1 + 2.0**-20)) + math.ldexp(1.0, -149)
