"""Joining a group in bounded time: entry points that are collectives fail fast, naming the
ranks that did not arrive, instead of hanging until the process group's timeout."""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

from zerofn._comm import Group, group_size

__all__ = ["NotJoinedError", "join", "monitor_group"]


class NotJoinedError(RuntimeError):
    """Some ranks of a group did not reach a collective within the wait (:func:`join`).

    ``missing``: their group ranks when this rank could tell (group rank 0 learns every
    missing rank), else ``None`` (this rank waited for rank 0, which gave up or is missing).
    """

    def __init__(self, message: str, missing: list[int] | None) -> None:
        super().__init__(message)
        self.missing = missing


def monitor_group(group: Group) -> Group:
    """A group over ``group``'s ranks on which :func:`join` works (gloo's monitored barrier).

    ``group`` itself when it is gloo (or of one rank); otherwise a new gloo group over the
    same ranks (created by those ranks only: every member must call this, once, in the
    same order, e.g. when building an optimizer).
    """
    if group_size(group) == 1 or dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def join(group: Group, timeout_s: float) -> None:
    """Wait until every rank of ``group`` (a gloo group, :func:`monitor_group`) arrives, for at most ``timeout_s``.

    For entry points that are collectives, so that one called on some ranks only fails in
    bounded time instead of waiting for the process group's timeout inside its first
    collective. Raises :class:`NotJoinedError` naming the ranks that did not arrive (on
    group rank 0) or that rank 0 gave up (on the others).

    Collectives: one monitored barrier (each rank sends to rank 0, rank 0 answers each),
    none for a group of one.
    """
    if group_size(group) == 1:
        return
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        text = str(e)
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
        missing = [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else None
        raise NotJoinedError(text.splitlines()[0] if text else repr(e), missing) from e
