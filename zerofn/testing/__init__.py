"""Public helpers for testing code built on zerofn: real ranks, hypothesis strategies, a pytest plugin.

``World`` keeps a pool of real ``torch.distributed`` ranks alive (gloo on the CPU by
default; NCCL or gloo on CUDA devices) and runs a function on all of them;
``strategies`` (needs ``hypothesis``) draws param dicts and world sizes that exercise
sharding's corner cases; ``plugin`` (needs ``pytest``) is the pytest plugin that installing
zerofn registers, whose ``zerofn_world`` fixture hands a test the session's pools:
``zerofn_world(3).run(fn, ...)``. ``float64_wire_hook`` is a DDP comm hook that makes a
DDP twin bitwise comparable with zerofn at any world size (zerofn on a float64 wire too).
"""

from zerofn.testing._wire import float64_wire_hook
from zerofn.testing._world import RankFailure, World, WorldError

__all__ = ["RankFailure", "World", "WorldError", "float64_wire_hook", "plugin", "strategies"]

# Imported only when asked for: hypothesis and pytest are test-time dependencies.
_LAZY = ("plugin", "strategies")


def __getattr__(name: str) -> object:
    if name in _LAZY:
        # import_module, not `from zerofn.testing import strategies`: the latter asks this
        # very __getattr__ for the not-yet-imported submodule and recurses forever.
        import importlib

        return importlib.import_module(f"zerofn.testing.{name}")
    raise AttributeError(name)
