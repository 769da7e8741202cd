"""The sharded checkpoint on disk: its metadata file, file hashes, and the atomic commit.

A save writes a new directory ``<path>.<token>/`` (files fsynced), records each file's size
and SHA-256 in ``zerofn.json``, and only then atomically repoints the symlink ``<path>`` at
it (``os.replace``) and removes the previous target. A process killed at any moment leaves
``<path>`` pointing at the last complete checkpoint. Reading checks presence, sizes and
(optionally) hashes before anything else. No collectives here: rank 0 writes and commits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

from zerofn.checkpoint._errors import CheckpointError

__all__ = ["FORMAT_VERSION", "META_FILE", "commit", "read_meta", "write_meta"]


# The version of both formats: the sharded checkpoint's zerofn.json and the full state dict's
# "zerofn" entry. A reader refuses any other.
FORMAT_VERSION = 1
META_FILE = "zerofn.json"

#: The version of the extras files' content (the manifest's ``extras_format``): 2 is data
#: only; 1 (manifests without the field) pickled NumPy's RNG key as an ``ndarray``.
EXTRAS_FORMAT = 2


def _fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, a replaced symlink) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_digest(path: str) -> str:
    """The SHA-256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def commit(path: str, target: str) -> None:
    """Rank 0: point the symlink ``path`` at ``target`` atomically, then drop the previous target."""
    previous = os.path.realpath(path) if os.path.islink(path) else None
    link = f"{target}.link"
    os.symlink(os.path.basename(target), link)
    os.replace(link, path)  # the commit: atomic on POSIX
    _fsync_dir(os.path.dirname(path))
    if previous and previous != target and os.path.isdir(previous):
        shutil.rmtree(previous, ignore_errors=True)


def read_meta(path: str, verify: bool) -> dict[str, Any]:
    """``zerofn.json`` of the checkpoint at ``path``, once every file it lists is present with
    its recorded size (and, with ``verify``, its SHA-256); else :class:`CheckpointError`.

    Every file listed is a plain file of ``path`` itself (a name without a directory, not a
    symlink): a load reads only those. The sizes and hashes catch a truncated or corrupted
    file, not a tampered one (whoever writes the files can rewrite them too)."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {META_FILE}: not a zerofn checkpoint, or an unfinished save") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e})") from None
    for name, info in meta["files"].items():
        if not isinstance(name, str) or name in ("", ".", "..", META_FILE) or os.path.basename(name) != name:
            raise CheckpointError(
                f"{path}: {META_FILE} lists a file {name!r} that is not a file of the checkpoint's own directory"
            )
        file = os.path.join(path, name)
        if os.path.islink(file):
            raise CheckpointError(f"{path}: file {name} is a symlink; a checkpoint's files are its own")
        if not os.path.exists(file):
            raise CheckpointError(
                f"{path}: file {name} is missing (written by one of the {meta['saved_world_size']} ranks)"
            )
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: file {name} has {size} bytes, {info['bytes']} were written: truncated")
        if verify and _file_digest(file) != info["sha256"]:
            raise CheckpointError(f"{path}: file {name} does not match its SHA-256: corrupt")
    return meta


def write_meta(target: str, meta: dict[str, Any]) -> None:
    """Rank 0: ``meta`` as ``zerofn.json`` in ``target``, with every file's size and SHA-256, fsynced.

    Called once every rank's files are complete (after DCP's save returned everywhere).
    """
    files = sorted(f for f in os.listdir(target) if not f.startswith("."))
    meta = {
        **meta,
        "files": {
            f: {"bytes": os.path.getsize(os.path.join(target, f)), "sha256": _file_digest(os.path.join(target, f))}
            for f in [*files, ".metadata"]
        },
    }
    meta_path = os.path.join(target, META_FILE)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(target)
