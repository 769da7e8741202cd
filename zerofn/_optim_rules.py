"""The update rules of SGD and Adam/AdamW on lists of tensors, in place: one code, eager and compiled.

Each rule takes equal-length lists of tensors (one per run of a flat buffer, or one per
param) that the caller owns, and updates them in place. With torch's default kernel
choice (``foreach`` and ``fused`` unset, the CPU default) the arithmetic is written out
here in torch's single-tensor order, with the learning rate and Adam's step count as 0-d
float64 tensors: eagerly and inside a ``torch.compile`` graph the same operations run, a
changing ``lr`` tensor or step count never recompiles, and the bits are
``torch.optim``'s (``tests/test_optim_rules.py`` checks them against torch for every
option and dtype). Where torch's single-tensor kernel takes a Python number (``lr``,
``1 - lr * wd``, the bias corrections), the tensor here is cast to the dtype torch's
CPU kernels compute in (float32 for bfloat16 and float16 tensors, else the tensor's
own): the scalar torch's kernel reads. ``addcdiv_(value=-step_size)`` is its three
operations in that dtype, which is how the kernel computes it.

``foreach=True`` or ``fused=True`` call torch's functional kernels (``torch.optim.sgd.sgd``,
``torch.optim.adam.adam``) eagerly, the bits ``torch.optim`` makes with that choice.
Adam's ``fused=True`` goes through :func:`zerofn._fused_adam.fused_adam_`, one opaque op
that a compiled step calls too (the same kernel, the same bits); a compiled step refuses
``foreach=True`` and SGD's ``fused=True`` with :data:`NOT_TRACEABLE` (a graph break, which
``fullgraph=True`` turns into that error). Eagerly, bfloat16/float16 tensors and tensors
off the CPU take torch's kernel too (:func:`_torch_kernel` says why).

No collectives here; no containers: the callers (:mod:`zerofn._optim_update`) decide the lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.optim.adam as _torch_adam
import torch.optim.sgd as _torch_sgd

from zerofn._fused_adam import fused_adam_

__all__ = ["NOT_TRACEABLE", "adam_", "one_tensor_at_a_time", "sgd_"]

NOT_TRACEABLE = (
    "zerofn.optim.{name}: torch's {option}=True kernel cannot be traced, so the graph breaks here. Build the "
    "optimizer with {fix} to compile the step into one graph"
)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's CPU kernels compute a tensor of ``dtype`` in (and read a scalar as)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _lr64(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The learning rate as a 0-d float64 tensor (a Python float is exact in float64)."""
    if isinstance(lr, torch.Tensor):
        return lr.detach().to(device, torch.float64)
    return torch.tensor(float(lr), dtype=torch.float64, device=device)


_REDUCED = (torch.bfloat16, torch.float16)


def _torch_kernel(hp: Mapping[str, Any], params: Sequence[torch.Tensor], name: str, kernel: str) -> bool:
    """True where torch's own functional kernel runs instead of the written-out rule.

    ``foreach`` or ``fused``: torch's kernel eagerly; compiled, a graph break that says so.
    Eagerly also for tensors off the CPU (torch's default there is its foreach kernel) and
    for bfloat16/float16 tensors: torch computes those in float32 with last bits that
    depend on where an element falls in a vectorized loop, which no written-out form
    matches on every layout. Compiled, everything else is the written-out rule.
    """
    if hp["foreach"] or hp["fused"]:
        adam = kernel == "Adam"  # Adam's fused kernel compiles (zerofn._fused_adam); SGD's does not
        if torch.compiler.is_compiling() and (hp["foreach"] or not adam):
            option = "foreach" if hp["foreach"] else "fused"
            fix = "fused=True or foreach=None" if adam else "foreach=None and fused=None (the CPU default)"
            torch._dynamo.graph_break(msg=NOT_TRACEABLE.format(name=name, option=option, fix=fix))
        return True
    if torch.compiler.is_compiling():
        return False
    return any(p.dtype in _REDUCED or p.device.type != "cpu" for p in params)


def one_tensor_at_a_time(dtype: torch.dtype, hp: Mapping[str, Any]) -> bool:
    """Whether tensors of ``dtype`` must be stepped one param (or shard) at a time, not in runs.

    bfloat16 and float16 do wherever torch's kernels run (eagerly, and under ``fused``
    compiled too): they round such an element by where it falls in their vectorized loop
    (body or tail), so a shard stepped inside a longer run would not get the bits
    torch.optim gives it when it steps the param alone.
    """
    return dtype in _REDUCED and (bool(hp["fused"]) or not torch.compiler.is_compiling())


def _number(lr: float | torch.Tensor) -> float:
    """A tensor lr read as the Python float torch's kernels take (bitwise what that float gives)."""
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def sgd_(
    hp: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    bufs: list[torch.Tensor | None],
) -> None:
    """``torch.optim.SGD``'s step over the lists, in place; ``bufs[i]`` is ``None`` until a
    momentum buffer exists (then set to a new one, ``grad``'s copy, as torch does).

    ``hp``: one param group's hyperparameters (``lr`` a number or a 0-d tensor).
    ``grads`` are read, never written.
    """
    if _torch_kernel(hp, params, "sgd", "SGD"):
        # torch's foreach nesterov adds the momentum into the gradient list in place when
        # neither weight decay nor maximize made a copy first: hand it copies then.
        copies = hp["nesterov"] and hp["weight_decay"] == 0 and not hp["maximize"]
        _torch_sgd.sgd(
            list(params),
            [g.clone() for g in grads] if copies else list(grads),
            bufs,
            weight_decay=hp["weight_decay"],
            momentum=hp["momentum"],
            lr=_number(hp["lr"]),
            dampening=hp["dampening"],
            nesterov=hp["nesterov"],
            maximize=hp["maximize"],
            foreach=hp["foreach"],
            fused=hp["fused"],
        )
        return
    momentum, dampening, wd = hp["momentum"], hp["dampening"], hp["weight_decay"]
    lr64: torch.Tensor | None = None
    for i, param in enumerate(params):
        grad = -grads[i] if hp["maximize"] else grads[i]
        if wd != 0:
            grad = grad.add(param, alpha=wd)
        if momentum != 0:
            buf = bufs[i]
            if buf is None:
                buf = bufs[i] = grad.detach().clone()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if hp["nesterov"] else buf
        if lr64 is None:
            lr64 = _lr64(hp["lr"], param.device)
        # param.add_(grad, alpha=-lr) with a tensor lr: the same fused multiply-add.
        param.addcmul_(grad, (-lr64).to(_opmath(param.dtype)))


def adam_(
    decoupled: bool,
    hp: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    skip: torch.Tensor | None = None,
) -> None:
    r"""``torch.optim.Adam`` (``decoupled=False``) or ``AdamW``'s step over the lists, in place.

    ``steps``: 0-d float32 step counts, one per entry, each incremented once (an entry's
    count is its own tensor, or one the caller shares among entries it updates together
    only when it passes it once). ``max_exp_avg_sqs`` is empty without ``amsgrad``.
    ``skip``: ``None``, or (``fused=True`` only) a 0-d bool tensor whose truth leaves every
    list as it was: torch's fused kernel reads it as its ``found_inf``.

    .. math::
        \theta \leftarrow \theta - \frac{(-\text{step\_size}) \cdot m}
        {\sqrt{v} / \sqrt{1-\beta_2^t} + \epsilon},\qquad
        \text{step\_size} = \frac{\eta}{1 - \beta_1^t}
    """
    if hp["fused"]:
        fused_adam_(decoupled, hp, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, skip)
        return
    assert skip is None, "zerofn: only the fused kernel takes a skip (Optimizer.update selects for the others)"
    if _torch_kernel(hp, params, "adamw" if decoupled else "adam", "Adam"):
        _torch_adam.adam(
            list(params),
            list(grads),
            list(exp_avgs),
            list(exp_avg_sqs),
            list(max_exp_avg_sqs),
            list(steps),
            foreach=hp["foreach"],
            fused=hp["fused"],
            decoupled_weight_decay=decoupled,
            amsgrad=hp["amsgrad"],
            beta1=hp["betas"][0],
            beta2=hp["betas"][1],
            lr=_number(hp["lr"]),
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            maximize=hp["maximize"],
        )
        return
    beta1, beta2, eps, wd = hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"]
    amsgrad = hp["amsgrad"]
    for i, param in enumerate(params):
        op = _opmath(param.dtype)
        lr64 = _lr64(hp["lr"], param.device)
        grad = -grads[i] if hp["maximize"] else grads[i]
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], steps[i]
        step_t += 1
        if wd != 0:
            if decoupled:
                param.mul_((1 - lr64 * wd).to(op))
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg.lerp_(grad, 1 - beta1)
        # (out=, not addcmul_: a compiled graph decomposes the in-place form into other roundings)
        torch.addcmul(exp_avg_sq.mul_(beta2), grad, grad, value=1 - beta2, out=exp_avg_sq)
        # torch reads the count with .item() and computes these in Python (float64): the
        # same IEEE operations on 0-d float64 tensors.
        step = step_t.to(lr64.device, torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
        step_size = lr64 / bias_correction1
        if amsgrad:
            max_sq = max_exp_avg_sqs[i]
            max_sq.copy_(torch.maximum(max_sq, exp_avg_sq))
            denom = (max_sq.sqrt() / bias_correction2_sqrt.to(op)).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt.to(op)).add_(eps)
        # addcdiv_(exp_avg, denom, value=-step_size): value * exp_avg / denom, in `op`.
        param.add_(exp_avg.to(op) * (-step_size).to(op) / denom.to(op))
