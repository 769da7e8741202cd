"""Collective entry points called on some ranks only fail in bounded time, saying what to write instead.

``state_dict()``, ``save_checkpoint``, ``load_checkpoint``, ``load_state_dict`` and
``check_params`` are collectives: every rank gathers, writes or checks its part. The most
common DDP save, ``if rank == 0: torch.save(opt.state_dict(), path)``, would leave rank 0
inside the facade's first gather until the process group's timeout (30 minutes by
default), then fail with a transport error that says nothing of the cause. Each of these
calls first waits, at most ``entry_timeout`` seconds (default 300, well under the group's
timeout), until every rank of the data-parallel world has called it too (gloo's monitored
barrier, on a gloo group over the same ranks when the group is NCCL), and otherwise raises
:class:`~zerofn._comm_join.NotJoinedError` naming the call, the ranks that did not join (group
rank 0 learns them; the others learn that rank 0 gave up) and what to write instead.

Cost: one monitored barrier per call (per group of a hybrid layout; its time on gloo:
docs/coming-from-ddp.md); nothing on the per-step path. ``entry_timeout=None`` turns it off.
"""

from __future__ import annotations

from zerofn import _comm as comm
from zerofn import _comm_join as comm_join

__all__ = ["ADVICE", "EntryGuard"]

ADVICE = {
    "state_dict": (
        "Write `sd = opt.state_dict()` on every rank, then save on rank 0 only (`if rank == 0: torch.save(sd, "
        "path)`); or `opt.save_checkpoint(path)` on every rank."
    ),
    "save_checkpoint": "Call `opt.save_checkpoint(path)` on every rank (each writes its shards; rank 0 commits).",
    "load_checkpoint": "Call `opt.load_checkpoint(path)` on every rank.",
    "load_state_dict": "Load the state dict on every rank: `opt.load_state_dict(torch.load(path))` everywhere.",
    "check_params": "Call `opt.check_params()` on every rank after editing the params.",
}
MESSAGE = (
    "ZeroOptimizer.{call}: this is a collective, and {who} did not call it within {timeout:g} s (entry_timeout), "
    "so it stopped here instead of waiting for the process group's timeout. {advice} Every rank must make the "
    "same calls in the same order."
)


class EntryGuard:
    """Waits for every rank at a collective entry point, at most ``timeout`` seconds (``None``: off).

    Args:
      groups: the groups the entry points communicate over (the shard group, and the
        replicas of a hybrid layout); monitor groups over the same ranks are made here,
        collectively (every member builds the optimizer), for groups that are not gloo.
      timeout: seconds to wait, or ``None``.
    """

    def __init__(self, groups: tuple[comm.Group, ...], timeout: float | None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"ZeroOptimizer: entry_timeout must be a number of seconds > 0 or None, got {timeout!r}")
        self.timeout = timeout
        self._groups = tuple(comm_join.monitor_group(g) for g in groups) if timeout is not None else ()

    def join(self, call: str) -> None:
        """Raise :class:`~zerofn._comm_join.NotJoinedError` unless every rank reaches ``call`` within the timeout."""
        if self.timeout is None:
            return
        for group in self._groups:
            try:
                comm_join.join(group, self.timeout)
            except comm_join.NotJoinedError as e:
                who = (
                    f"rank(s) {', '.join(str(r) for r in e.missing)} of the group"
                    if e.missing
                    else "group rank 0 (or another rank it waited for)"
                )
                raise comm_join.NotJoinedError(
                    MESSAGE.format(call=call, who=who, timeout=self.timeout, advice=ADVICE[call]), e.missing
                ) from e
