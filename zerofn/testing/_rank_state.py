"""What a pool's worker puts back before every run: torch's global settings and the random generators.

A pool reuses its ranks, so a global setting that one run leaves behind would reach every
later run on that rank, and a result would depend on which runs came before it: under
pytest-xdist, on how the machine's load spread the tests over the workers. Each worker
therefore records :class:`RankState` once it is ready (group up, ``threads`` set, ``init``
run) and restores it before every run. A run starts from the state the pool was started
with, whatever ran before it.

Restored, because each changes what the same code computes:

* torch's intra-op threads (``torch.set_num_threads``): a reduction over more than one
  grain of elements is split over the threads, so the order of its sum follows their number;
* the default dtype and device: what ``torch.tensor``, the factories and ``nn.Module``
  build (a float64 default turns a float32 model into a float64 one);
* deterministic algorithms (and their warn-only mode and ``fill_uninitialized_memory``), the
  float32 matmul precision, flushing denormals to zero, mkldnn on or off;
* grad mode, anomaly detection and CPU autocast, which a run may leave switched by calling
  ``torch.set_grad_enabled`` and the like instead of using them as context managers;
* torch's CPU generator (and the CUDA ones where they were initialised), Python's
  ``random`` and numpy's global generator: a run that draws without seeding gets the same
  numbers whatever ran before it.

Kept, because keeping them is what a pool is for: module globals and imports, the process
group, dynamo's compiled graphs (their guards check the settings above).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.deterministic

__all__ = ["RankState"]


def _denormals_flushed() -> bool:
    # No getter exists: with flushing on (FTZ and DAZ), a float32 denormal input reads as zero.
    return bool((torch.tensor([1e-40], dtype=torch.float32, device="cpu") * 1.0).item() == 0.0)


def _set_default_device(device: torch.device) -> None:
    # None removes the default-device mode that any other value installs; cpu is torch's own default.
    torch.set_default_device(None if device == torch.device("cpu") else device)


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _set_fill_uninitialized(value: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = value  # type: ignore[attr-defined]


def _set_mkldnn(value: bool) -> None:
    torch.backends.mkldnn.enabled = value  # type: ignore[assignment]


def _set_anomaly(value: tuple[bool, bool]) -> None:
    torch.set_anomaly_enabled(value[0], value[1])


def _set_autocast(value: tuple[bool, torch.dtype]) -> None:
    torch.set_autocast_enabled("cpu", value[0])
    torch.set_autocast_dtype("cpu", value[1])


#: (name, read, write) of every global setting a run starts from.
_SETTINGS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("intra-op threads", torch.get_num_threads, torch.set_num_threads),
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("default device", torch.get_default_device, _set_default_device),
    (
        "deterministic algorithms",
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        _set_deterministic,
    ),
    ("fill uninitialized memory", lambda: torch.utils.deterministic.fill_uninitialized_memory, _set_fill_uninitialized),
    ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("flush denormal", _denormals_flushed, torch.set_flush_denormal),
    ("mkldnn", lambda: torch.backends.mkldnn.enabled, _set_mkldnn),
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("anomaly detection", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()), _set_anomaly),
    ("cpu autocast", lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")), _set_autocast),
)


class RankState:
    """This process's global torch settings and generator states, recorded now; :meth:`restore` puts them back."""

    def __init__(self) -> None:
        self._settings = [(read, write, read()) for _, read, write in _SETTINGS]
        self._torch_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy_rng = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        """Every setting back to its recorded value (written only where it changed), every generator
        back to its recorded state."""
        for read, write, value in self._settings:
            if read() != value:
                write(value)
        torch.set_rng_state(self._torch_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        random.setstate(self._python_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self._numpy_rng is not None:
            numpy.random.set_state(self._numpy_rng)

    @staticmethod
    def names() -> tuple[str, ...]:
        """The settings restored, by name."""
        return tuple(name for name, _, _ in _SETTINGS)
