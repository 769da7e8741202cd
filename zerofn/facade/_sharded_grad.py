"""The stage-2 ``p.grad`` placeholder: a param's metadata and no values, and the errors it raises.

At ZeRO stage 2 each rank keeps only its shard of a param's averaged gradient, so after
backward ``p.grad`` holds a :class:`ShardedGrad`: torch accepts it as a gradient and can
read its shape, dtype and device, and every other torch function on it raises
:class:`ShardedGradError` saying what to write instead (``opt.clip_grad_norm_`` for
``clip_grad_norm_``, the facade's loss scaling for ``GradScaler.unscale_``), instead of
silently seeing no gradient. :mod:`zerofn.facade._reducer` places and clears them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["GRAD_SCALER_MESSAGE", "SHARDED_GRAD_MESSAGE", "ShardedGrad", "ShardedGradError", "sharded_grad"]

SHARDED_GRAD_MESSAGE = (
    "zerofn: {what} on the p.grad of a param trained by ZeroOptimizer(partition_grad=True). At ZeRO "
    "stage 2 each rank keeps only its shard of the averaged gradient, so p.grad holds no values. "
    "Between backward and step, write instead: opt.clip_grad_norm_(max_norm) for "
    "torch.nn.utils.clip_grad_norm_ (or clip_grad_norm=max_norm when building the optimizer), "
    "opt.get_grad_norm() for the global gradient norm, opt.get_param_grad(p) to read one full "
    "gradient (a collective), opt.zero_grad() to drop the gradients. Or use partition_grad=False "
    "(stage 1), where p.grad holds the averaged gradient as with DDP."
)
GRAD_SCALER_MESSAGE = (
    "zerofn: torch.amp.GradScaler cannot unscale the gradients of ZeroOptimizer(partition_grad=True): at "
    "ZeRO stage 2 each rank keeps only its shard of the averaged gradient, so p.grad holds no values. "
    "Use the facade's own loss scaling instead: float16 params (or forced_dtype=torch.float16, or "
    "precision=zerofn.PrecisionPolicy.for_dtype(torch.float16)) train with a dynamic loss scaler, and "
    "opt.backward(loss) scales the loss; then call opt.step() without the scaler, and "
    "opt.clip_grad_norm_(max_norm) to clip the unscaled gradients. Nothing was changed."
)

# What may be read of a placeholder without touching gradient values: what torch's own
# helpers look at before they compute (GradScaler groups by device and dtype, Module's
# zero_grad reads grad_fn), so that they reach the computation and raise the error above.
_METADATA = frozenset(
    {
        torch.Tensor.dtype.__get__,
        torch.Tensor.device.__get__,
        torch.Tensor.shape.__get__,
        torch.Tensor.ndim.__get__,
        torch.Tensor.layout.__get__,
        torch.Tensor.is_sparse.__get__,
        torch.Tensor.requires_grad.__get__,
        torch.Tensor.grad_fn.__get__,
        torch.Tensor.is_leaf.__get__,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
    }
)
_AMP_UNSCALE = frozenset({torch._amp_foreach_non_finite_check_and_unscale_})


class ShardedGradError(RuntimeError):
    """A torch function read or wrote a stage-2 ``p.grad``, which holds no values (see the message)."""


class ShardedGrad(torch.Tensor):
    """What ``p.grad`` holds after backward at ZeRO stage 2: no values, only the param's metadata.

    A 0-stride expansion of one zero element (no memory per param) with the param's shape,
    dtype and device, so torch accepts it as a gradient. Its shape, dtype and device can be
    read; every other torch function on it raises :class:`ShardedGradError` with what to
    write instead, so ``clip_grad_norm_`` & co. fail loudly instead of clipping nothing.
    The facade clears it before autograd could accumulate into it. One is made per param
    and reused every step: one element of storage per param, and one loop over the params
    per step to place, clear and check them.
    """

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func in _AMP_UNSCALE:
            raise ShardedGradError(GRAD_SCALER_MESSAGE)
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise ShardedGradError(SHARDED_GRAD_MESSAGE.format(what=f"{name}() was called"))


def sharded_grad(param: torch.Tensor) -> ShardedGrad:
    """A :class:`ShardedGrad` for ``param``: its shape, dtype and device, one element of memory."""
    zero = torch.zeros((), dtype=param.dtype, device=param.device)
    return zero.expand(param.shape).as_subclass(ShardedGrad)  # type: ignore[return-value]
