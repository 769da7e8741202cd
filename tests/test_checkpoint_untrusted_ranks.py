"""A checkpoint someone else wrote cannot run code: loads on real gloo ranks change nothing.

Few and small (the readers' cases are unit tests in ``test_checkpoint_untrusted.py``): a
facade checkpoint attacked file by file (``.metadata``, each ``extras.<rank>.pt``, an entry
of each shard file, an entry relabelled as bytes, an entry in a file outside the folder,
the ``__0.metadata`` fallback), ``zerofn.json`` rewritten as the attacker would, loaded as
the docs say at N = 1 and 2, and the N = 2 attacks loaded at N = 1: every rank raises a
``CheckpointError`` naming the same file and global, no marker is written, and the live
state (params, shards, step, groups, extras, every RNG) is bitwise what it was. Then the
save-time refusal of a state that is not data and the explicit opt-in on save and load
(N = 2), torch's own DCP reading a zerofn save, and Fabric's sharded and full files (N = 2).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import re
import shutil
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from attack import payload, plant, raw_pickle, reseal, torch_file
from conftest import get_world
from helpers import Snapshot, seeded

import zerofn as zf
from zerofn.checkpoint import CheckpointError

# --------------------------------------------------------------------------- real ranks: the facade


class Counter:
    """A user's stateful extra."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _trained() -> tuple[torch.nn.Module, zf.ZeroOptimizer, Counter]:
    torch.manual_seed(seeded(5))
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), module=model)
    torch.manual_seed(seeded(6) + dist.get_rank())
    random.seed(seeded(7) + dist.get_rank())
    np.random.seed(seeded(8) + dist.get_rank())
    model(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    counter = Counter()
    counter.value = 3
    return model, opt, counter


def _live(model: torch.nn.Module, opt: zf.ZeroOptimizer, counter: Counter) -> tuple[Snapshot, Any]:
    """What a failed load must leave as it was: params, shards, step, groups, extra and every RNG."""
    tensors = {"params": dict(model.named_parameters()), "state": opt._state, "torch_rng": torch.get_rng_state()}
    rest = (copy.deepcopy(opt.param_groups[0]["lr"]), counter.value, random.getstate(), np.random.get_state())
    return Snapshot(tensors), rest


def _unchanged(before: tuple[Snapshot, Any], model: torch.nn.Module, opt: zf.ZeroOptimizer, counter: Counter) -> bool:
    snapshot, rest = before
    tensors = {"params": dict(model.named_parameters()), "state": opt._state, "torch_rng": torch.get_rng_state()}
    snapshot.assert_unchanged(tensors, "the live state")
    lr, value, python_rng, (name, key, *numpy_rest) = rest
    numpy_now = np.random.get_state()
    return (
        opt.param_groups[0]["lr"] == lr
        and counter.value == value
        and random.getstate() == python_rng
        and numpy_now[0] == name
        and np.array_equal(numpy_now[1], key)
        and list(numpy_now[2:]) == numpy_rest
    )


def _shard_entry_attack(directory: str, marker: str, relabel: bool, outside: bool, shard: str = "__0_0.distcp") -> None:
    """Point one entry of ``.metadata`` (written with DCP's own types) at a planted torch file: appended
    to the shard file ``shard`` (``relabel``: the entry is called bytes, which DCP's planner would
    unpickle with ``weights_only=False``), or in a file outside the folder (``outside``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(os.path.join(directory, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the test's own checkpoint: trusted here
    index = next(i for i, info in metadata.storage_data.items() if info.relative_path == shard)
    blob = torch_file(payload("functools.partial", marker))
    if outside:
        plant(os.path.dirname(directory), "outside.distcp", blob)
        metadata.storage_data[index] = _StorageInfo("../outside.distcp", 0, len(blob))
    else:
        with open(os.path.join(directory, shard), "ab") as f:
            offset = f.tell()
            f.write(blob)
        metadata.storage_data[index] = _StorageInfo(shard, offset, len(blob))
    if relabel:
        metadata.state_dict_metadata[index.fqn] = BytesStorageMetadata()
    plant(directory, ".metadata", pickle.dumps(metadata))


def _tamper(directory: str, attack: str, marker: str, n: int) -> None:
    if attack == "metadata":
        plant(directory, ".metadata", raw_pickle(payload("builtins.eval", marker), 4))
    elif attack.startswith("extras."):
        plant(directory, attack, torch_file({"extra": {"counter": payload("posix.system", marker)}, "rng": None}))
    elif attack.startswith("shard __"):
        _shard_entry_attack(directory, marker, relabel=False, outside=False, shard=attack.split()[1])
    elif attack == "bytes relabelled":
        _shard_entry_attack(directory, marker, relabel=True, outside=False)
    elif attack == "outside the folder":
        _shard_entry_attack(directory, marker, relabel=False, outside=True)
    elif attack == "__0.metadata fallback":
        plant(directory, ".metadata", b"\x80\x04truncated")
        plant(directory, "__0.metadata", raw_pickle(payload("functools.partial", marker), 2))
    reseal(directory, add=("__0.metadata",) if attack == "__0.metadata fallback" else ())


def _attacks(n: int) -> list[str]:
    shards = [f"shard __{r}_0.distcp" for r in range(n)]
    return [
        "metadata",
        *[f"extras.{r}.pt" for r in range(n)],
        *shards,
        "bytes relabelled",
        "outside the folder",
        "__0.metadata fallback",
    ]


# What each attack's error names (besides the checkpoint's path).
_NAMES = {
    "metadata": ".metadata: names the global builtins.eval",
    "extras.": "names the global posix.system",
    "shard __": "names the global functools.partial",
    "bytes relabelled": "is a BytesStorageMetadata, not a tensor",  # refused before any read
    "outside the folder": "'../outside.distcp', which is not a shard file zerofn.json lists",
    "__0.metadata fallback": "__0.metadata: names the global functools.partial",
}


def _attacked_loads(root: str, attacks: list[str], saved_n: int | None) -> dict[str, tuple[str, bool]]:
    """On every rank: each attack on a copy of a facade checkpoint (made at ``saved_n`` ranks, or
    here), loaded as the docs say (``opt.load_checkpoint(path, extra=...)``): (error, unchanged)."""
    model, opt, counter = _trained()
    rank, n = dist.get_rank(), dist.get_world_size()
    marker = os.path.join(root, "marker")
    if saved_n is None:
        saved = os.path.realpath(opt.save_checkpoint(os.path.join(root, f"ckpt{n}"), extra={"counter": counter}))
    out = {}
    for attack in attacks:
        directory = os.path.join(root, f"n{saved_n or n}-{attack.replace(' ', '-')}")
        if saved_n is None and rank == 0:
            shutil.copytree(saved, directory)
            _tamper(directory, attack, marker, n)
        dist.barrier()
        before = _live(model, opt, counter)
        try:
            opt.load_checkpoint(directory, extra={"counter": counter})
            error = "loaded"
        except CheckpointError as e:
            error = str(e)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = f"not a CheckpointError: {type(e).__name__}: {e}"
        out[attack] = (error, _unchanged(before, model, opt, counter))
        dist.barrier()
    assert not os.path.exists(marker), "a planted pickle ran"
    return out


_FILE_AND_GLOBAL = re.compile(r"(\S+): names the global (\S+),")


def _check_attacks(results: list[dict[str, tuple[str, bool]]], attacks: list[str]) -> None:
    """Every rank raised a CheckpointError naming the attack (the same file and global on every
    rank), and every rank's live state is what it was."""
    for attack in attacks:
        name = next(v for k, v in _NAMES.items() if attack.startswith(k))
        named = set()
        for rank, by_attack in enumerate(results):
            error, unchanged = by_attack[attack]
            assert name in error, f"{attack}, rank {rank}: {error}"
            assert unchanged, f"{attack}, rank {rank}: the live state changed"
            found = _FILE_AND_GLOBAL.search(error)
            named.add(found.groups() if found else None)
        assert len(named) == 1, f"{attack}: the ranks named different files or globals: {named}"


@pytest.mark.parametrize("n", [1, 2])
def test_every_file_of_a_sharded_checkpoint_is_read_as_data(tmp_path, n):
    attacks = _attacks(n)
    _check_attacks(get_world(n).run(_attacked_loads, str(tmp_path), attacks, None), attacks)
    assert not os.path.exists(tmp_path / "marker")
    if n == 2:  # the same planted checkpoints, loaded at another world size
        at_one = [a for a in attacks if a != "extras.1.pt"]  # at N = 1 rank 0's extras are read
        _check_attacks(get_world(1).run(_attacked_loads, str(tmp_path), at_one, 2), at_one)
        assert not os.path.exists(tmp_path / "marker")


def _torch_reads_it(root: str) -> list[float]:
    import torch.distributed.checkpoint as dcp

    params = {"w": torch.arange(6.0), "b": torch.ones(3)}
    state = zf.shard_params(params, zf.optim.sgd(lr=0.1))
    path = zf.checkpoint.save(os.path.join(root, "ck"), state, params=params)
    into = {"model/w": torch.zeros(6), "model/b": torch.zeros(3)}
    dcp.load(into, checkpoint_id=path)  # torch's own reader and planner
    return [*into["model/w"].tolist(), *into["model/b"].tolist()]


def test_torch_s_own_dcp_reads_what_zerofn_saves(tmp_path):
    assert get_world(1).run(_torch_reads_it, str(tmp_path)) == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1.0, 1.0, 1.0]]


class Schedule:
    """A user's extra whose state holds an object that is not data (a Fraction)."""

    def __init__(self) -> None:
        from fractions import Fraction

        self.state: dict[str, Any] = {"milestones": [1, 2], "ratio": {"now": Fraction(1, 3)}}

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state)


def _opt_in(root: str) -> dict[str, Any]:
    from fractions import Fraction

    model, opt, counter = _trained()
    schedule = Schedule()
    path = os.path.join(root, "ck")
    out: dict[str, Any] = {}
    try:
        opt.save_checkpoint(path, extra={"schedule": schedule})
    except CheckpointError as e:
        out["save"] = str(e)
    out["saved anything"] = os.path.exists(path)
    saved = opt.save_checkpoint(path, extra={"schedule": schedule}, safe_globals=[Fraction])
    with open(os.path.join(saved, "zerofn.json")) as f:
        out["pickled"] = json.load(f)["pickled"]
    schedule.state = {"milestones": [], "ratio": {}}
    before = _live(model, opt, counter)
    try:
        opt.load_checkpoint(path, extra={"schedule": schedule})
    except CheckpointError as e:
        out["load"] = str(e)
    out["unchanged"] = _unchanged(before, model, opt, counter) and schedule.state == {"milestones": [], "ratio": {}}
    opt.load_checkpoint(path, extra={"schedule": schedule}, safe_globals=[Fraction])
    out["restored"] = schedule.state == Schedule().state
    return out


def test_a_state_that_is_not_data_needs_the_callers_opt_in_on_save_and_on_load(tmp_path):
    for out in get_world(2).run(_opt_in, str(tmp_path)):
        assert "extra['schedule'].state_dict()['ratio']['now'] is a fractions.Fraction" in out["save"], out["save"]
        assert not out["saved anything"]
        assert out["pickled"] == ["fractions.Fraction"]
        assert "does not admit ['fractions.Fraction']: nothing was read" in out["load"], out["load"]
        assert out["unchanged"] and out["restored"]


# --------------------------------------------------------------------------- real ranks: Fabric


def _fabric_attacks(root: str) -> dict[str, Any]:
    import lightning as L

    from zerofn.lightning import ZeroStrategy

    marker = os.path.join(root, "marker")
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroStrategy())
    fabric.launch()
    torch.manual_seed(seeded(9))
    module = torch.nn.Linear(4, 3)
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    fabric.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1}
    fabric.save(os.path.join(root, "sharded"), state)
    fabric.strategy.state_dict_type = "full"
    fabric.save(os.path.join(root, "full.ckpt"), state)
    if dist.get_rank() == 0:
        sharded = os.path.realpath(os.path.join(root, "sharded"))
        plant(sharded, "extras.1.pt", torch_file({"extra": {"step": payload("builtins.eval", marker)}, "rng": None}))
        reseal(sharded)
        full = torch.load(os.path.join(root, "full.ckpt"), weights_only=True)  # zerofn's own file loads as data
        plant(root, "full.ckpt", torch_file({**full, "step": payload("subprocess.Popen", marker)}, 4))
    dist.barrier()
    out = {}
    for name in ("sharded", "full.ckpt"):
        before = Snapshot({"params": dict(model.named_parameters()), "state": opt._state})
        try:
            fabric.load(os.path.join(root, name), {"model": model, "optimizer": opt, "step": 0})
            out[name] = "loaded"
        except CheckpointError as e:
            out[name] = str(e)
        before.assert_unchanged({"params": dict(model.named_parameters()), "state": opt._state}, name)
    dist.barrier()
    out["ran"] = os.path.exists(marker)
    return out


def test_fabric_checkpoints_are_read_as_data(tmp_path):
    pytest.importorskip("lightning")
    for out in get_world(2).run(_fabric_attacks, str(tmp_path)):
        assert "names the global builtins.eval" in out["sharded"] and "extras.1.pt" in out["sharded"], out
        assert "full.ckpt: names the global subprocess.Popen" in out["full.ckpt"], out
        assert not out["ran"]
