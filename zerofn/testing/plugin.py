"""The pytest plugin: a ``zerofn_world`` fixture that hands a test real ``torch.distributed`` ranks.

Installing zerofn registers this module with pytest (the ``pytest11`` entry point named
``zerofn``), so any test suite in that environment can ask for ranks the way it asks for
``tmp_path``::

    import torch
    import torch.distributed as dist


    def test_all_reduce_sums_over_ranks(zerofn_world):
        def total():
            t = torch.ones(2)
            dist.all_reduce(t)
            return t

        for t in zerofn_world(3).run(total):  # one result per rank, in rank order
            assert t.tolist() == [3.0, 3.0]

``zerofn_world(n)`` is the session's :class:`~zerofn.testing.World` of ``n`` gloo ranks on
the CPU: started by the first test that asks for it and shared by every later one (a
property test pays the process start-up once, not once per example), closed when the
session ends. ``zerofn_world(n).run(fn, *args, **kwargs)`` calls ``fn`` on every rank at
once and returns the results by rank; ``fn`` reaches the workers by value (cloudpickle),
so it may be a closure or a lambda defined in the test.

A failing run fails the test with :class:`~zerofn.testing.WorldError`, whose message holds
every failing rank's traceback. A run that does not finish within the timeout fails the
same way: the ranks still running are stopped and reported as ``WorkerHung`` with the
Python stack each was stuck in. Either way the pool restarts before the next run.

The timeout, in seconds, is the ``zerofn_timeout`` ini option (default 120) or
``zerofn_world(n, timeout=10)`` for one test (a separate pool per timeout); a collective
stuck inside a run times out on its rank at the same limit. Each rank runs torch with one
intra-op thread unless the ``zerofn_threads`` ini option says otherwise
(``pytest -o zerofn_threads=2``). The hypothesis strategies that
draw the inputs sharding gets wrong are in :mod:`zerofn.testing.strategies`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from zerofn.testing._world import World

__all__ = ["DEFAULT_TIMEOUT_S", "WorldPools", "pools"]

DEFAULT_TIMEOUT_S = 120.0
_INI_TIMEOUT = "zerofn_timeout"
_INI_THREADS = "zerofn_threads"


class WorldPools:
    """The session's pools of gloo ranks, one per (world size, timeout); what ``zerofn_world`` is.

    Call it with a world size to get that pool: ``pools(3)`` is a :class:`World` of 3 ranks,
    the same object every time within the session.

    Args:
      timeout: the default limit, in seconds, of one ``run`` on a pool (and the process
        group's timeout), for calls that do not give their own.
      threads: intra-op threads per rank (``torch.set_num_threads``); 1 keeps ranks from
        competing for cores, more shows how torch's kernels split work on a wider rank.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S, threads: int = 1) -> None:
        if not timeout > 0:
            raise ValueError(f"zerofn_world: the timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"zerofn_world: threads must be a positive whole number, got {threads!r}")
        self.timeout = float(timeout)
        self.threads = threads
        self._pools: dict[tuple[int, float], World] = {}
        self._env: dict[int, dict[str, str]] = {}

    def set_env(self, world_size: int, env: Mapping[str, str]) -> None:
        """Give the workers of every pool of ``world_size`` ranks ``env`` on top of the session's
        environment (``World(env=...)``), e.g. ``{"ATEN_CPU_CAPABILITY": "default"}`` for
        torch's portable kernels on those ranks only.

        Raises:
          RuntimeError: a pool of that size exists already (its workers may have run with
            another environment); call this before the first test asks for one.
        """
        made = [world for (n, _), world in self._pools.items() if n == world_size]
        if made:
            raise RuntimeError(f"zerofn_world: set_env({world_size}, ...) after {made[0]!r} was made; call it first")
        self._env[world_size] = dict(env)

    def __call__(self, world_size: int, *, timeout: float | None = None) -> World:
        """The session's pool of ``world_size`` gloo ranks (started by its first ``run``).

        Args:
          world_size: ranks, >= 1.
          timeout: seconds one ``run`` may take before its unfinished ranks fail as
            ``WorkerHung`` (also the process group's timeout); default: the session's
            (``zerofn_timeout``). Each distinct timeout has its own pool.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"zerofn_world(n): n is a number of ranks, got {world_size!r}")
        limit = self.timeout if timeout is None else float(timeout)
        key = (world_size, limit)
        if key not in self._pools:
            self._pools[key] = World(
                world_size, timeout=limit, run_timeout=limit, threads=self.threads, env=self._env.get(world_size)
            )
        return self._pools[key]

    def __repr__(self) -> str:
        return f"WorldPools(timeout={self.timeout:g}, threads={self.threads}, open={sorted(self._pools)})"

    def close(self) -> None:
        """Close every pool (their worker processes exit)."""
        for world in self._pools.values():
            world.close()
        self._pools.clear()


_session: WorldPools | None = None
_owner: pytest.Config | None = None  # the session that made _session


def pools() -> WorldPools:
    """The running session's pools: ``pools()(n)`` is what ``zerofn_world(n)`` returns.

    For code that cannot take a fixture (a helper module, a hypothesis state machine).
    Outside a pytest session (no plugin configured), a process-wide set is made on first use.
    """
    global _session
    if _session is None:
        _session = WorldPools()
    return _session


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        _INI_TIMEOUT,
        "zerofn_world: seconds one run on a pool of ranks may take before it fails as hung "
        f"(also the process group's timeout); default {DEFAULT_TIMEOUT_S:g}",
        default=str(DEFAULT_TIMEOUT_S),
    )
    parser.addini(
        _INI_THREADS, "zerofn_world: intra-op threads per rank (torch.set_num_threads); default 1", default="1"
    )


def pytest_configure(config: pytest.Config) -> None:
    global _session, _owner
    raw: Any = config.getini(_INI_TIMEOUT)
    raw_threads: Any = config.getini(_INI_THREADS)
    try:
        timeout = float(raw)
        made = WorldPools(timeout)
    except ValueError:
        raise pytest.UsageError(f"{_INI_TIMEOUT} must be a positive number of seconds, got {raw!r}") from None
    try:
        made = WorldPools(timeout, int(raw_threads))
    except ValueError:
        raise pytest.UsageError(f"{_INI_THREADS} must be a positive whole number, got {raw_threads!r}") from None
    if _owner is None:  # a session run inside another one (pytester, in-process) keeps the outer pools
        _session, _owner = made, config


def pytest_unconfigure(config: pytest.Config) -> None:
    global _session, _owner
    if config is _owner and _session is not None:
        _session.close()
        _session, _owner = None, None


@pytest.fixture(scope="session")
def zerofn_world() -> WorldPools:
    """Pools of real gloo ranks: ``zerofn_world(n).run(fn, *args, **kwargs)`` -> ``fn``'s result on each rank.

    Session-scoped: ``zerofn_world(n)`` is the same started :class:`~zerofn.testing.World`
    for every test of the session. ``zerofn_world(n, timeout=s)`` bounds each run to ``s``
    seconds (default: the ``zerofn_timeout`` ini option, 120).
    """
    return pools()
