"""The written-out update rules are torch.optim's bits, option by option (no processes).

``zerofn._optim_rules`` writes torch's single-tensor SGD and Adam/AdamW out with the lr
and step count as tensors, so that one code runs eagerly and compiled. These tests hold
it to ``torch.optim`` itself, bitwise, over every option, on lists of tensors whose sizes
exercise the vectorized body and the scalar tail of torch's kernels. (Internal module:
the rules are what every zerofn optimizer path runs, so they are tested directly.)
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import seeded

from zerofn._optim_rules import adam_, sgd_

SIZES = (1, 7, 64, 1031)
STEPS = 4


def _pairs(dtype: torch.dtype, seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor], torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen).to(dtype) for s in SIZES]
    return [torch.nn.Parameter(p.clone()) for p in start], [p.clone() for p in start], gen


ADAM_CASES = list(
    itertools.product(
        [torch.float32, torch.float64, torch.bfloat16], [False, True], [False, True], [False, True], [0.0, 0.1]
    )
)


@pytest.mark.parametrize(("dtype", "decoupled", "amsgrad", "maximize", "wd"), ADAM_CASES)
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_the_adam_rule_is_torch_optims_adam_bitwise(dtype, decoupled, amsgrad, maximize, wd, tensor_lr):
    lr = torch.tensor(3e-3) if tensor_lr else 3e-3
    ref, mine, gen = _pairs(dtype, seeded(11))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ref, lr=float(lr), betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    hp = {
        "lr": lr,
        "betas": (0.9, 0.99),
        "eps": 1e-8,
        "weight_decay": wd,
        "amsgrad": amsgrad,
        "maximize": maximize,
        "foreach": None,
        "fused": None,
    }
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    mx = [torch.zeros_like(p) for p in mine] if amsgrad else []
    steps = [torch.tensor(0.0) for _ in mine]
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in mine]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        adam_(decoupled, hp, mine, grads, m, v, mx, steps)
    for p, q, mm, vv in zip(ref, mine, m, v, strict=True):
        assert torch.equal(p.detach(), q)
        assert torch.equal(opt.state[p]["exp_avg"], mm)
        assert torch.equal(opt.state[p]["exp_avg_sq"], vv)
    assert [float(s) for s in steps] == [float(STEPS)] * len(SIZES)


SGD_CASES = [
    c
    for c in itertools.product(
        [torch.float32, torch.float64, torch.bfloat16], [0.0, 0.9], [0.0, 0.1], [False, True], [0.0, 0.1], [False, True]
    )
    if not (c[3] and (c[1] == 0 or c[2] != 0))  # nesterov needs momentum and no dampening
]


@pytest.mark.parametrize(("dtype", "momentum", "dampening", "nesterov", "wd", "maximize"), SGD_CASES)
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_the_sgd_rule_is_torch_optims_sgd_bitwise(dtype, momentum, dampening, nesterov, wd, maximize, tensor_lr):
    lr = torch.tensor(0.05) if tensor_lr else 0.05
    ref, mine, gen = _pairs(dtype, seeded(12))
    opt = torch.optim.SGD(
        ref, lr=float(lr), momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd, maximize=maximize
    )
    hp = {
        "lr": lr,
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "weight_decay": wd,
        "maximize": maximize,
        "foreach": None,
        "fused": None,
    }
    bufs: list[torch.Tensor | None] = [None] * len(mine)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in mine]
        kept = [g.clone() for g in grads]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        sgd_(hp, mine, grads, bufs)
        assert all(torch.equal(g, k) for g, k in zip(grads, kept, strict=True))  # grads are read, never written
    for p, q, b in zip(ref, mine, bufs, strict=True):
        assert torch.equal(p.detach(), q)
        if momentum:
            assert torch.equal(opt.state[p]["momentum_buffer"], b)
        else:
            assert b is None


def test_foreach_and_fused_run_torchs_own_kernels():
    ref, mine, gen = _pairs(torch.float32, seeded(13))
    opt = torch.optim.AdamW(ref, lr=1e-3, foreach=True)
    hp = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "amsgrad": False,
        "maximize": False,
        "foreach": True,
        "fused": None,
    }
    m, v, steps = (
        [torch.zeros_like(p) for p in mine],
        [torch.zeros_like(p) for p in mine],
        [torch.tensor(0.0) for _ in mine],
    )
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen) for p in mine]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        adam_(True, hp, mine, grads, m, v, [], steps)
    assert all(torch.equal(p.detach(), q) for p, q in zip(ref, mine, strict=True))
