"""Reading a checkpoint's pickles as data: every global a file names is checked before it is used.

A pickle is a program: each global it names (``os.system``, ``builtins.eval``) is looked
up and may be called. A zerofn load therefore admits only globals named on a list, matched
by exact ``(module, name)`` pair (never a whole module), and refuses any other with a
:class:`~zerofn.checkpoint.CheckpointError` naming the file and the global, before that
global is looked up, so nothing it names runs.

Two readers, one rule:

- :func:`load_dcp_metadata`: DCP's ``.metadata`` (a bare pickle, which torch's own reader
  unpickles with ``pickle.load``), through :class:`_AllowlistUnpickler` admitting
  :data:`DCP_METADATA_GLOBALS`: DCP's metadata dataclasses and the torch types they hold.
- :func:`load_torch_file`: a ``torch.save`` file (the extras, a Lightning file) through
  torch's ``weights_only=True`` unpickler: tensors, numbers, strings, bools, ``None``,
  containers, dtypes, devices, plus exactly the globals the caller passes (``safe``),
  as torch's ``torch.serialization.safe_globals``.

No collectives.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import io
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch

from zerofn.checkpoint._errors import CheckpointError

__all__ = ["DCP_METADATA_GLOBALS", "data_only", "global_name", "load_dcp_metadata", "load_torch_file"]

_DCP = "torch.distributed.checkpoint.metadata"

#: What DCP's ``.metadata`` may name: its metadata dataclasses, the file reader's per-entry
#: record, and the torch values they hold (``torch.Size``, dtypes, the layout, a path). Each
#: either is a dataclass rebuilt field by field, or turns plain values into a value.
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name, from torch's own table
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory the save wrote to
        ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
        *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
    }
)


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """A global as Python 3 names it: pickles of protocol 0-2 use Python 2's names
    (``__builtin__.eval``, ``commands.Popen``), which unpickling maps as here."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def globals_named(data: bytes) -> list[str]:
    """Every global the pickle ``data`` names (``module.name``, Python 3's names), in order, read
    without unpickling: ``GLOBAL``/``INST`` carry the name, ``STACK_GLOBAL`` takes the two
    strings pushed (or fetched from the memo) before it. Concatenated pickles are read to
    the end. A torch zip file: its ``data.pkl``."""
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pkl = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            data = archive.read(pkl) if pkl is not None else b""
    found: list[str] = []
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        strings: list[Any] = []
        memo: dict[Any, Any] = {}
        for op, arg, _ in pickletools.genops(stream):
            if op.name in ("GLOBAL", "INST"):
                module, _, name = arg.partition(" ")
                found.append(".".join(_python3_name(module, name)))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(".".join(_python3_name(str(strings[-2]), str(strings[-1]))))
            elif op.name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = strings[-1] if strings else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(arg))
            elif isinstance(arg, str) and "UNICODE" in op.name:
                strings.append(arg)
            elif op.name == "STOP":
                break
    return found


def global_name(obj: Any) -> str:
    """``module.qualname`` of a class or function: how a pickle (and a manifest) names it."""
    return f"{obj.__module__}.{obj.__qualname__}"


def _forbidden(file: str, name: str, what: str = "global") -> CheckpointError:
    return CheckpointError(
        f"{file}: names the {what} {name}, which a zerofn load does not admit (a checkpoint is data: tensors, "
        "numbers, strings, containers); nothing it names was run and nothing changed. Do not load a checkpoint "
        "whose files you cannot account for"
    )


class _AllowlistUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the ``(module, name)`` pairs of ``allowed``.

    Every global a pickle names reaches :meth:`find_class` (``GLOBAL``, ``STACK_GLOBAL``,
    ``INST``, the extension registry's codes) before it is imported or called, so a
    refusal there means nothing the pickle names has run. Persistent ids (torch's tensor
    storages) are refused too: DCP's metadata holds none.
    """

    def __init__(self, file: IO[bytes], allowed: frozenset[tuple[str, str]], where: str) -> None:
        super().__init__(file)
        self._allowed, self._where = allowed, where

    def find_class(self, module: str, name: str) -> Any:
        if _python3_name(module, name) not in self._allowed:
            raise _forbidden(self._where, ".".join(_python3_name(module, name)))
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _forbidden(self._where, repr(pid)[:80], "persistent id")


def load_dcp_metadata(path: str) -> Any:
    """The object DCP's metadata file ``path`` holds, read through :data:`DCP_METADATA_GLOBALS`.

    Raises :class:`CheckpointError` naming the file and the global for any other global,
    and naming the file for a pickle that is not one (truncated, not a pickle).
    """
    try:
        with open(path, "rb") as f:
            return _AllowlistUnpickler(f, DCP_METADATA_GLOBALS, path).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: DCP's metadata cannot be read ({type(e).__name__}: {e})") from None


_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_torch_file(source: str | bytes, where: str, safe: Iterable[Any | tuple[Any, str]] = ()) -> Any:
    """``torch.load(source, weights_only=True)`` admitting exactly the globals ``safe`` lists.

    ``safe``: classes or functions (or ``(obj, "module.name")`` for an object a pickle names
    by another path), as for ``torch.serialization.safe_globals``. ``source``: a file path or
    the file's bytes. Loads on the CPU. Raises :class:`CheckpointError` naming ``where``
    and, when the file names one that is not admitted, the global.
    """
    try:
        with data_only(where, safe, source):
            if isinstance(source, bytes):
                return torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
            return torch.load(source, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing") from None
    except Exception as e:  # not a torch file, truncated, a tensor type that is gone
        raise CheckpointError(f"{where}: cannot be read ({type(e).__name__}: {_reason(e)})") from None


@contextlib.contextmanager
def data_only(
    where: str, safe: Iterable[Any | tuple[Any, str]] = (), source: str | bytes | None = None
) -> Iterator[None]:
    """Inside: every ``torch.load(weights_only=True)`` admits exactly ``safe`` beyond torch's data
    set, and its refusal (``pickle.UnpicklingError``) is a :class:`CheckpointError` naming
    ``where`` and the global (read from ``source``, the file's path or bytes, where torch's
    own message names none). Also for a load zerofn does not call itself (Lightning's file)."""
    safe = list(safe)
    try:
        with torch.serialization.safe_globals(safe), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)  # refused or read: either way
            yield
    except pickle.UnpicklingError as e:
        found = _UNSUPPORTED_GLOBAL.search(str(e))
        if found:
            module, _, name = found.group(1).rpartition(".")
            raise _forbidden(where, ".".join(_python3_name(module or "builtins", name))) from None
        data = _read_bytes(source) if isinstance(source, str) else source
        name = refused_global(data, safe) if data is not None else None  # torch stopped at an opcode first
        if name is not None:
            raise _forbidden(where, name) from None
        raise CheckpointError(f"{where}: not data a zerofn load reads ({_reason(e)})") from None


def refused_global(data: bytes, safe: Iterable[Any | tuple[Any, str]] = ()) -> str | None:
    """The first global the torch file (or pickle) ``data`` names that ``torch.load(weights_only=True)``
    does not admit with ``safe``, or ``None``: what a refusal names when torch's own message
    does not (it stops at an opcode it does not take before it reaches the global)."""
    torch_admits: set[str] | None
    try:
        from torch import _weights_only_unpickler as wou

        torch_admits = set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())
    except (ImportError, AttributeError):  # torch's private table moved: name the first global outside torch
        torch_admits = None
    caller_admits = {global_name(g) if not isinstance(g, tuple) else g[1] for g in safe}
    try:
        named = globals_named(data)
    except Exception:  # not a pickle one can read to its end: nothing to name
        return None
    for name in named:
        admitted = name.startswith("torch.") if torch_admits is None else name in torch_admits
        if not admitted and name not in caller_admits:
            return name
    return None


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _reason(error: BaseException) -> str:
    """torch's weights-only error without its advice to load with ``weights_only=False``."""
    text = str(error)
    for marker in ("WeightsUnpickler error: ", "Unpickler error: "):
        if marker in text:
            text = text.split(marker, 1)[1]
    return " ".join(text.split("\n\n")[0].split())[:300]
