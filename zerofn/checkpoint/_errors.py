"""Checkpoint errors, and the rule that a load fails on every rank or on none."""

from __future__ import annotations

from zerofn import _comm as comm
from zerofn import _comm_setup as comm_setup
from zerofn._comm import Group

__all__ = ["CheckpointError", "raise_alike"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


def raise_alike(failure: Exception | None, groups: tuple[Group, ...], where: str) -> None:
    """Every rank learns every rank's verdict; if any rank failed, every rank raises.

    This rank raises its own error; the others a :class:`CheckpointError` naming the rank
    that failed and why. Called before anything has changed, so no rank has.

    Collectives: one object all-gather (``None`` or the error text) per group of size > 1.
    """
    for group in groups:
        if comm.group_size(group) == 1:
            continue
        everyone = comm_setup.all_gather_objects(
            None if failure is None else f"{type(failure).__name__}: {failure}", group
        )
        if failure is not None:
            raise failure
        bad = next(((r, why) for r, why in enumerate(everyone) if why is not None), None)
        if bad is not None:
            raise CheckpointError(
                f"{where}: rank {bad[0]} of the group could not load it ({bad[1]}), so no rank did; every rank "
                "must load the same checkpoint"
            )
    if failure is not None:
        raise failure
