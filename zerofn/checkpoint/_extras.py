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

The extras are data (extras format 2): each ``state_dict()`` and the RNG states are saved
with ``torch.save`` holding only what ``torch.load(weights_only=True)`` reads (tensors,
numbers, strings, bools, ``None``, containers, dtypes, devices; the RNG as lists and
tensors, :mod:`zerofn.checkpoint._rng`) and loaded with ``weights_only=True``. A
``state_dict()`` holding anything else is refused at save, on every rank, naming the extra,
the key path and the type, unless the caller admits its classes by name with
``safe_globals=`` (as ``torch.serialization.safe_globals``); the globals the pickles then
need are recorded in the manifest (``pickled``), and a load needs the caller to admit each
of them again (the manifest only says what to ask for; it admits nothing). Format-1
files (a pickled NumPy ``ndarray`` in the RNG) load through exactly NumPy's
array-reconstruction globals, and only there.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn._comm import Group
from zerofn.checkpoint._errors import CheckpointError
from zerofn.checkpoint._format import EXTRAS_FORMAT
from zerofn.checkpoint._rng import check_format1_arrays, first_not_data, numpy_array_globals, rng_state, set_rng_state
from zerofn.checkpoint._unpickle import global_name, load_torch_file

if TYPE_CHECKING:
    from zerofn.checkpoint._manifest import Manifest

__all__ = ["ExtrasPayload", "apply", "capture", "read", "write"]


def extras_file(rank: int) -> str:
    """The file rank ``rank`` writes its extras and RNG to, in the checkpoint directory."""
    return f"extras.{rank}.pt"


def _serialized(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _as_data(key: str, state: Any, safe_globals: Sequence[Any]) -> tuple[bytes, list[str]]:
    """``state`` serialized, and the globals beyond torch's ``weights_only`` set its pickle names,
    once each is one the caller admitted; else :class:`CheckpointError` naming the extra, the
    key path and the type (or the global), before anything is written."""
    admitted = {g for g in safe_globals if isinstance(g, type)}
    found = first_not_data(state, "", admitted)
    if found is not None:
        where, kind = found
        raise CheckpointError(
            f"extra[{key!r}].state_dict(){where} is a {kind}, which is not data (tensors, numbers, strings, bools, "
            "None, dicts, lists, tuples, sets, dtypes, devices): return data from state_dict(), or admit the class "
            f"by name with safe_globals=[...] on save and on load (only for checkpoints you trust)"
        )
    blob = _serialized(state)
    needed = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob)))
    names = {global_name(g) if not isinstance(g, tuple) else g[1] for g in safe_globals}
    refused = [n for n in needed if n not in names]
    if refused:
        raise CheckpointError(
            f"extra[{key!r}].state_dict() pickles the global {refused[0]}, which safe_globals= does not admit: "
            "add it to safe_globals=[...] on save and on load, or return data from state_dict()"
        )
    return blob, needed


class ExtrasPayload(NamedTuple):
    """What a rank writes: its extras' and RNG's states, captured at the call."""

    states: dict[str, Any]  # key -> the object's state_dict(), deep-copied
    rng: dict[str, Any] | None  # rng_state(), or None (rng=False)
    same: dict[str, bool]  # key -> the state was the same on every rank (and "rng" when saved)
    pickled: tuple[str, ...] = ()  # the admitted globals some rank's states pickle (manifest: "pickled")


def capture(
    extra: Mapping[str, Any] | None, rng: bool, group: Group, where: str, safe_globals: Sequence[Any] = ()
) -> ExtrasPayload | None:
    """Every rank's extras' ``state_dict()`` and RNG, and whether each is the same on every rank.

    Returns ``None`` when there is nothing to save (no ``extra`` and ``rng=False``). Raises
    :class:`CheckpointError` on every rank when any rank's extras cannot be saved (an object
    without ``state_dict``/``load_state_dict``, a ``state_dict()`` that raises or holds
    something that is not data and that ``safe_globals`` does not admit, other keys than
    another rank's), before anything is written.

    Collectives: one object all-gather over ``group`` (each rank's keys and digests), even
    with nothing to save, so that a rank passing extras that the others do not raises
    instead of hanging.
    """
    extra = dict(extra or {})
    failure: str | None = None
    states: dict[str, Any] = {}
    digests: dict[str, str] = {}
    pickled: set[str] = set()
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
            blob, needed = _as_data(key, states[key], safe_globals)
            pickled.update(needed)
            digests[key] = hashlib.sha256(blob).hexdigest()
        rng_now = rng_state() if rng else None
        if rng_now is not None:
            digests["\0rng"] = hashlib.sha256(_serialized(rng_now)).hexdigest()
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    mine = (failure, digests, sorted(pickled))
    everyone: list[Any] = [mine] if comm.group_size(group) == 1 else comm_setup.all_gather_objects(mine, group)
    bad = next(((r, why) for r, (why, _, _) in enumerate(everyone) if why is not None), None)
    if bad is not None:
        raise CheckpointError(f"{where}: rank {bad[0]} could not save its extras ({bad[1]}), so no rank saved")
    keys = [sorted(d) for _, d, _ in everyone]
    if any(k != keys[0] for k in keys):
        raise CheckpointError(
            f"{where}: the ranks passed different extra= keys ("
            + ", ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
            + "); every rank must save the same extras"
        )
    if not digests:  # on every rank (the keys agree): nothing to save
        return None
    same = {k: all(d[k] == everyone[0][1][k] for _, d, _ in everyone) for k in digests}
    needed = tuple(sorted({n for _, _, names in everyone for n in names}))
    return ExtrasPayload(states, rng_now, {("rng" if k == "\0rng" else k): v for k, v in same.items()}, needed)


def write(target: str, rank: int, payload: ExtrasPayload) -> None:
    """This rank's extras file in the checkpoint directory ``target``, fsynced."""
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, extras_file(rank)), "wb") as f:
        torch.save({"extra": payload.states, "rng": payload.rng}, f)  # data: format EXTRAS_FORMAT
        f.flush()
        os.fsync(f.fileno())


def manifest_entries(payload: ExtrasPayload | None) -> dict[str, Any]:
    """The manifest's extras fields: ``extras`` (key -> the state was the same on every rank),
    ``rng`` (whether the RNG was; ``None``: not saved), ``pickled`` (the admitted globals the
    files name; ``None``: none)."""
    if payload is None:
        return {"extras": None, "rng": None, "pickled": None}
    return {
        "extras": {k: payload.same[k] for k in payload.states},
        "rng": payload.same.get("rng"),
        "pickled": payload.pickled or None,
    }


class ToRestore(NamedTuple):
    """What a load restores on this rank, read and checked before any tensor is read."""

    states: dict[str, Any]  # key -> the saved state_dict for the object of extra= under that key
    rng: dict[str, Any] | None  # the RNG states to set, or None (not saved, rng=False, or per rank at another N)


def read(
    path: str,
    saved: Manifest,
    files: Collection[str],
    extra: Mapping[str, Any] | None,
    rng: bool,
    rank: int,
    world_size: int,
    safe_globals: Sequence[Any] = (),
) -> ToRestore:
    """Check ``extra=`` against what was saved and read what this rank restores, as data.

    ``extra`` names exactly the saved extras (``None``: the checkpoint's extras are not
    restored); at another world size exactly those that were the same on every rank (one
    that differed is refused by name). The file is read with ``weights_only=True``,
    admitting the caller's ``safe_globals`` only, and only once they cover every global the
    manifest says the files pickle (``saved.pickled``; else refused before reading); a
    format-1 file admits NumPy's array globals for its RNG key only.
    Raises :class:`CheckpointError` naming the key, or the file and the global. No collectives.
    """
    saved_extras, saved_world_size = saved.extras, saved.saved_world_size
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
    wants_rng = rng and saved.rng is not None and (world_size == saved_world_size or saved.rng)
    if not extra and not wants_rng:
        return ToRestore({}, None)
    name = extras_file(rank if world_size == saved_world_size else 0)
    file = os.path.join(path, name)
    if name not in files:
        raise CheckpointError(f"{file}: the saved extras are not a file the checkpoint's zerofn.json lists")
    given = {global_name(g) if not isinstance(g, tuple) else g[1] for g in safe_globals}
    unadmitted = [n for n in saved.pickled or () if n not in given]
    if unadmitted:
        raise CheckpointError(
            f"{path}: its extras were saved with pickled objects ({list(saved.pickled or ())}), and safe_globals= "
            f"does not admit {unadmitted}: nothing was read. Pass those classes as safe_globals=[...] only if you "
            "trust whoever wrote this checkpoint; a checkpoint's own record never admits them"
        )
    if saved.extras_format not in (1, EXTRAS_FORMAT):
        raise CheckpointError(
            f"{path}: extras format {saved.extras_format!r}; this zerofn reads formats 1 and {EXTRAS_FORMAT}"
        )
    if saved.extras_format == 1:
        content = load_torch_file(file, file, [*safe_globals, *numpy_array_globals()])
        check_format1_arrays(content, file, {g for g in safe_globals if isinstance(g, type)})
    else:
        content = load_torch_file(file, file, safe_globals)
    if not isinstance(content, dict) or not isinstance(content.get("extra"), dict) or "rng" not in content:
        raise CheckpointError(f"{file}: not a zerofn extras file")
    absent = [k for k in extra or {} if k not in content["extra"]]
    if absent:
        raise CheckpointError(f"{file}: holds no state for extra {absent[0]!r}, which zerofn.json says was saved")
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
    everyone = (
        [failure is None] if comm.group_size(group) == 1 else comm_setup.all_gather_objects(failure is None, group)
    )
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
