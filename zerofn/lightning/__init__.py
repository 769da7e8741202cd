"""zerofn inside Lightning: :class:`ZeroStrategy` for ``lightning.fabric.Fabric``.

Needs the optional extra ``zerofn[lightning]`` (``lightning==2.6.6``). Importing this
module registers the strategy with Fabric's registry, so that ``Fabric(strategy="zerofn")``
(ZeRO-2) and ``Fabric(strategy="zerofn_stage_1")`` work after ``import zerofn.lightning``::

    import lightning as L
    from zerofn.lightning import ZeroStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2))
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))

What the strategy overrides in Lightning, and why, is in :mod:`zerofn.lightning._fabric`;
the checkpoint layout in :mod:`zerofn.lightning._checkpoint`; which precisions it takes in
:mod:`zerofn.lightning._precision`. The guide: the docs' "Lightning" page.
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

__all__ = ["ZeroStrategy"]


def _register() -> None:
    """Put the strategy's names into Fabric's registry (once per process)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "zerofn" not in STRATEGY_REGISTRY:
        ZeroStrategy.register_strategies(STRATEGY_REGISTRY)


_register()
