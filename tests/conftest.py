"""Shared fixtures: one persistent pool of real gloo ranks per world size.

Pools start on first use and live for the whole session, so a property test pays the
process start-up once, not once per example.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from zerofn.testing import World

# CI: fixed seeds and fewer examples, so a run is reproducible and fits the budget.
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

WORLD_SIZES = (1, 2, 3, 4)
# Intra-op threads per rank: 1 keeps ranks from competing for cores; the numerics checks
# also run with 2 (ZEROFN_TEST_THREADS=2), where torch's kernels split work differently.
THREADS = int(os.environ.get("ZEROFN_TEST_THREADS", "1"))
_pools: dict[int, World] = {}


def get_world(n: int) -> World:
    """The session's pool of ``n`` gloo ranks (started on first use)."""
    if n not in _pools:
        _pools[n] = World(n, timeout=60.0, threads=THREADS).start()
    return _pools[n]


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"N{n}")
def world(request: pytest.FixtureRequest) -> World:
    """Each test using this runs at world sizes 1, 2, 3 and 4."""
    return get_world(request.param)


@pytest.fixture(scope="session")
def worlds() -> dict[int, World]:
    """All four pools, for property tests that draw the world size."""
    return {n: get_world(n) for n in WORLD_SIZES}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pool in _pools.values():
        pool.close()
