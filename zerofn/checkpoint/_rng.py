"""Every rank's RNG states as data, and what a state dict may hold to be saved as data.

:func:`rng_state` returns torch's, CUDA's, Python's and NumPy's generators in a form that
``torch.load(weights_only=True)`` reads back (tensors, ints, floats, strings, tuples and
lists): NumPy's key, an ``ndarray`` in ``numpy.random.get_state()``, is kept as a list of
ints. Checkpoints of extras format 1 pickled that ``ndarray``; they load through
:data:`NUMPY_ARRAY_GLOBALS` (exactly NumPy's array-reconstruction globals), and
:func:`check_format1_arrays` refuses an array anywhere but in that one entry.

:func:`first_not_data` is the save-time walk that names the first value of a state dict
that is not data, by its key path and type. No collectives.
"""

from __future__ import annotations

import random
import sys
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

import torch

from zerofn.checkpoint._errors import CheckpointError

__all__ = ["check_format1_arrays", "first_not_data", "numpy_array_globals", "rng_state", "set_rng_state"]

# What a saved state may hold: torch's weights_only set (tensors, numbers, strings, bools,
# None, containers, dtypes, devices), by exact type, so a subclass (a namedtuple, a
# defaultdict, Lightning's AttributeDict) is not data unless the caller admits its class.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def first_not_data(value: Any, path: str = "", admitted: Collection[type] = ()) -> tuple[str, str] | None:
    """The first ``(key path, type name)`` in ``value`` that is not data, or ``None``.

    Data: the leaves above, plain tensors and dicts (``dict``, ``OrderedDict``), lists,
    tuples and sets of data. A value of an ``admitted`` class is accepted as it is (the
    caller opted in to pickling it; what its pickle names is checked separately).
    """
    kind = type(value)
    if kind in _LEAVES or kind in _TENSORS or kind in admitted:
        return None
    if kind in (dict, OrderedDict):
        for k, v in value.items():
            found = first_not_data(k, f"{path}[key {k!r}]", admitted) or first_not_data(v, f"{path}[{k!r}]", admitted)
            if found:
                return found
        return None
    if kind in (list, tuple, set):
        for i, v in enumerate(value):
            found = first_not_data(v, f"{path}[{i}]", admitted)
            if found:
                return found
        return None
    return path or "(the state itself)", f"{kind.__module__}.{kind.__qualname__}"


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as data: ``torch`` (CPU generator, uint8 tensor), ``cuda`` (one
    per device, when this process has initialized CUDA, else absent), ``python``
    (``random.getstate()``: a tuple of ints), ``numpy`` (``numpy.random.get_state()`` with its
    key as a list of ints, only when NumPy is imported)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # a process that never used CUDA does not start it here
        out["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        name, key, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        out["numpy"] = (str(name), [int(k) for k in key], int(pos), int(has_gauss), float(cached))
    return out


def set_rng_state(saved: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (or a format-1 file's state, whose NumPy key is an
    ``ndarray``). CUDA generators are restored when this process sees as many devices as the
    saver did (else left as they are); NumPy's when it was saved."""
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if saved.get("numpy") is not None:
        import numpy

        name, key, pos, has_gauss, cached = saved["numpy"]
        numpy.random.set_state((name, numpy.asarray(key, dtype=numpy.uint32), pos, has_gauss, cached))


def numpy_array_globals() -> list[tuple[Any, str]]:
    """What a format-1 extras file's pickled NumPy key names: ``_reconstruct``, ``ndarray``, ``dtype``
    and the key's dtype class (``uint32``), under NumPy 2's and NumPy 1's module paths. Nothing else."""
    import numpy

    reconstruct = numpy._core.multiarray._reconstruct if hasattr(numpy, "_core") else numpy.core.multiarray._reconstruct
    uint32 = type(numpy.dtype(numpy.uint32))
    return [
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (numpy.ndarray, "numpy.ndarray"),
        (numpy.dtype, "numpy.dtype"),
        (uint32, f"{uint32.__module__}.{uint32.__qualname__}"),
    ]


def check_format1_arrays(content: Any, file: str, admitted: Collection[type] = ()) -> None:
    """A format-1 extras file holds NumPy arrays in one place only: the key of ``rng["numpy"]``.

    Raises :class:`CheckpointError` naming the file and NumPy's ``_reconstruct`` for an array
    (or any other value that is not data) anywhere else, and for a NumPy entry that is not
    MT19937's ``(name, uint32 key, pos, has_gauss, cached_gaussian)``.
    """
    if not isinstance(content, dict) or set(content) != {"extra", "rng"}:
        raise CheckpointError(f"{file}: not a zerofn extras file (keys {sorted(content)!r})")
    rng = content["rng"]
    rest = dict(content)
    if isinstance(rng, dict) and rng.get("numpy") is not None:
        import numpy

        entry = rng["numpy"]
        ok = isinstance(entry, tuple) and len(entry) == 5 and isinstance(entry[1], numpy.ndarray)
        if not ok or entry[1].dtype != numpy.uint32 or entry[1].ndim != 1:
            raise CheckpointError(f"{file}: rng['numpy'] is not NumPy's MT19937 state")
        rest["rng"] = {**rng, "numpy": (entry[0], [], *entry[2:])}
    found = first_not_data(rest, "", admitted)
    if found is not None:
        where, kind = found
        name = "numpy._core.multiarray._reconstruct" if kind.startswith("numpy") else kind
        raise CheckpointError(
            f"{file}: names the global {name} at {where} (a {kind}), which a zerofn load admits only for NumPy's RNG "
            "key; nothing was restored and nothing changed"
        )
