"""Where tensors live: the copies between the compute device and the state device.

With CPU offload (``PrecisionPolicy(state_device="cpu")``) the master shards and the
optimizer state live on the CPU while the model computes on an accelerator: each step the
gradient shards travel to the state device before the update, and the updated shards
travel back for the gather. This module is the only place those copies are made.

Between a CUDA device and the CPU the copies go through pinned (page-locked) host buffers
with ``non_blocking=True``: every copy of a batch is launched before the host waits, once,
for the batch (device to host), or the host does not wait at all and the stream orders the
copy before the collective that reads it (host to device; torch's caching host allocator
keeps a pinned buffer alive until its copy has finished). Between equal devices nothing is
copied. On a CPU-only machine both devices are the CPU, so offload runs this same code and
every function returns its input: placement is a policy field, not a separate code path.

No collectives here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["cat_to", "copy_kind", "to_device"]


def copy_kind(src: torch.device, dst: torch.device) -> str:
    """How a tensor on ``src`` reaches ``dst``.

    Returns:
      ``"none"`` (same device: no copy), ``"to_host_pinned"`` (CUDA to CPU: into a pinned
      buffer, non-blocking, then one synchronisation per batch), ``"from_host_pinned"``
      (CPU to CUDA: from a pinned buffer, non-blocking) or ``"plain"`` (anything else: a
      blocking ``.to``).

    Examples:
      >>> copy_kind(torch.device("cuda", 0), torch.device("cpu"))
      'to_host_pinned'
      >>> copy_kind(torch.device("cpu"), torch.device("cpu"))
      'none'
    """
    src, dst = torch.device(src), torch.device(dst)
    if src == dst:
        return "none"
    if src.type == "cuda" and dst.type == "cpu":
        return "to_host_pinned"
    if src.type == "cpu" and dst.type == "cuda":
        return "from_host_pinned"
    return "plain"


def to_device(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` on ``device``: the same objects where they already are, new copies elsewhere.

    Device-to-host copies are all launched before the host waits once per source device,
    so the result can be read by host code (a CPU optimizer step) as soon as this returns.
    The inputs are not changed.
    """
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    waits: set[torch.device] = set()
    for name, t in tensors.items():
        kind = copy_kind(t.device, device)
        if kind == "none":
            out[name] = t
        elif kind == "to_host_pinned":
            buf = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            waits.add(t.device)
            out[name] = buf
        elif kind == "from_host_pinned":
            src = t if t.is_pinned() else t.pin_memory()
            out[name] = src.to(device, non_blocking=True)
        else:
            out[name] = t.to(device)
    for d in waits:
        torch.cuda.current_stream(d).synchronize()  # the host reads these buffers next
    return out


def cat_to(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 1-D concatenation of ``parts`` (all on one device) as a new tensor on ``device``.

    From the CPU to CUDA the concatenation is written straight into a pinned buffer and
    sent from there without blocking the host.
    """
    kind = copy_kind(parts[0].device, device)
    if kind == "from_host_pinned":
        buf = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype, pin_memory=True)
        torch.cat(parts, out=buf)
        return buf.to(device, non_blocking=True)
    row = torch.cat(parts)
    return row if kind == "none" else row.to(device)
