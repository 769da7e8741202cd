"""Reading a sharded checkpoint's DCP files as data: the metadata, the entries, the files.

torch's ``FileSystemReader`` unpickles ``.metadata`` with a bare ``pickle.load`` (and, when
that fails, ``__<rank>.metadata``), and its ``DefaultLoadPlanner`` unpickles every entry the
metadata calls bytes with ``torch.load(weights_only=False)``. A zerofn load goes around
both:

- :func:`read_dcp_metadata` reads ``.metadata`` (and any other metadata file
  ``zerofn.json`` lists, such as a ``__<rank>.metadata``) through the allowlisting
  unpickler (:mod:`zerofn.checkpoint._unpickle`) before DCP starts, and checks what it
  says: tensor entries only (zerofn writes no bytes entries), chunks inside their tensors,
  every entry in a ``.distcp`` file that ``zerofn.json`` lists, no transforms.
- :class:`DataReader` hands DCP that checked metadata (so DCP reads no metadata file, and
  never falls back to another), and reads each entry with ``torch.load(weights_only=True)``
  from the listed file it names, refusing bytes entries.
- :class:`DataPlanner` checks that every key this rank reads is a tensor entry of the
  receiver's size and dtype (an entry relabelled as bytes, or another shape, is refused on
  every rank by name), and refuses to unpickle bytes.

No collectives of their own: DCP's, during ``dcp.load``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._unpickle import load_dcp_metadata, load_torch_file

__all__ = ["DataPlanner", "DataReader", "is_metadata_file", "read_dcp_metadata"]

_METADATA = re.compile(r"^(\.metadata|__\d+\.metadata)$")
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def is_metadata_file(name: str) -> bool:
    """DCP's global ``.metadata`` or a rank's ``__<rank>.metadata``."""
    return bool(_METADATA.match(name))


def read_dcp_metadata(path: str, files: Collection[str]) -> Metadata:
    """``path``'s DCP metadata, read as data and checked, before DCP starts.

    ``files``: the names ``zerofn.json`` lists (checked present, sizes and hashes, by
    :func:`zerofn.checkpoint._format.read_meta`). Every metadata file among them is read
    through the allowlist, the one DCP would fall back to included; ``.metadata`` is the
    one returned. Raises :class:`CheckpointError` naming the file and what is wrong.
    """
    if ".metadata" not in files:
        raise CheckpointError(f"{path}: zerofn.json lists no .metadata, which every sharded checkpoint has")
    found: dict[str, Any] = {}
    failures: list[CheckpointError] = []
    for name in sorted(files):
        if is_metadata_file(name):
            try:
                found[name] = load_dcp_metadata(os.path.join(path, name))
            except CheckpointError as e:
                failures.append(e)
    if failures:  # a planted global first: the file DCP would fall back to is read (as data) too
        raise next((e for e in failures if "names the" in str(e)), failures[0])
    for name, metadata in found.items():
        _check_metadata(metadata, os.path.join(path, name), {f for f in files if _SHARD_FILE.match(f)})
    return found[".metadata"]


def _check_metadata(metadata: Any, where: str, shard_files: Collection[str]) -> None:
    """What DCP's metadata must be for a zerofn load: tensor entries in listed shard files."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{where}: DCP's metadata has no table of entries and their files")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise CheckpointError(f"{where}: its storage_meta is a {type(metadata.storage_meta).__name__}")
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{where}: entry {key!r} is a {type(entry).__name__}, not a tensor: zerofn writes tensors only, "
                "and an entry DCP would unpickle (bytes) is refused"
            )
        _check_tensor_entry(key, entry, where)
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{where}: a storage record is a {type(info).__name__}, not DCP's _StorageInfo")
        name = info.relative_path
        if not isinstance(name, str) or name not in shard_files:
            raise CheckpointError(
                f"{where}: entry {index.fqn!r} is stored in {name!r}, which is not a shard file zerofn.json lists "
                "in the checkpoint's directory: a load reads only the files the checkpoint lists"
            )
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise CheckpointError(f"{where}: entry {index.fqn!r} has offset {info.offset!r}, length {info.length!r}")
        if info.transform_descriptors:
            raise CheckpointError(
                f"{where}: entry {index.fqn!r} is stored through transforms {list(info.transform_descriptors)!r}, "
                "which zerofn does not write"
            )


def _check_tensor_entry(key: str, entry: TensorStorageMetadata, where: str) -> None:
    """A tensor entry: a dtype, a size, and chunks of that rank that lie inside it."""
    size = entry.size
    if not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
        raise CheckpointError(f"{where}: entry {key!r} has no dtype")
    if not isinstance(size, torch.Size) or not isinstance(entry.chunks, list):
        raise CheckpointError(f"{where}: entry {key!r} has no size and chunks")
    for chunk in entry.chunks:
        ok = (
            isinstance(chunk, ChunkStorageMetadata)
            and isinstance(chunk.offsets, torch.Size)
            and isinstance(chunk.sizes, torch.Size)
            and len(chunk.offsets) == len(chunk.sizes) == len(size)
            and all(0 <= o and 0 <= s and o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, size, strict=True))
        )
        if not ok:
            raise CheckpointError(f"{where}: entry {key!r} (size {tuple(size)}) has a chunk outside it: {chunk!r}")


def check_receivers(state_dict: Mapping[str, Any], metadata: Metadata) -> None:
    """Every key this rank reads is a tensor entry of its receiver's size and dtype.

    A receiver is what the layout and the manifest say the key holds (a master shard as a
    DTensor over the flat param: its global size; a scalar; a model weight). Raises
    :class:`CheckpointError` naming the key.
    """
    for key, receiver in state_dict.items():
        entry = metadata.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(f"DCP's metadata has no entry {key!r}, which the checkpoint's zerofn.json describes")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"entry {key!r} is a {type(entry).__name__} in DCP's metadata, not a tensor")
        want, dtype = tuple(receiver.size()), receiver.dtype
        if tuple(entry.size) != want or entry.properties.dtype != dtype:
            raise CheckpointError(
                f"entry {key!r} is {tuple(entry.size)} {entry.properties.dtype} in DCP's metadata, but the "
                f"checkpoint's zerofn.json and the model make it {want} {dtype}"
            )


class DataPlanner(DefaultLoadPlanner):
    """DCP's default load planner that checks each key against its receiver and unpickles nothing."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is None:
            raise CheckpointError("DCP gave the planner no metadata")
        check_receivers(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"entry {read_item.dest_index.fqn!r} is bytes, which a zerofn load does not unpickle")


class DataReader(FileSystemReader):
    """DCP's file reader over ``path`` with the metadata :func:`read_dcp_metadata` checked.

    ``read_metadata`` returns that metadata (DCP reads no metadata file itself, so it never
    falls back to a ``__<rank>.metadata``); ``read_data`` reads each entry from the listed
    shard file it names with ``torch.load(weights_only=True)``, checks it is a tensor of the
    receiver's dtype, and refuses bytes entries.
    """

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._dir, self._metadata = path, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(None)  # the directory was checked: it stays the one read

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            file = os.path.join(self._dir, name)
            with open(file, "rb") as stream:
                for item in items:
                    self._read_item(stream, file, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, stream: Any, file: str, item: ReadItem, planner: LoadPlanner) -> None:
        where = f"{file} (entry {item.storage_index.fqn!r})"
        if item.type == LoadItemType.BYTE_IO:
            raise CheckpointError(f"{where}: a bytes entry, which a zerofn load does not unpickle")
        info: _StorageInfo = self.storage_data[item.storage_index]
        stream.seek(info.offset)
        blob = stream.read(info.length)
        if len(blob) != info.length:
            raise CheckpointError(f"{where}: {len(blob)} bytes where DCP's metadata says {info.length}: truncated")
        tensor = load_torch_file(blob, where)
        target = planner.resolve_tensor(item).detach()
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != target.dtype:
            found = f"a {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
            raise CheckpointError(f"{where}: holds {found}, the checkpoint says a {target.dtype} tensor")
        try:
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        except (IndexError, RuntimeError) as e:
            raise CheckpointError(f"{where}: the stored tensor has no such chunk ({e})") from None
        if tensor.size() != target.size():
            raise CheckpointError(f"{where}: a chunk of size {tuple(tensor.size())}, expected {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
