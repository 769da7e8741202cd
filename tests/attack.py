"""Planted pickles for the tests of loading checkpoints someone else wrote (test_checkpoint_untrusted.py).

:func:`payload` builds an object whose pickle runs code when unpickled without an
allowlist: each writes a marker file, so a test can tell that nothing ran. :func:`plant`
overwrites a checkpoint's file and :func:`reseal` rewrites ``zerofn.json``'s sizes and
hashes, as whoever can write the checkpoint can.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import json
import os
import pickle
import subprocess
from typing import Any

import torch

#: The globals planted, by the name a pickle (and so the error) gives each.
GLOBALS = (
    "builtins.eval",
    "posix.system",
    "subprocess.Popen",
    "importlib.import_module",
    "functools.partial",
    "torch.serialization.load",
)


class _Call:
    """Unpickling this calls ``fn(*args)``: what any pickle can ask for."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def evil_module(marker: str) -> tuple[str, str]:
    """``(module name, source)`` of a module whose import writes ``marker``."""
    name = "zerofn_planted_" + hashlib.sha256(marker.encode()).hexdigest()[:12]
    return name, f"open({marker!r}, 'w').close()\n"


def payload(name: str, marker: str) -> Any:
    """An object whose unpickling writes ``marker`` through the global ``name`` (of :data:`GLOBALS`).

    ``importlib.import_module`` imports :func:`evil_module`'s module (written beside the
    marker, on ``sys.path`` when a test checks that the payload works); ``torch.load``
    loads a planted file beside the marker with ``weights_only=False`` semantics only
    where the caller has them: its refusal is what is checked.
    """
    touch = f"open({marker!r}, 'w').close()"
    if name == "builtins.eval":
        return _Call(eval, touch)
    if name == "posix.system":
        return _Call(os.system, f"touch {marker}")
    if name == "subprocess.Popen":
        return _Call(subprocess.Popen, ["touch", marker])
    if name == "importlib.import_module":
        return _Call(importlib.import_module, evil_module(marker)[0])
    if name == "functools.partial":
        return _Call(functools.partial(os.system, f"touch {marker}"))
    if name == "torch.serialization.load":
        return _Call(torch.load, marker + ".planted.pt")
    raise ValueError(name)


def torch_file(obj: Any, protocol: int = 2) -> bytes:
    """``torch.save(obj)``'s bytes, pickled with ``protocol``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=protocol)
    return buffer.getvalue()


def raw_pickle(obj: Any, protocol: int) -> bytes:
    return pickle.dumps(obj, protocol=protocol)


def plant(directory: str, name: str, data: bytes) -> None:
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


def reseal(directory: str, add: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> None:
    """Rewrite ``zerofn.json``'s ``files``: every listed file's size and SHA-256 as they are now
    (``add``: list more files; ``drop``: list fewer), as an attacker who can write it would."""
    path = os.path.join(directory, "zerofn.json")
    with open(path) as f:
        meta = json.load(f)
    names = (set(meta["files"]) | set(add)) - set(drop)
    meta["files"] = {}
    for n in sorted(names):
        with open(os.path.join(directory, n), "rb") as f:
            data = f.read()
        meta["files"][n] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(path, "w") as f:
        json.dump(meta, f)
