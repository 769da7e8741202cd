"""A checkpoint someone else wrote cannot run code: the readers, at unit level (no processes).

The attacker can write every file of the checkpoint, ``zerofn.json`` included (its sizes and
hashes are rewritten after each plant: :func:`attack.reseal`). Each planted pickle writes a
marker file when unpickled without an allowlist (checked first: the attacks are real); a
read must then raise :class:`CheckpointError` naming the file and the global, with no
marker written.

Here: the two readers (DCP's metadata through the allowlist, torch files with
``weights_only=True``) against every planted global at pickle protocols 0-5; the
metadata's own checks (bytes entries, files outside the folder or unlisted, the
``__0.metadata`` fallback); DCP's ``CheckpointException`` as a ``CheckpointError``; the
extras of format 1 (a NumPy array outside the RNG key); both Lightning strategies' loads
of Lightning's file and their opt-in. The loads on real ranks, where nothing may change:
``test_checkpoint_untrusted_ranks.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from attack import GLOBALS, evil_module, payload, plant, raw_pickle, reseal, torch_file

from zerofn.checkpoint import CheckpointError
from zerofn.checkpoint._format import read_meta
from zerofn.checkpoint._unpickle import load_dcp_metadata, load_torch_file

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


@pytest.fixture
def marker(tmp_path, monkeypatch) -> str:
    """The marker a payload writes; ``importlib.import_module``'s module is importable."""
    path = str(tmp_path / "marker")
    name, source = evil_module(path)
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def _refused(error: pytest.ExceptionInfo, file: str, name: str, marker: str) -> None:
    message = str(error.value)
    assert file in message and name in message, message
    assert not os.path.exists(marker), "the planted code ran"


# --------------------------------------------------------------------------- the payloads are real


@pytest.mark.parametrize("name", [g for g in GLOBALS if g != "torch.serialization.load"])
def test_each_planted_pickle_runs_its_code_when_unpickled_plainly(name, marker):
    ran = pickle.loads(raw_pickle(payload(name, marker), 2))
    if name == "subprocess.Popen":
        ran.wait()
    assert os.path.exists(marker)


def test_the_torch_load_payload_calls_torch_load_when_unpickled_plainly(marker):
    with pytest.raises(FileNotFoundError, match="planted"):  # it calls torch.load on the path it names
        pickle.loads(raw_pickle(payload("torch.serialization.load", marker), 2))


# --------------------------------------------------------------------------- the readers


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", GLOBALS)
def test_dcp_metadata_is_read_through_an_allowlist(name, protocol, marker, tmp_path):
    file = str(tmp_path / ".metadata")
    plant(str(tmp_path), ".metadata", raw_pickle(payload(name, marker), protocol))
    with pytest.raises(CheckpointError) as e:
        load_dcp_metadata(file)
    _refused(e, file, name, marker)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", GLOBALS)
def test_torch_files_are_read_as_data(name, protocol, marker):
    content = {"extra": {"sched": {"lr": [payload(name, marker)]}}, "rng": None}
    for data in (torch_file(content, protocol), raw_pickle(content, protocol)):
        with pytest.raises(CheckpointError) as e:
            load_torch_file(data, "extras.1.pt")
        _refused(e, "extras.1.pt", name, marker)


@pytest.mark.parametrize("protocol", [2, 4])
def test_numpy_arrays_are_not_data_in_a_torch_file(protocol):
    with pytest.raises(CheckpointError, match=r"extras\.0\.pt.*numpy\._core\.multiarray\._reconstruct"):
        load_torch_file(torch_file({"extra": {"x": np.ones(3)}, "rng": None}, protocol), "extras.0.pt")


def test_an_admitted_class_loads_and_nothing_else_does():
    from fractions import Fraction

    data = torch_file({"size": torch.Size([3]), "frac": Fraction(1, 3)})
    with pytest.raises(CheckpointError, match=r"f: names the global fractions\.Fraction"):
        load_torch_file(data, "f")
    assert load_torch_file(data, "f", [Fraction]) == {"size": torch.Size([3]), "frac": Fraction(1, 3)}


def test_dcp_s_checkpoint_exception_becomes_one_checkpoint_error_for_every_rank():
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from zerofn.checkpoint._load import dcp_failure

    assert not issubclass(CheckpointException, Exception)  # why it must be caught by name
    planted = CheckpointError("__1_0.distcp (entry 'master/w'): names the global posix.system")
    failures = {1: (planted, traceback.StackSummary()), 3: (ValueError("later"), traceback.StackSummary())}
    error = dcp_failure("/ck", CheckpointException("read", failures))
    assert isinstance(error, CheckpointError) and error.__cause__ is planted
    assert str(error) == "/ck: rank 1: __1_0.distcp (entry 'master/w'): names the global posix.system"
    other = dcp_failure("/ck", CheckpointException("read", {0: (KeyError("k"), traceback.StackSummary())}))
    assert str(other) == "/ck: reading the shards failed on rank 0: KeyError: 'k'"


# --------------------------------------------------------------------------- DCP's metadata, checked


def _metadata_dir(tmp_path, storage: dict, entries: dict, files: tuple[str, ...]) -> str:
    """A checkpoint directory with a hand-made ``.metadata`` and ``zerofn.json`` listing ``files``."""
    from torch.distributed.checkpoint.metadata import Metadata

    directory = tmp_path / "ck"
    directory.mkdir()
    plant(str(directory), ".metadata", pickle.dumps(Metadata(entries, storage_data=storage)))
    for name in files:
        if not (directory / name).exists():
            plant(str(directory), name, b"")
    plant(str(directory), "zerofn.json", b'{"files": {}}')
    reseal(str(directory), add=(".metadata", *files))
    return str(directory)


def _tensor_entry(n: int) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([n]))
    return TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([n]), [chunk])


@pytest.mark.parametrize(
    "where, expect",
    [
        ("../outside.distcp", "not a shard file zerofn.json lists"),
        ("__7_0.distcp", "not a shard file zerofn.json lists"),  # in the folder, not listed
        ("/etc/passwd", "not a shard file zerofn.json lists"),
    ],
)
def test_dcp_entries_are_read_only_from_the_listed_shard_files(tmp_path, where, expect):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from zerofn.checkpoint._reader import read_dcp_metadata

    storage = {MetadataIndex("master/w", [0]): _StorageInfo(where, 0, 10)}
    path = _metadata_dir(tmp_path, storage, {"master/w": _tensor_entry(4)}, ("__0_0.distcp",))
    with pytest.raises(CheckpointError, match=expect) as e:
        read_dcp_metadata(path, read_meta(path, True)["files"])
    assert "master/w" in str(e.value)


def test_a_bytes_entry_is_refused_before_dcp_would_unpickle_it(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from zerofn.checkpoint._reader import read_dcp_metadata

    storage = {MetadataIndex("optim/w/exp_avg"): _StorageInfo("__0_0.distcp", 0, 10)}
    path = _metadata_dir(tmp_path, storage, {"optim/w/exp_avg": BytesStorageMetadata()}, ("__0_0.distcp",))
    with pytest.raises(CheckpointError, match=r"'optim/w/exp_avg' is a BytesStorageMetadata, not a tensor"):
        read_dcp_metadata(path, read_meta(path, True)["files"])


def test_the_rank_metadata_dcp_falls_back_to_is_read_as_data_too(tmp_path, marker):
    from zerofn.checkpoint._reader import read_dcp_metadata

    path = _metadata_dir(tmp_path, {}, {}, ())
    plant(path, ".metadata", b"not a pickle")  # torch's reader would fail here and fall back to __0.metadata
    plant(path, "__0.metadata", raw_pickle(payload("builtins.eval", marker), 4))
    reseal(path, add=("__0.metadata",))
    with pytest.raises(CheckpointError) as e:
        read_dcp_metadata(path, read_meta(path, True)["files"])
    _refused(e, "__0.metadata", "builtins.eval", marker)


@pytest.mark.parametrize("name", ["../outside", "/tmp/x", "sub/file", "zerofn.json"])
def test_zerofn_json_lists_only_files_of_the_folder(tmp_path, name):
    directory = tmp_path / "ck"
    directory.mkdir()
    plant(str(directory), "zerofn.json", json.dumps({"files": {name: {"bytes": 0, "sha256": ""}}}).encode())
    with pytest.raises(CheckpointError, match="not a file of the checkpoint's own directory"):
        read_meta(str(directory), True)


def test_a_listed_file_that_is_a_symlink_is_refused(tmp_path):
    directory = tmp_path / "ck"
    directory.mkdir()
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", directory / "__0_0.distcp")
    plant(str(directory), "zerofn.json", b'{"files": {"__0_0.distcp": {"bytes": 1, "sha256": ""}}}')
    with pytest.raises(CheckpointError, match="is a symlink"):
        read_meta(str(directory), True)


# --------------------------------------------------------------------------- extras of format 1

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "v2_partition_bf16_n2")


def _format1_read(tmp_path, content: Any) -> Any:
    """``_extras.read`` of the format-1 fixture with ``extras.0.pt`` replaced by ``content``."""
    from zerofn.checkpoint import _extras
    from zerofn.checkpoint._manifest import Manifest

    path = str(tmp_path / "v2")
    shutil.copytree(FIXTURE, path)
    if content is not None:
        plant(path, "extras.0.pt", torch_file(content))
        reseal(path)
    meta = read_meta(path, True)
    return _extras.read(path, Manifest.from_json(meta), meta["files"], None, True, 0, 2)


def test_a_format1_rng_key_loads_through_numpy_s_array_globals(tmp_path):
    restore = _format1_read(tmp_path, None)
    name, key, *_ = restore.rng["numpy"]
    assert name == "MT19937" and key.dtype == np.uint32 and key.shape == (624,)


def test_a_numpy_array_outside_the_format1_rng_key_is_refused(tmp_path):
    original = torch.load(os.path.join(FIXTURE, "extras.0.pt"), weights_only=False)  # the fixture: trusted
    # An array of the RNG key's dtype passes torch's allowlist of NumPy's globals; its place does not.
    content = {"extra": original["extra"], "rng": {**original["rng"], "torch": np.zeros(3, dtype=np.uint32)}}
    with pytest.raises(CheckpointError, match=r"extras\.0\.pt: names the global numpy\._core\.multiarray\._recons"):
        _format1_read(tmp_path, content)
    content["rng"]["torch"] = np.zeros(3)  # another dtype: not even one of the admitted globals
    with pytest.raises(CheckpointError, match=r"extras\.0\.pt: not data"):
        _format1_read(tmp_path / "again", content)


# --------------------------------------------------------------------------- Lightning's file


def test_lightning_files_are_read_as_data_by_both_strategies(tmp_path, marker):
    pytest.importorskip("lightning")
    from zerofn.lightning import ZeroStrategy, ZeroTrainerStrategy

    file = str(tmp_path / "full.ckpt")
    plant(str(tmp_path), "full.ckpt", torch_file({"state_dict": {}, "loops": payload("posix.system", marker)}))
    for load in (
        lambda **kw: ZeroStrategy().load_checkpoint(file, **kw),
        lambda **kw: ZeroTrainerStrategy().load_checkpoint(file, **kw),
    ):
        with pytest.raises(CheckpointError) as e:
            load()
        _refused(e, file, "posix.system", marker)
        with pytest.raises(ValueError, match="weights_only=False would unpickle"):
            load(weights_only=False)
    assert not os.path.exists(marker)


def test_the_lightning_strategies_take_the_opt_in_as_an_option(tmp_path):
    pytest.importorskip("lightning")
    from fractions import Fraction

    from zerofn.lightning import ZeroStrategy, ZeroTrainerStrategy

    file = str(tmp_path / "full.ckpt")
    plant(str(tmp_path), "full.ckpt", torch_file({"state_dict": {}, "ratio": Fraction(1, 3)}))
    for strategy in (ZeroStrategy, ZeroTrainerStrategy):
        with pytest.raises(CheckpointError, match=r"full\.ckpt: names the global fractions\.Fraction"):
            strategy().load_checkpoint(file)
        assert strategy(safe_globals=[Fraction]).load_checkpoint(file)["ratio"] == Fraction(1, 3)
