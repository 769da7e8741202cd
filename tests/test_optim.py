"""zerofn.optim: functional sgd / adam / adamw against torch.optim, bitwise.

Each test runs the same steps on the same tensors through ``torch.optim`` (params with
``.grad`` set) and through the functional ``init`` / ``update`` pair, and compares params
and optimizer state byte for byte. Pure code: no ranks needed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import Snapshot, assert_bitwise_equal, assert_trees_equal, seeded

import zerofn as zf

STEPS = 5


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(seeded(0))
    shapes = {"a.weight": (5, 3), "a.bias": (5,), "b.weight": (2, 5), "scale": ()}
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}


def _grad_steps(params, steps=STEPS, skip=None):
    """Per step a grads dict; ``skip(step, name)`` True leaves ``name`` without a gradient."""
    gen = torch.Generator().manual_seed(seeded(1))
    out = []
    for step in range(steps):
        grads = {}
        for n, p in params.items():
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            if skip is None or not skip(step, n):
                grads[n] = g
        out.append(grads)
    return out


def _torch_run(cls, params, grad_steps, groups=None, **kwargs):
    """``cls`` over ``params``; ``groups``: list of (names, overrides), rest in a last group."""
    tparams = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    if groups is None:
        param_groups = [{"params": list(tparams.values())}]
    else:
        listed = [n for names, _ in groups for n in names]
        param_groups = [{"params": [tparams[n] for n in names], **hp} for names, hp in groups]
        param_groups.append({"params": [p for n, p in tparams.items() if n not in listed]})
    opt = cls(param_groups, **kwargs)
    for grads in grad_steps:
        for n, p in tparams.items():
            p.grad = grads[n].clone() if n in grads else None
        opt.step()
    return {n: p.detach() for n, p in tparams.items()}, {n: opt.state[p] for n, p in tparams.items()}


def _zf_run(opt, params, grad_steps):
    state = opt.init(params)
    for grads in grad_steps:
        params, state = opt.update(grads, state, params)
    return params, state


def _assert_state_matches_torch(name, zstate, tstate):
    """Every field of ``zstate`` for param ``name`` equals torch.optim's state bitwise."""
    if isinstance(zstate, zf.optim.SGDState):
        buf = zstate.momentum_buffer[name]
        if buf is None:
            assert tstate.get("momentum_buffer") is None, name
        else:
            assert_bitwise_equal(buf, tstate["momentum_buffer"], f"{name} momentum_buffer")
        return
    if not tstate:  # torch never stepped this param
        assert float(zstate.step[name]) == 0.0
        assert not zstate.exp_avg[name].any() and not zstate.exp_avg_sq[name].any()
        return
    assert_bitwise_equal(zstate.step[name], tstate["step"], f"{name} step")
    assert_bitwise_equal(zstate.exp_avg[name], tstate["exp_avg"], f"{name} exp_avg")
    assert_bitwise_equal(zstate.exp_avg_sq[name], tstate["exp_avg_sq"], f"{name} exp_avg_sq")
    if "max_exp_avg_sq" in tstate:
        assert_bitwise_equal(zstate.max_exp_avg_sq[name], tstate["max_exp_avg_sq"], f"{name} max_exp_avg_sq")


SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9),
    "dampening": dict(lr=0.1, momentum=0.9, dampening=0.3),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.1, momentum=0.5, weight_decay=0.05),
    "maximize": dict(lr=0.1, momentum=0.9, weight_decay=0.05, maximize=True),
    "everything": dict(lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True, maximize=True),
}
ADAM_CASES = {
    "default": dict(),
    "tuned": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    "weight_decay": dict(lr=1e-2, weight_decay=0.1),
    "amsgrad": dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
    "maximize": dict(lr=1e-2, weight_decay=0.1, maximize=True, amsgrad=True),
}


KERNELS = {
    "default": {},
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def _optimizers():
    """(id, zerofn factory, torch class, kwargs) for every case and each of torch's kernels."""
    for kernel, kkw in KERNELS.items():
        for case, kw in SGD_CASES.items():
            yield f"sgd-{case}-{kernel}", zf.optim.sgd, torch.optim.SGD, {**kw, **kkw}
        for case, kw in ADAM_CASES.items():
            yield f"adam-{case}-{kernel}", zf.optim.adam, torch.optim.Adam, {**kw, **kkw}
            yield f"adamw-{case}-{kernel}", zf.optim.adamw, torch.optim.AdamW, {**kw, **kkw}


OPTIMIZERS = [pytest.param(f, c, kw, id=i) for i, f, c, kw in _optimizers()]
# torch's fused SGD cannot give a momentum buffer to a param whose first gradient comes
# after other params already have one (torch.optim.SGD(fused=True) itself raises a
# TypeError there), so the layer-drop cases leave fused SGD with momentum out.
OPTIMIZERS_LAYER_DROP = [
    pytest.param(f, c, kw, id=i)
    for i, f, c, kw in _optimizers()
    if not (f is zf.optim.sgd and kw.get("fused") and kw.get("momentum", 0) != 0)
]


@pytest.mark.parametrize(("factory", "torch_cls", "kwargs"), OPTIMIZERS)
def test_update_is_bitwise_equal_to_torch_optim(factory, torch_cls, kwargs):
    params = _params()
    steps = _grad_steps(params)
    expected, tstate = _torch_run(torch_cls, params, steps, **kwargs)
    got, zstate = _zf_run(factory(**kwargs), params, steps)
    assert_trees_equal(got, expected)
    for name in params:
        _assert_state_matches_torch(name, zstate, tstate[name])


@pytest.mark.parametrize(
    ("factory", "torch_cls", "kwargs"),
    [
        pytest.param(zf.optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9), id="sgd"),
        pytest.param(zf.optim.adamw, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True), id="adamw"),
    ],
)
def test_float64_params_are_bitwise_equal_to_torch_optim(factory, torch_cls, kwargs):
    params = _params(torch.float64)
    steps = _grad_steps(params)
    expected, _ = _torch_run(torch_cls, params, steps, **kwargs)
    got, _ = _zf_run(factory(**kwargs), params, steps)
    assert_trees_equal(got, expected)


def _skip_some(step, name):
    # "a.bias" never gets a gradient; "b.weight" gets none in steps 0 and 3.
    return name == "a.bias" or (name == "b.weight" and step in (0, 3))


@pytest.mark.parametrize(("factory", "torch_cls", "kwargs"), OPTIMIZERS_LAYER_DROP)
def test_params_without_gradients_are_skipped_like_torch(factory, torch_cls, kwargs):
    params = _params()
    steps = _grad_steps(params, skip=_skip_some)
    expected, tstate = _torch_run(torch_cls, params, steps, **kwargs)
    got, zstate = _zf_run(factory(**kwargs), params, steps)
    assert_trees_equal(got, expected)
    assert got["a.bias"] is params["a.bias"], "a param with no gradient keeps its tensor"
    for name in params:
        _assert_state_matches_torch(name, zstate, tstate[name])
    if isinstance(zstate, zf.optim.AdamState):
        assert float(zstate.step["a.bias"]) == 0.0
        assert float(zstate.step["b.weight"]) == STEPS - 2
        assert float(zstate.step["a.weight"]) == STEPS


def test_none_gradient_is_the_same_as_a_missing_one():
    params = _params()
    grads = _grad_steps(params, steps=1)[0]
    opt = zf.optim.adamw(lr=1e-2)
    state = opt.init(params)
    missing = opt.update({n: g for n, g in grads.items() if n != "a.bias"}, state, params)
    none = opt.update({**grads, "a.bias": None}, state, params)
    assert_trees_equal(none[0], missing[0])
    assert_trees_equal(none[1].step, missing[1].step)
    assert_trees_equal(none[1].exp_avg, missing[1].exp_avg)


def test_gradient_for_an_unknown_param_is_a_key_error():
    params = _params()
    opt = zf.optim.sgd(lr=0.1)
    with pytest.raises(KeyError, match=r"unknown params.*'nope'"):
        opt.update({"nope": torch.ones(1)}, opt.init(params), params)


# --------------------------------------------------------------------------- param groups

GROUP_CASES = [
    pytest.param(
        zf.optim.sgd,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, weight_decay=0.1),
        [(["a.bias", "scale"], dict(lr=0.5, weight_decay=0.0)), (["b.weight"], dict(momentum=0.5))],
        id="sgd",
    ),
    pytest.param(
        zf.optim.adamw,
        torch.optim.AdamW,
        dict(lr=1e-2, weight_decay=0.1),
        [
            (["a.bias", "scale"], dict(weight_decay=0.0)),
            (["b.weight"], dict(lr=3e-2, betas=(0.5, 0.9))),
        ],
        id="adamw",
    ),
    pytest.param(
        zf.optim.adam,
        torch.optim.Adam,
        dict(lr=1e-2),
        [(["a.weight"], dict(amsgrad=True, weight_decay=0.2))],
        id="adam-amsgrad-group",
    ),
]


@pytest.mark.parametrize("select", ["names", "predicate"])
@pytest.mark.parametrize(("factory", "torch_cls", "defaults", "groups"), GROUP_CASES)
def test_param_groups_match_torch_param_groups(factory, torch_cls, defaults, groups, select):
    params = _params()
    steps = _grad_steps(params)
    expected, tstate = _torch_run(torch_cls, params, steps, groups=groups, **defaults)

    def selector(names):
        return list(names) if select == "names" else (lambda n, names=frozenset(names): n in names)

    opt = factory(**defaults, param_groups=[{"params": selector(names), **hp} for names, hp in groups])
    got, zstate = _zf_run(opt, params, steps)
    assert_trees_equal(got, expected)
    for name in params:
        _assert_state_matches_torch(name, zstate, tstate[name])


def test_a_name_belongs_to_the_first_group_that_selects_it():
    opt = zf.optim.sgd(
        lr=0.1,
        param_groups=[
            {"params": lambda n: n.endswith("bias"), "lr": 0.2},
            {"params": ["a.bias", "a.weight"], "lr": 0.3},
        ],
    )
    assert opt.hyperparams("a.bias")["lr"] == 0.2
    assert opt.hyperparams("a.weight")["lr"] == 0.3
    assert opt.hyperparams("b.weight")["lr"] == 0.1
    assert [opt.group_index(n) for n in ("a.bias", "a.weight", "b.weight")] == [0, 1, 2]


def test_changing_lr_between_steps_matches_torch_changing_its_group_lr():
    params = _params()
    steps = _grad_steps(params)
    tparams = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    topt = torch.optim.AdamW(tparams.values(), lr=1e-2)
    opt = zf.optim.adamw(lr=1e-2)
    state, zparams = opt.init(params), params
    for i, grads in enumerate(steps):
        lr = 1e-2 * (0.5**i)
        topt.param_groups[0]["lr"] = lr
        for n, p in tparams.items():
            p.grad = grads[n].clone()
        topt.step()
        zparams, state = opt.with_hyperparams(lr=lr).update(grads, state, zparams)
    assert_trees_equal(zparams, {n: p.detach() for n, p in tparams.items()})


# --------------------------------------------------------------------------- purity / donate


@pytest.mark.parametrize(("factory", "torch_cls", "kwargs"), OPTIMIZERS_LAYER_DROP)
def test_update_never_changes_its_inputs(factory, torch_cls, kwargs):
    del torch_cls
    params = _params()
    opt = factory(**kwargs)
    state = opt.init(params)
    for grads in _grad_steps(params, steps=3, skip=_skip_some):
        before = Snapshot((params, state, grads))
        new_params, new_state = opt.update(grads, state, params)
        before.assert_unchanged((params, state, grads))
        for n, p in new_params.items():
            if n in grads:
                assert p is not params[n] and p.data_ptr() != params[n].data_ptr()
        params, state = new_params, new_state


@pytest.mark.parametrize(("factory", "torch_cls", "kwargs"), OPTIMIZERS)
def test_donate_updates_in_place_with_the_same_result(factory, torch_cls, kwargs):
    del torch_cls
    params = _params()
    opt = factory(**kwargs)
    pure_params, pure_state = params, opt.init(params)
    don_params = {n: p.clone() for n, p in params.items()}
    don_state = opt.init(don_params)
    for grads in _grad_steps(params, steps=3):
        pure_params, pure_state = opt.update(grads, pure_state, pure_params)
        ptrs = {n: p.data_ptr() for n, p in don_params.items()}
        don_params, don_state = opt.update(grads, don_state, don_params, donate=True)
        assert {n: p.data_ptr() for n, p in don_params.items()} == ptrs, "donated storage reused"
    assert_trees_equal(don_params, pure_params)
    for a, b in zip(don_state, pure_state, strict=True):
        assert_trees_equal(
            {k: v for k, v in a.items() if v is not None},
            {k: v for k, v in b.items() if v is not None},
        )


def test_state_mappings_are_read_only():
    opt = zf.optim.adam()
    state = opt.init(_params())
    with pytest.raises(TypeError):
        state.exp_avg["a.weight"] = torch.zeros(5, 3)


# --------------------------------------------------------------------------- hyperparameters

BAD_HYPERPARAMS = [
    (zf.optim.sgd, dict(lr=-0.1), "lr"),
    (zf.optim.sgd, dict(lr=math.nan), "lr"),
    (zf.optim.sgd, dict(lr=math.inf), "lr"),
    (zf.optim.sgd, dict(momentum=-0.5), "momentum"),
    (zf.optim.sgd, dict(momentum=0.9, dampening=-1.0), "dampening"),
    (zf.optim.sgd, dict(weight_decay=-1e-2), "weight_decay"),
    (zf.optim.sgd, dict(momentum=0.0, nesterov=True), "nesterov"),
    (zf.optim.sgd, dict(momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (zf.optim.adam, dict(lr=-1.0), "lr"),
    (zf.optim.adam, dict(eps=-1e-8), "eps"),
    (zf.optim.adam, dict(betas=(1.0, 0.999)), "betas"),
    (zf.optim.adam, dict(betas=(0.9, -0.1)), "betas"),
    (zf.optim.adam, dict(betas=(0.9,)), "betas"),
    (zf.optim.adamw, dict(weight_decay=-0.1), "weight_decay"),
    (zf.optim.adamw, dict(betas=(0.9, 1.5)), "betas"),
    (zf.optim.adamw, dict(param_groups=[{"params": ["w"], "lr": -1.0}]), "lr"),
    (zf.optim.sgd, dict(param_groups=[{"params": ["w"], "momentum": -1.0}]), "momentum"),
]


@pytest.mark.parametrize(
    ("factory", "kwargs", "field"),
    [pytest.param(f, kw, field, id=f"{f.__name__}-{field}-{i}") for i, (f, kw, field) in enumerate(BAD_HYPERPARAMS)],
)
def test_bad_hyperparameters_raise_value_error_naming_the_field(factory, kwargs, field):
    with pytest.raises(ValueError, match=rf"zerofn\.optim\.{factory.__name__}: .*{field}"):
        factory(**kwargs)


def test_with_hyperparams_checks_the_new_values():
    opt = zf.optim.adamw(param_groups=[{"params": ["w"], "weight_decay": 0.0}])
    with pytest.raises(ValueError, match="lr must be"):
        opt.with_hyperparams(lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        opt.with_hyperparams(0, betas=(2.0, 0.9))
    assert opt.with_hyperparams(0, lr=0.5).hyperparams("w")["lr"] == 0.5
    assert opt.hyperparams("w")["lr"] == 1e-3, "with_hyperparams returns a copy"


def test_param_group_without_params_or_with_a_string_is_rejected():
    with pytest.raises(ValueError, match=r"param_groups\[0\] needs a 'params' entry"):
        zf.optim.sgd(param_groups=[{"lr": 0.1}])
    with pytest.raises(TypeError, match="collection of names, not a str"):
        zf.optim.sgd(param_groups=[{"params": "a.bias", "lr": 0.1}])


@pytest.mark.parametrize(
    "make",
    [
        lambda: zf.optim.adamw(lr=0.1, weight_decay=0.1, fused=True),  # torch's kernel reads the skip
        lambda: zf.optim.adamw(lr=0.1, weight_decay=0.1),  # stepped on copies, then selected
        lambda: zf.optim.sgd(lr=0.1, momentum=0.9),
        lambda: zf.optim.partition([(["w"], zf.optim.adamw(lr=0.1, fused=True)), (lambda n: True, zf.optim.adam())]),
    ],
)
def test_update_with_a_skip_keeps_every_value_when_true_and_is_the_plain_update_when_false(make):
    opt = make()
    params = {"w": torch.linspace(-1, 1, 12).reshape(3, 4), "b": torch.linspace(0, 1, 5)}
    grads = {n: torch.cos(3 * p) for n, p in params.items()}
    state = opt.init(params)
    state = opt.update(grads, state, params)[1]  # momentum buffers exist: a skip keeps the structure
    plain_params, plain_state = opt.update(grads, state, params)
    kept_params, kept_state = opt.update(grads, state, params, skip=torch.tensor(True))
    taken_params, taken_state = opt.update(grads, state, params, skip=torch.tensor(False))

    def leaves(tree):
        return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

    assert all(torch.equal(kept_params[n], params[n]) for n in params)
    assert all(torch.equal(a, b) for a, b in zip(leaves(kept_state), leaves(state), strict=True))
    assert all(torch.equal(taken_params[n], plain_params[n]) for n in params)
    assert all(torch.equal(a, b) for a, b in zip(leaves(taken_state), leaves(plain_state), strict=True))
