"""The compressed gradient wire (private; its public face is :class:`zerofn.CompressedWire`).

* :mod:`zerofn._wire._quant`: the block-scaled formats (:class:`WireFormat`), quantize and
  dequantize, and the proven per-element :func:`error_bound`; pure, no collectives.
* :mod:`zerofn._wire._policy`: :class:`CompressedWire`, the user's choice of format, block,
  threshold and error feedback.
* :mod:`zerofn._wire._bucket`: which columns of a bucket travel compressed, the residual's
  shapes, and one bucket's compressed reduction (one ``all_to_all_single``).
* :mod:`zerofn._wire._checks`: what the wire refuses, checked before any bucket is sent.
"""
