"""Shared fixtures: the pools of real gloo ranks come from zerofn's own pytest plugin.

``zerofn_world`` (zerofn/testing/plugin.py, registered by the ``pytest11`` entry point)
keeps one pool per world size for the whole session, so a property test pays the process
start-up once, not once per example. ``get_world(n)`` is the same pool, for helpers and
hypothesis state machines that cannot take a fixture.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TEST_SEED
from hypothesis import HealthCheck, settings

from zerofn.testing import World, plugin

# pytester runs a user's suite against zerofn's plugin (tests/test_plugin.py).
pytest_plugins = ["pytester"]

# CI: fixed seeds and fewer examples, so a run is reproducible and fits the budget. The
# seed knob (``ZEROFN_TEST_SEED``, tests/helpers.py) moves hypothesis too: at 0 each test
# draws from its own name (derandomize), at k every test from hypothesis seed k
# (``pytest_configure`` below), and the example database stays out of it either way.
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=TEST_SEED == 0,
    database=None,
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

# The GPU check (tests/gpu) runs its bodies in this session: on CUDA where there is a GPU,
# and without one as its dry run, gloo on the CPU (tests/gpu/gpucheck.py), so it cannot rot
# on the machines without one. Only the checks of CUDA itself stay skipped there, each saying
# so. Set before tests/gpu is collected, which reads it at import; an explicit setting wins.
if not torch.cuda.is_available():
    os.environ.setdefault("ZEROFN_GPU_CHECK_DEVICE", "cpu")

#: The world size whose ranks run on torch's portable CPU kernels (``ATEN_CPU_CAPABILITY``,
#: no AVX2/AVX-512), while every other pool and this process keep the machine's own: one
#: pass of the suite sees two kernel families. The float-sensitive tests are bitwise by
#: construction or held to a bound from error analysis, so they must pass on either, and 3
#: is where their sums have more than two addends. ``make test-numerics`` runs the marked
#: set at 3 and 4 ranks with every rank, and this process, on the portable kernels.
PORTABLE_KERNELS_AT = 3
PORTABLE_KERNELS = os.environ.get("ZEROFN_PORTABLE_CPU_CAPABILITY", "default")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under ``ZEROFN_TEST_SEED=k`` (k > 0) hypothesis draws from seed k, unless
    ``--hypothesis-seed`` says otherwise (set before hypothesis' plugin reads it)."""
    if TEST_SEED and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(TEST_SEED)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any pool starts (after the plugin made the session's pools): the portable kernels
    at ``PORTABLE_KERNELS_AT`` ranks, unless the whole run is on them already."""
    if not os.environ.get("ATEN_CPU_CAPABILITY"):
        plugin.pools().set_env(PORTABLE_KERNELS_AT, {"ATEN_CPU_CAPABILITY": PORTABLE_KERNELS})


def _world_size(item: pytest.Item) -> int | None:
    """The world size a test item is parametrized with (fixture ``world`` or argument ``n``)."""
    params = getattr(item, "callspec", None) and item.callspec.params
    return (params.get("world") or params.get("n")) if params else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test-numerics`` (``ZEROFN_NUMERICS_RERUN``) runs the bitwise and bounded
    checks on torch's portable kernels at 3 and 4 ranks, where a sum has more than two
    addends: a sum of one or two does not depend on order, and `make test` checks those."""
    if not os.environ.get("ZEROFN_NUMERICS_RERUN"):
        return
    below_three = [item for item in items if _world_size(item) in (1, 2)]
    if below_three:
        config.hook.pytest_deselected(items=below_three)
        items[:] = [item for item in items if item not in below_three]


def get_world(n: int) -> World:
    """The session's pool of ``n`` gloo ranks: ``zerofn_world(n)``."""
    return plugin.pools()(n)


_reference_pools: dict[str, World] = {}


def reference_world(n: int) -> World:
    """A pool of one rank on the kernels of the session's pool of ``n``: a single-process
    reference for a bitwise comparison with ``n`` ranks runs on the kernels they run on.

    ``get_world(1)`` but for ``PORTABLE_KERNELS_AT``: a one-rank pool of its own, on the
    portable kernels (a fork from the fork server, so a fraction of a second to start).
    """
    if n != PORTABLE_KERNELS_AT or os.environ.get("ATEN_CPU_CAPABILITY"):
        return get_world(1)
    if "portable" not in _reference_pools:
        pools = plugin.pools()
        _reference_pools["portable"] = World(
            1,
            timeout=pools.timeout,
            run_timeout=pools.timeout,
            threads=pools.threads,
            env={"ATEN_CPU_CAPABILITY": PORTABLE_KERNELS},
        )
    return _reference_pools["portable"]


def pytest_sessionfinish(session: pytest.Session) -> None:
    for world in _reference_pools.values():
        world.close()
    _reference_pools.clear()


@pytest.fixture(params=WORLD_SIZES, ids=lambda n: f"N{n}")
def world(request: pytest.FixtureRequest, zerofn_world: plugin.WorldPools) -> World:
    """Each test using this runs at world sizes 1, 2, 3 and 4."""
    return zerofn_world(request.param)


@pytest.fixture(scope="session")
def worlds(zerofn_world: plugin.WorldPools) -> dict[int, World]:
    """All four pools, for property tests that draw the world size."""
    return {n: zerofn_world(n) for n in WORLD_SIZES}
