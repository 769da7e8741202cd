"""zerofn inside Lightning: :class:`ZeroStrategy` for Fabric, :class:`ZeroTrainerStrategy` for the Trainer.

Needs the optional extra ``zerofn[lightning]`` (``lightning==2.6.6``). Importing this
module registers both strategies, each with its own registry, so that
``Fabric(strategy="zerofn")`` and ``Trainer(strategy="zerofn")`` (ZeRO-2; ``"zerofn_stage_1"``
for ZeRO-1) work after ``import zerofn.lightning``. Both take the same zerofn options
(:class:`ZeroOptions`)::

    import lightning as L
    from zerofn.lightning import ZeroStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2))
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))

What the strategies override in Lightning, and why, is in :mod:`zerofn.lightning._fabric`
and :mod:`zerofn.lightning._trainer`; the checkpoint layout in :mod:`zerofn.lightning._checkpoint`;
which precisions they take in :mod:`zerofn.lightning._precision`. The guide: the docs' "Lightning" page.
"""

try:
    import lightning.fabric  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by a subprocess in tests/test_lightning.py
    raise ImportError(
        "zerofn.lightning needs Lightning, which is an optional extra of zerofn: "
        "pip install 'zerofn[lightning]' (it pins lightning==2.6.6; install torch first so that "
        f"pip keeps yours). The import failed with: {e}"
    ) from e

from zerofn.lightning._fabric import ZeroStrategy
from zerofn.lightning._options import ZeroOptions
from zerofn.lightning._trainer import ZeroTrainerStrategy

__all__ = ["ZeroOptions", "ZeroStrategy", "ZeroTrainerStrategy"]


def _register() -> None:
    """Put the strategies' names into Fabric's and the Trainer's registries (once per process)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if "zerofn" not in STRATEGY_REGISTRY:
        ZeroStrategy.register_strategies(STRATEGY_REGISTRY)
    if "zerofn" not in StrategyRegistry:
        ZeroTrainerStrategy.register_strategies(StrategyRegistry)


_register()
