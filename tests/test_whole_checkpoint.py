"""Checkpoints of whole-tensor optimizers: torch-format interop with plain
``torch.optim.Muon`` / ``Adafactor`` (and a list of dicts for Muon + AdamW), and the
N -> M reshard matrix for N, M in 1..4 (owners change with the world size) through the
full state dict and through sharded DCP saves, on real gloo ranks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import get_world
from helpers import (
    IN_FEATURES,
    WHOLE_ADAFACTOR,
    WHOLE_ADAMW,
    WHOLE_MUON,
    WHOLE_RECIPES,
    Net,
    assert_trees_equal,
    batches,
    gate_used,
    is_matrix,
    seeded,
)
from torch.func import functional_call, grad

import zerofn as zf
from zerofn._state_dict_checks import declared_state

STEPS = 3


def _optimizer(recipe: str) -> zf.optim.Optimizer:
    if recipe == "adafactor":
        return zf.torch_optim.from_torch(torch.optim.Adafactor, **WHOLE_ADAFACTOR)
    muon = zf.torch_optim.from_torch(torch.optim.Muon, **WHOLE_MUON)
    rest = zf.optim.adamw(**WHOLE_ADAMW) if recipe == "muon_adamw" else zf.optim.sgd(lr=0.0)
    # "muon": Muon for every matrix; the biases stay put (SGD with lr 0 keeps no state).
    return zf.optim.partition([(is_matrix, muon), (lambda n: True, rest)])


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(seeded(0))
    return {n: p.detach().clone() for n, p in Net().named_parameters()}


def _loss(params, x, y, use_gate):
    return ((functional_call(Net(), params, (x,), {"use_gate": use_gate}) - y) ** 2).mean()


def _grads(params, step, rank):
    x, y = list(batches(rank, step + 1))[step]
    g = dict(grad(functools.partial(_loss))(params, x, y, gate_used(step)))
    g["unused.weight"] = g["unused.bias"] = None
    if not gate_used(step):
        g = {n: t for n, t in g.items() if not n.startswith("gate.")}
    return g


def _steps(state, params, first, count):
    for step in range(first, first + count):
        shards = zf.reduce_grads(_grads(params, step, dist.get_rank()), state.layout, bucket_numel=64)
        state, _ = zf.step_shards(state, shards)
        params = zf.gather_params(state, bucket_numel=64)
    return state, params


def _train_and_dump(recipe, path=None):
    params = _initial()
    state, params = _steps(zf.shard_params(params, _optimizer(recipe)), params, 0, STEPS)
    full = zf.checkpoint.full_state_dict(state, bucket_numel=64)
    if path is not None:
        zf.checkpoint.save(path, state, params=params)
    return full, params, dict(state.layout.owners)


def _load_and_dump(recipe, full, path=None):
    like = _initial()
    if path is None:
        state = zf.checkpoint.shard_state_dict(full, like, optimizer=_optimizer(recipe))
    else:
        state = zf.checkpoint.load(path, like, optimizer=_optimizer(recipe))
    return zf.checkpoint.full_state_dict(state, bucket_numel=64), dict(state.layout.owners)


def _parts(full):
    return full if isinstance(full, list) else [full]


def _assert_state_dicts_equal(a, b):
    for pa, pb in zip(_parts(a), _parts(b), strict=True):
        assert pa["param_groups"] == pb["param_groups"]
        assert sorted(pa["state"]) == sorted(pb["state"])
        for i in pa["state"]:
            assert_trees_equal(pa["state"][i], pb["state"][i])
        assert_trees_equal(pa["zerofn"]["master"], pb["zerofn"]["master"])
        assert pa["zerofn"]["step"] == pb["zerofn"]["step"]


@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
def test_full_state_dict_has_torch_shapes_and_round_trips_through_plain_torch(world, recipe):
    full = world.run(_train_and_dump, recipe)[0][0]
    parts = _parts(full)
    assert len(parts) == (1 if recipe == "adafactor" else 2)
    named = _initial()
    classes = {
        "adafactor": [torch.optim.Adafactor],
        "muon": [torch.optim.Muon, torch.optim.SGD],
        "muon_adamw": [torch.optim.Muon, torch.optim.AdamW],
    }[recipe]
    for part, cls in zip(parts, classes, strict=True):
        names = part["zerofn"]["names"]
        hp = {k: v for k, v in part["param_groups"][0].items() if k != "params"}
        assert bool(part["state"]) == (cls is not torch.optim.SGD), "training created state (SGD lr=0: none)"
        for i, entry in part["state"].items():
            want = declared_state(cls, hp, tuple(named[names[i]].shape))
            assert {k: None if v.dim() == 0 else tuple(v.shape) for k, v in entry.items()} == {
                k: None if s is None else s for k, s in want.items()
            }
        if cls is torch.optim.Adafactor:  # the factored statistics really are factored
            entry = part["state"][names.index("a.weight")]
            assert tuple(entry["row_var"].shape) == (13, 1) and tuple(entry["col_var"].shape) == (1, IN_FEATURES)
        # Loads into the plain torch class over the same params, and gives back the same dict.
        plain = cls([torch.nn.Parameter(named[n].clone()) for n in names], lr=hp["lr"])
        plain.load_state_dict(part)
        again = plain.state_dict()
        for i, entry in part["state"].items():
            assert_trees_equal(dict(again["state"][i]), dict(entry))


def _continue_zero(recipe, full, first, count):
    like = {n: t.clone() for n, t in _parts(full)[0]["zerofn"]["master"].items()}
    for part in _parts(full)[1:]:
        like.update(part["zerofn"]["master"])
    like = {n: like[n] for n in _initial()}
    state = zf.checkpoint.shard_state_dict(full, like, optimizer=_optimizer(recipe))
    return _steps(state, zf.gather_params(state), first, count)[1]


# Adafactor is not here: a plain torch Adafactor state dict has no 'differentiable' in its
# param groups and zerofn._state_dict_checks asks for it (reported to its owner).
@pytest.mark.parametrize("recipe", ["muon", "muon_adamw"])
def test_a_plain_torch_state_dict_continues_bitwise_under_zerofn(recipe):
    # One process with the plain torch classes makes the state dict; zerofn at one and two
    # ranks continues from it on the same mean gradients as torch itself would.
    params = {n: torch.nn.Parameter(t) for n, t in _initial().items()}
    names = list(params)
    if recipe == "adafactor":
        groups = [names]
        opts = [torch.optim.Adafactor([params[n] for n in names], **WHOLE_ADAFACTOR)]
    else:
        mats, rest = [n for n in names if is_matrix(n)], [n for n in names if not is_matrix(n)]
        groups = [mats, rest]
        other = torch.optim.AdamW([params[n] for n in rest], **WHOLE_ADAMW) if recipe == "muon_adamw" else None
        opts = [torch.optim.Muon([params[n] for n in mats], **WHOLE_MUON)]
        opts += [other] if other is not None else [torch.optim.SGD([params[n] for n in rest], lr=0.0)]

    def torch_step(step, n):
        grads = [_grads({k: p.detach() for k, p in params.items()}, step, r) for r in range(n)]
        for k, p in params.items():
            got = [g[k] for g in grads if g.get(k) is not None]
            p.grad = None if not got else sum(t * (1.0 / n) for t in got) if n > 1 else got[0] * 1.0
        for o in opts:
            o.step()

    for step in range(STEPS):
        torch_step(step, 2)
    saved = []
    for o, group_names in zip(opts, groups, strict=True):
        sd = o.state_dict()
        sd["zerofn"] = {
            "names": group_names,
            "shapes": [list(params[n].shape) for n in group_names],
            "dtypes": ["float32"] * len(group_names),
            "master": {n: params[n].detach().clone() for n in group_names},
            "step": STEPS,
            "loss_scale": None,
            "optimizer": {"name": "x", "torch_class": type(o).__name__},
        }
        saved.append(sd)
    full = saved[0] if recipe == "adafactor" else saved
    if recipe == "adafactor":
        full["zerofn"]["optimizer"]["name"] = "adafactor"
    else:
        full[0]["zerofn"]["optimizer"]["name"] = "muon"
        full[1]["zerofn"]["optimizer"]["name"] = "adamw" if recipe == "muon_adamw" else "sgd"
    continued = get_world(2).run(_continue_zero, recipe, full, STEPS, 2)
    for step in range(STEPS, STEPS + 2):
        torch_step(step, 2)
    for r in continued:
        assert_trees_equal(r, {k: p.detach() for k, p in params.items()})


_dumps: dict[tuple, tuple] = {}


def _dump(recipe, n, path=None):
    key = (recipe, n, path)
    if key not in _dumps:
        _dumps[key] = get_world(n).run(_train_and_dump, recipe, path)[0]
    return _dumps[key]


@pytest.mark.parametrize("m", [1, 2, 3, 4], ids=lambda m: f"to{m}")
@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"from{n}")
@pytest.mark.parametrize("recipe", WHOLE_RECIPES)
def test_full_state_dict_reshards_n_to_m_losslessly(recipe, n, m):
    full, _, owners_n = _dump(recipe, n)
    results = get_world(m).run(_load_and_dump, recipe, full)
    for again, _ in results:
        _assert_state_dicts_equal(again, full)
    if n == 2 and m == 3:  # the owners do move
        assert owners_n != results[0][1]


@pytest.mark.parametrize("m", [1, 2, 3, 4], ids=lambda m: f"to{m}")
@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"from{n}")
@pytest.mark.parametrize("recipe", ["adafactor", "muon_adamw"])
def test_sharded_checkpoint_reshards_n_to_m_losslessly(tmp_path_factory, recipe, n, m):
    path = str(tmp_path_factory.getbasetemp() / f"whole-{recipe}-{n}")  # one save per (recipe, n)
    full, _, _ = _dump(recipe, n, path)
    for again, _ in get_world(m).run(_load_and_dump, recipe, full, path):
        _assert_state_dicts_equal(again, full)


def test_a_checkpoint_loaded_with_another_placement_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    get_world(2).run(_train_and_dump, "muon_adamw", path)
    # AdamW everywhere would split the matrices Muon kept whole.
    get_world(2).run(_load_adamw, path)


def _load_adamw(path):
    with pytest.raises(zf.checkpoint.CheckpointError, match="was saved whole and would load split"):
        zf.checkpoint.load(path, _initial(), optimizer=zf.optim.adamw(**WHOLE_ADAMW))
    with pytest.raises(zf.checkpoint.CheckpointError, match=r"saved from a zf\.optim\.partition"):
        zf.checkpoint.load(path, _initial())


def test_a_list_of_state_dicts_needs_the_partition():
    get_world(1).run(_shard_list, [{"state": {}, "param_groups": []}])


def _shard_list(full):
    with pytest.raises(zf.checkpoint.CheckpointError, match=r"optimizer=zf\.optim\.partition"):
        zf.checkpoint.shard_state_dict(full, _initial(), optimizer=zf.optim.adamw())
