"""Training-state extras: the user's stateful objects and every rank's RNG, in the checkpoint.

``extra={"sched": scheduler, "loader": loader, ...}``: any object with ``state_dict()`` and
``load_state_dict()`` (the ``torch.distributed.checkpoint.stateful.Stateful`` protocol: LR
schedulers, torchdata's ``StatefulDataLoader``, a user's counters). And, unless
``rng=False``, the RNG of every rank: torch's CPU generator, the CUDA generators when the
process uses CUDA, Python's ``random``, NumPy's global generator when NumPy is imported.

The rule for world sizes: every rank saves its own (one file per rank,
``extras.<rank>.pt``, its size and SHA-256 in ``zerofn.json`` like every file), and the
manifest records, per extra and for the RNG, whether the state was the same on every rank.

- At the saved world size, rank ``r`` restores rank ``r``'s extras and RNG.
- At another world size, a state that was the same on every rank (an LR scheduler, a step
  counter, a world-size-free sampler position, an RNG seeded alike everywhere) is restored
  on every rank, from rank 0's file. An extra that differed between ranks (a data
  loader's worker state) has no meaning there: ``extra=`` must leave it out (naming it is
  a :class:`CheckpointError` on every rank before anything changes). An RNG that differed
  between ranks (seeded per rank) is left as it is: each rank keeps the generators it
  has, as at a fresh start at that world size.

A load is all or nothing: every check (keys, world size) runs before any tensor is read,
and the objects' ``load_state_dict`` runs once every rank has read and built its state; if
it raises on any rank, every rank puts back the state its objects had and raises.

The extras are pickled (``torch.save``) and unpickled with ``torch.load(weights_only=False)``:
load only checkpoints you trust, as with ``torch.load`` of a pickled object.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import random
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from zerofn import _comm as comm
from zerofn._comm import Group
from zerofn.checkpoint._errors import CheckpointError

__all__ = ["ExtrasPayload", "apply", "capture", "read", "rng_state", "set_rng_state", "write"]


def extras_file(rank: int) -> str:
    """The file rank ``rank`` writes its extras and RNG to, in the checkpoint directory."""
    return f"extras.{rank}.pt"


def rng_state() -> dict[str, Any]:
    """This process's RNG states: ``torch`` (CPU generator, uint8 tensor), ``cuda`` (one per
    device, when this process has initialized CUDA, else absent), ``python`` (``random.getstate()``),
    ``numpy`` (``numpy.random.get_state()``, only when NumPy is imported)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # a process that never used CUDA does not start it here
        out["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    return out


def set_rng_state(saved: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned. CUDA generators are restored when this process
    sees as many devices as the saver did (else left as they are); NumPy's when it was saved."""
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if saved.get("numpy") is not None:
        import numpy

        numpy.random.set_state(saved["numpy"])


def _digest(value: Any) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


class ExtrasPayload(NamedTuple):
    """What a rank writes: its extras' and RNG's states, captured at the call."""

    states: dict[str, Any]  # key -> the object's state_dict(), deep-copied
    rng: dict[str, Any] | None  # rng_state(), or None (rng=False)
    same: dict[str, bool]  # key -> the state was the same on every rank (and "rng" when saved)


def capture(extra: Mapping[str, Any] | None, rng: bool, group: Group, where: str) -> ExtrasPayload | None:
    """Every rank's extras' ``state_dict()`` and RNG, and whether each is the same on every rank.

    Returns ``None`` when there is nothing to save (no ``extra`` and ``rng=False``). Raises
    :class:`CheckpointError` on every rank when any rank's extras cannot be saved (an object
    without ``state_dict``/``load_state_dict``, a ``state_dict()`` that raises, other keys
    than another rank's), before anything is written.

    Collectives: one object all-gather over ``group`` (each rank's keys and digests), even
    with nothing to save, so that a rank passing extras that the others do not raises
    instead of hanging.
    """
    extra = dict(extra or {})
    failure: str | None = None
    states: dict[str, Any] = {}
    digests: dict[str, str] = {}
    try:
        for key, obj in extra.items():
            if not isinstance(key, str):
                raise CheckpointError(f"extra= keys are names (str), got {key!r}")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise CheckpointError(
                    f"extra[{key!r}] is a {type(obj).__name__}, which has no state_dict() and load_state_dict(): "
                    "pass an object that has both (torch.distributed.checkpoint.stateful.Stateful)"
                )
            states[key] = copy.deepcopy(obj.state_dict())
            digests[key] = _digest(states[key])
        rng_now = rng_state() if rng else None
        if rng_now is not None:
            digests["\0rng"] = _digest(rng_now)
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    everyone: list[Any] = (
        [(failure, digests)] if comm.group_size(group) == 1 else comm.all_gather_objects((failure, digests), group)
    )
    bad = next(((r, why) for r, (why, _) in enumerate(everyone) if why is not None), None)
    if bad is not None:
        raise CheckpointError(f"{where}: rank {bad[0]} could not save its extras ({bad[1]}), so no rank saved")
    keys = [sorted(d) for _, d in everyone]
    if any(k != keys[0] for k in keys):
        raise CheckpointError(
            f"{where}: the ranks passed different extra= keys ("
            + ", ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
            + "); every rank must save the same extras"
        )
    if not digests:  # on every rank (the keys agree): nothing to save
        return None
    same = {k: all(d[k] == everyone[0][1][k] for _, d in everyone) for k in digests}
    return ExtrasPayload(states, rng_now, {("rng" if k == "\0rng" else k): v for k, v in same.items()})


def write(target: str, rank: int, payload: ExtrasPayload) -> None:
    """This rank's extras file in the checkpoint directory ``target``, fsynced."""
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, extras_file(rank)), "wb") as f:
        torch.save({"extra": payload.states, "rng": payload.rng}, f)
        f.flush()
        os.fsync(f.fileno())


def manifest_entries(payload: ExtrasPayload | None) -> tuple[dict[str, bool] | None, bool | None]:
    """``(extras, rng)`` for the manifest: key -> the state was the same on every rank, and
    whether the RNG was (``None``: not saved)."""
    if payload is None:
        return None, None
    return {k: payload.same[k] for k in payload.states}, payload.same.get("rng")


class ToRestore(NamedTuple):
    """What a load restores on this rank, read and checked before any tensor is read."""

    states: dict[str, Any]  # key -> the saved state_dict for the object of extra= under that key
    rng: dict[str, Any] | None  # the RNG states to set, or None (not saved, rng=False, or per rank at another N)


def read(
    path: str,
    saved_extras: Mapping[str, bool] | None,
    saved_rng: bool | None,
    saved_world_size: int,
    extra: Mapping[str, Any] | None,
    rng: bool,
    rank: int,
    world_size: int,
) -> ToRestore:
    """Check ``extra=`` against what was saved and read what this rank restores.

    ``extra`` names exactly the saved extras (``None``: the checkpoint's extras are not
    restored); at another world size exactly those that were the same on every rank (one
    that differed is refused by name).
    Raises :class:`CheckpointError` naming the key. No collectives.
    """
    if extra is not None:
        saved_keys = set(saved_extras or {})
        # At another world size only the extras that were the same on every rank have a meaning.
        restorable = {k for k in saved_keys if world_size == saved_world_size or saved_extras[k]}  # type: ignore[index]
        per_rank = sorted(set(extra) & (saved_keys - restorable))
        if per_rank:
            raise CheckpointError(
                f"extra {per_rank[0]!r} differed between the {saved_world_size} ranks that saved it (per-rank "
                f"state, such as a data loader's workers): it restores only at world size {saved_world_size}, "
                f"not {world_size}; leave it out of extra= and rebuild it"
            )
        missing, unexpected = sorted(set(extra) - saved_keys), sorted(restorable - set(extra))
        if missing:
            saved_how = "without extra=" if saved_extras is None else f"with extras {sorted(saved_keys)}"
            raise CheckpointError(
                f"{path} holds no extra {missing[0]!r} (saved {saved_how}): pass the extras it was saved with"
            )
        if unexpected:
            raise CheckpointError(
                f"{path} holds extra {unexpected[0]!r}, which extra= does not name: pass every saved extra "
                f"({sorted(restorable)}), or extra=None to restore none of them"
            )
        for key, obj in extra.items():
            if not callable(getattr(obj, "load_state_dict", None)):
                raise CheckpointError(f"extra[{key!r}] is a {type(obj).__name__}, which has no load_state_dict()")
    wants_rng = rng and saved_rng is not None and (world_size == saved_world_size or saved_rng)
    if not extra and not wants_rng:
        return ToRestore({}, None)
    file = os.path.join(path, extras_file(rank if world_size == saved_world_size else 0))
    try:
        with open(file, "rb") as f:
            content = torch.load(f, weights_only=False)
    except Exception as e:  # a missing or unreadable file (a class the pickle names that is gone)
        raise CheckpointError(f"{file}: cannot read the saved extras ({type(e).__name__}: {e})") from e
    states = {k: content["extra"][k] for k in (extra or {})}
    return ToRestore(states, content["rng"] if wants_rng else None)


def apply(restore: ToRestore, extra: Mapping[str, Any] | None, group: Group, where: str) -> None:
    """Load the saved states into ``extra``'s objects, all or nothing across ``group``, then set the RNG.

    Each object's current state is kept first; if any rank's ``load_state_dict`` raises,
    every rank loads the kept states back and raises :class:`CheckpointError`.

    Collectives: one object all-gather over ``group`` (the verdicts), on every load, so that
    ranks passing different ``extra=`` cannot leave one waiting.
    """
    kept: dict[str, Any] = {}
    failure: Exception | None = None
    for key, state in restore.states.items():
        assert extra is not None
        try:
            kept[key] = copy.deepcopy(extra[key].state_dict())
            extra[key].load_state_dict(copy.deepcopy(state))
        except Exception as e:
            failure = CheckpointError(f"extra[{key!r}].load_state_dict failed: {type(e).__name__}: {e}")
            failure.__cause__ = e
            break
    everyone = [failure is None] if comm.group_size(group) == 1 else comm.all_gather_objects(failure is None, group)
    if not all(everyone):
        unrestored = []
        for key, state in kept.items():
            try:
                extra[key].load_state_dict(state)  # type: ignore[index]
            except Exception:  # the object refuses its own state too: say so, raise the first error
                unrestored.append(key)
        if unrestored:
            raise CheckpointError(
                f"{where}: rank {comm.group_rank(group)}: restoring the extras failed, and putting back the "
                f"state of extra {unrestored} failed too: rebuild those objects"
            ) from failure
        if failure is not None:
            raise failure
        bad = everyone.index(False)
        raise CheckpointError(
            f"{where}: rank {bad} could not load its extras, so no rank did; every rank's extras are as they were"
        )
    if restore.rng is not None:
        set_rng_state(restore.rng)
