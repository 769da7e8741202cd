"""torch's fused Adam/AdamW kernel as one opaque op, the same call eagerly and in a compiled graph.

``torch.optim.AdamW(fused=True)`` steps through ``torch._fused_adamw_``; on the CPU that
kernel has no fake implementation for a tensor learning rate, so ``torch.compile`` cannot
trace it. :func:`fused_adam_` wraps torch's own driver of the kernel
(``torch.optim.adam._fused_adam``: step counts incremented, the kernel, counts restored
on a skip) in the custom op ``zerofn::fused_adam_``, which a graph calls as one node and
runs as it runs eagerly. So a compiled step with ``fused=True`` computes the bits of the
eager step and of ``torch.optim.AdamW(fused=True)``, with no generated Adam kernel to
compile.

The learning rate enters as a 0-d tensor (a schedule changes it without a recompile) and
is read as the Python float torch's kernel takes (bitwise what that float gives). ``skip``
is torch's ``found_inf``: where it is true the kernel writes nothing and the counts are
put back, which is how a compiled step drops an overflowing step without a host read and
without a select over every buffer. No collectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.optim.adam as _torch_adam

__all__ = ["fused_adam_"]


def fused_adam_(
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
    """``torch.optim.Adam`` (``decoupled=False``) or ``AdamW``'s fused step over the lists, in place.

    ``hp``: one param group's hyperparameters (``lr`` a number or a 0-d tensor).
    ``steps``: 0-d float32 counts, each incremented once (put back where ``skip``).
    ``skip``: ``None``, or a 0-d bool tensor: true leaves every list as it was.
    """
    lr = hp["lr"]
    lr = (
        lr.detach().to("cpu", torch.float64)
        if isinstance(lr, torch.Tensor)
        else torch.tensor(float(lr), dtype=torch.float64)
    )
    args = (
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs),
        list(steps),
        lr,  # a graph input under compile, not a constant baked into the graph
        None if skip is None else skip.to(torch.float32),
        decoupled,
        bool(hp["amsgrad"]),
        float(hp["betas"][0]),
        float(hp["betas"][1]),
        float(hp["weight_decay"]),
        float(hp["eps"]),
        bool(hp["maximize"]),
    )
    # Eagerly the op's own body: the dispatcher's bookkeeping is for graphs.
    (_fused_adam_op if torch.compiler.is_compiling() else _run)(*args)


def _run(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: torch.Tensor,
    found_inf: torch.Tensor | None,
    decoupled: bool,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    if not params:
        return
    _torch_adam._fused_adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        None,
        found_inf,
        amsgrad=amsgrad,
        has_complex=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr.item(),  # a CPU tensor read on the host (no device sync): the float torch.optim passes
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        capturable=False,
        differentiable=False,
        decoupled_weight_decay=decoupled,
    )


_fused_adam_op = torch.library.custom_op(
    "zerofn::fused_adam_", _run, mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps")
)


@_fused_adam_op.register_fake
def _(*args: object) -> None:  # writes its inputs in place: no outputs to describe
    del args
