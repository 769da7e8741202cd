"""zerofn's pytest plugin, from a user's side: a test suite that knows nothing but the ``zerofn_world`` fixture.

One ``pytester`` session in a subprocess (exactly what a user's ``pytest`` run is: the
plugin arrives through the ``pytest11`` entry point, nothing is imported from zerofn's
tests) runs three user test files: one that passes, one whose rank raises (it must fail
with that rank's traceback) and one whose rank hangs (it must fail within its timeout,
with the stack the rank was stuck in).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch

from zerofn.testing import plugin

HANG_TIMEOUT_S = 3

USER_PASSES = """
import torch
import torch.distributed as dist


def test_all_reduce_sums_the_ranks(zerofn_world):
    def total(x):
        t = torch.full((2,), x * (dist.get_rank() + 1))
        dist.all_reduce(t)
        return dist.get_world_size(), t.tolist()

    assert zerofn_world(2).run(total, 1.5) == [(2, [4.5, 4.5])] * 2
    assert zerofn_world(2) is zerofn_world(2)  # one pool for the whole session
"""

USER_RAISES = """
import torch.distributed as dist


def check_my_shard():
    if dist.get_rank() == 1:
        raise ValueError("shard of 'w' is wrong on rank 1")
    return "ok"


def test_a_rank_raises(zerofn_world):
    zerofn_world(2).run(check_my_shard)
"""

USER_HANGS = f"""
import time

import torch.distributed as dist


def wait_for_a_peer_that_never_comes():
    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


def test_a_rank_hangs(zerofn_world):
    zerofn_world(2, timeout={HANG_TIMEOUT_S}).run(wait_for_a_peer_that_never_comes)
"""


def test_a_users_suite_passes_fails_with_the_ranks_traceback_and_fails_a_hang_in_time(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_passes=USER_PASSES, test_raises=USER_RAISES, test_hangs=USER_HANGS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--junitxml=report.xml", timeout=300)
    outcomes = {
        case.get("classname"): ("failed" if case.find("failure") is not None else "passed", float(case.get("time")))
        for case in ET.parse(pytester.path / "report.xml").getroot().iter("testcase")
    }
    assert {name: outcome for name, (outcome, _) in outcomes.items()} == {
        "test_passes": "passed",
        "test_raises": "failed",
        "test_hangs": "failed",
    }, result.stdout.str()
    # The rank that raised: its exception and its own traceback, down to the raising line.
    result.stdout.fnmatch_lines(
        [
            "*WorldError: 1 rank(s) failed (pool restarted):",
            "*--- rank 1: ValueError: shard of 'w' is wrong on rank 1",
            "*Traceback (most recent call last):",
            '*test_raises.py", line *, in check_my_shard',
            "*raise ValueError(\"shard of 'w' is wrong on rank 1\")",
        ]
    )
    # The rank that hung: stopped at its timeout, with the stack it was stuck in.
    result.stdout.fnmatch_lines(
        [
            f"*--- rank 1: WorkerHung: did not finish within {HANG_TIMEOUT_S}s (run_timeout); stopped after *s",
            "*Python stack of rank 1 when it was stopped:",
            '*File "*test_hangs.py", line * in wait_for_a_peer_that_never_comes',
        ]
    )
    stopped = float(re.search(r"stopped after ([0-9.]+)s", result.stdout.str()).group(1))
    assert HANG_TIMEOUT_S <= stopped < HANG_TIMEOUT_S + 5
    # The whole failing test (starting its own pool of 2 ranks included) takes far less
    # than the default timeout: the hang did not wait for it.
    assert outcomes["test_hangs"][1] < plugin.DEFAULT_TIMEOUT_S / 2


def test_the_plugin_is_registered_by_the_entry_point(pytestconfig: pytest.Config) -> None:
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "zerofn"]
    assert entry.value == "zerofn.testing.plugin"
    assert pytestconfig.pluginmanager.get_plugin("zerofn") is plugin


def test_zerofn_world_is_the_session_pools_and_checks_its_argument(zerofn_world: plugin.WorldPools) -> None:
    assert zerofn_world is plugin.pools()
    assert zerofn_world(2) is zerofn_world(2) and zerofn_world(2).world_size == 2
    assert zerofn_world(2).run_timeout == zerofn_world.timeout == plugin.DEFAULT_TIMEOUT_S
    with pytest.raises(TypeError, match=r"zerofn_world\(n\): n is a number of ranks, got '2'"):
        zerofn_world("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the timeout must be a positive number of seconds"):
        plugin.WorldPools(0)


def test_zerofn_threads_sets_each_ranks_intra_op_threads() -> None:
    assert plugin.pools().threads == 1  # the suite's default: ranks do not compete for cores
    pools = plugin.WorldPools(threads=2)
    try:
        assert pools(1).run(torch.get_num_threads) == [2]
    finally:
        pools.close()
    with pytest.raises(ValueError, match="threads must be a positive whole number, got 0"):
        plugin.WorldPools(threads=0)
