"""Public helpers for testing code built on zerofn: real ranks and hypothesis strategies.

``World`` keeps a pool of real ``torch.distributed`` ranks alive (gloo on the CPU by
default; NCCL or gloo on CUDA devices) and runs a function on all of them;
``strategies`` (needs ``hypothesis``) draws param dicts and world sizes that exercise
sharding's corner cases.
"""

from zerofn.testing._world import RankFailure, World, WorldError

__all__ = ["RankFailure", "World", "WorldError", "strategies"]


def __getattr__(name: str) -> object:
    # hypothesis is a test-time dependency: import the strategies only when asked for.
    if name == "strategies":
        # import_module, not `from zerofn.testing import strategies`: the latter asks this
        # very __getattr__ for the not-yet-imported submodule and recurses forever.
        import importlib

        return importlib.import_module("zerofn.testing.strategies")
    raise AttributeError(name)
