"""An exact DDP twin at any world size: a comm hook that reduces on a float64 wire.

A parity test of zerofn against ``DistributedDataParallel`` is bitwise at 1 and 2 ranks
on the default fp32 wire: there is no sum at 1 rank, and a sum of two addends has one
order. From 3 ranks on gloo adds an element's addends in an order that depends on the
element's offset in the flat buffer, DDP's buckets and zerofn's rank-major rows put it at
different offsets, and fp32 addition is not associative: the two runs differ in last
bits, which AdamW with a small ``eps`` or Muon's bf16 Newton-Schulz may amplify into an
lr-sized step.

A float64 wire on both sides removes the order. Each rank scales its gradient by the same
0-d factor ``1/N`` in the gradients' compute dtype (what zerofn's bucket packing does, so
both sides round that product alike), the products travel as float64, gloo sums ``N`` of
them, and the sum is rounded back to the gradients' dtype once. Every addend is an fp32
(or bf16, fp16) number, exact in float64, and a sum of ``N`` such numbers whose exponents
lie within ``2**(29 - ceil(log2 N))`` of each other is exact in float64 in any order
(``24 + 27 + 2`` bits fit in 53 at N <= 4). Where they do not (an addend below about 1e-8
of the largest, which then hardly moves the sum) the float64 sums may differ by one
float64 ulp, and the rounded results only if the exact sum lies within it of a rounding
boundary of the gradients' dtype: a chance of about ``2**-29`` per such element.

So ``zerofn`` with ``comm_dtype=torch.float64`` (functional) or
``communication_dtype=torch.float64`` (facade), against DDP with::

    ddp.register_comm_hook(group, zerofn.testing.float64_wire_hook)

gives the same bits at every world size, and any difference is a logic error.
"""

import torch
import torch.distributed as dist

__all__ = ["float64_wire_hook"]


# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the
# hook's annotations with the objects themselves (``bucket`` must be ``dist.GradBucket``).
def float64_wire_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook with zerofn's arithmetic on a float64 wire (the module docstring).

    Args:
      group: the hook's state: the process group DDP reduces over (``None``: the default
        group), the one passed to ``register_comm_hook(group, float64_wire_hook)``.
      bucket: DDP's bucket; its flat buffer (any float dtype) is read, not written.

    Returns:
      A future of the mean gradient, the buffer's dtype and shape.

    Collectives: one ``all_reduce`` (SUM) of the bucket in float64, ``8 * numel`` bytes.
    """
    buffer = bucket.buffer()
    compute = torch.promote_types(buffer.dtype, torch.float32)  # mul_'s compute dtype for a Python scalar
    factor = torch.tensor(1.0 / dist.get_world_size(group), dtype=compute, device=buffer.device)
    wire = (buffer * factor).to(torch.float64)
    work = dist.all_reduce(wire, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to(buffer.dtype))
