"""A compressed gradient wire (private): block-scaled int8 / fp8 codes with error feedback.

* :mod:`zerofn._wire._quant`: the formats (:class:`WireFormat`), :func:`quantize`,
  :func:`dequantize` and the proven per-element :func:`error_bound`; pure, no collectives.
* :mod:`zerofn._wire._exchange`: :func:`compressed_reduce_scatter`, the mean of every
  rank's gradient for this rank's shard, sent compressed with error feedback, and
  :func:`bytes_sent`, what it costs on the wire.

Not public yet: nothing in ``zerofn``'s surface imports it.
"""

from zerofn._wire._exchange import bytes_sent, compressed_reduce_scatter
from zerofn._wire._quant import KINDS, WireFormat, dequantize, error_bound, quantize

__all__ = [
    "KINDS",
    "WireFormat",
    "bytes_sent",
    "compressed_reduce_scatter",
    "dequantize",
    "error_bound",
    "quantize",
]
