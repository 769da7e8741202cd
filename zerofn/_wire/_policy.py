"""``CompressedWire``: the choice of a compressed gradient wire, as a frozen value.

Chosen like ``comm_dtype``: in the :class:`~zerofn.precision.PrecisionPolicy` (``wire=``),
which ``shard_params``, ``reduce_grads``, ``value_and_reduced_grads`` and the facade read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from zerofn._wire._quant import KINDS, WireFormat

__all__ = ["CompressedWire"]


@dataclass(frozen=True)
class CompressedWire:
    """Gradients reduced as block-scaled one-byte codes, with error feedback.

    Each bucket's chunks for the other ranks are quantized (:mod:`zerofn._wire._quant`),
    exchanged with one ``all_to_all_single`` of bytes, dequantized and summed in float32
    in rank order by the rank that owns the shard: nothing is summed in the compressed
    type. This rank's own chunk never leaves it and is added unquantized.

    Attributes:
      kind: ``"int8"`` (a scale per block, codes in [-127, 127]), ``"fp8_e4m3"`` (largest
        448, no inf) or ``"fp8_e5m2"``; codes cross the wire as ``uint8``.
      block: elements per fp32 scale (256: ``1 + 4/256`` bytes per element).
      min_numel: params with fewer elements travel uncompressed (float32), as do 1-D
        params (biases, norms) unless ``compress_vectors``: they are a small share of the
        bytes and the most sensitive to a relative error.
      compress_vectors: compress 1-D params of ``min_numel`` elements or more too.
      error_feedback: keep what quantization lost (the residual, in the state) and add it
        to the same chunk at the next reduction, so that nothing is lost, only delayed.

    Raises:
      ValueError: a kind, block or threshold that cannot work, naming it.
    """

    kind: str = "int8"
    block: int = 256
    min_numel: int = 4096
    compress_vectors: bool = False
    error_feedback: bool = True

    def __post_init__(self) -> None:
        WireFormat(self.kind, self.block)  # type: ignore[arg-type]  # validates kind and block
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(
                f"CompressedWire.min_numel must be a non-negative int (params with fewer elements travel "
                f"uncompressed), got {self.min_numel!r}"
            )
        for name in ("compress_vectors", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CompressedWire.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def format(self) -> WireFormat:
        """The codes' format: kind and block."""
        return WireFormat(self.kind, self.block)  # type: ignore[arg-type]

    def compresses(self, shape: tuple[int, ...], numel: int) -> bool:
        """Whether a split param of ``shape`` (``numel`` elements) travels compressed."""
        return numel >= self.min_numel and (len(shape) >= 2 or self.compress_vectors)

    @property
    def code(self) -> int:
        """A non-negative int64 digest of the settings, equal on every rank that chose the same wire."""
        text = f"{KINDS.index(self.kind)}:{self.block}:{self.min_numel}:{self.compress_vectors}:{self.error_feedback}"
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
