"""Which of Lightning's precision plugins the strategies take, and the ``"16-mixed"`` swap.

Fabric's and the Trainer's plugins are different classes with the same names and
meanings; the functions here take the set to judge by (:data:`FABRIC`, :data:`TRAINER`).

- ``"32-true"`` (``Precision``), ``"bf16-mixed"`` (``MixedPrecision``: autocast to bfloat16
  over float32 params) and ``"bf16-true"`` (``HalfPrecision``: the model cast to bfloat16;
  zerofn keeps float32 master shards unless ``master_weights=False``) run as with DDP.
- ``"16-mixed"`` (autocast to float16 over float32 params) runs with zerofn's dynamic loss
  scaler, never with a ``GradScaler``: a ``GradScaler`` looks for ``inf`` in the gradients
  it holds and decides alone whether to skip the step, but at stage 2 a rank holds only
  its shards, so ranks could disagree and their params drift apart. zerofn's scaler
  decides with one all-reduced flag: every rank skips, or none. Lightning builds
  ``MixedPrecision("16-mixed")`` with a fresh ``GradScaler`` of torch's default settings;
  that one never ran, so the strategy replaces the plugin by one without a scaler and
  scales with its own settings (``ZeroStrategy(initial_scale=..., growth_interval=...)``).
  A ``GradScaler`` with other settings, or one that already ran, is refused.
- Everything else (``"16-true"``, ``"64-true"``, transformer-engine, bitsandbytes, a
  plugin subclass) is refused at setup, saying what to write instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.pytorch.plugins import precision as trainer_precision

__all__ = ["FABRIC", "TRAINER", "PluginKinds", "check_precision", "is_fp16_mixed", "swap_grad_scaler"]


class PluginKinds(NamedTuple):
    """One Lightning flavour's precision plugin classes, and how its users name things in messages."""

    precision: type  # "32-true"
    mixed: type  # "16-mixed" / "bf16-mixed"
    half: type  # "16-true" / "bf16-true"
    entry: str  # what sets precision=: "Fabric" or "Trainer"
    strategy: str  # the strategy's class name


FABRIC = PluginKinds(
    fabric_precision.Precision,
    fabric_precision.MixedPrecision,
    fabric_precision.HalfPrecision,
    "Fabric",
    "ZeroStrategy",
)
TRAINER = PluginKinds(
    trainer_precision.Precision,
    trainer_precision.MixedPrecision,
    trainer_precision.HalfPrecision,
    "Trainer",
    "ZeroTrainerStrategy",
)

_SUPPORTED = "'32-true', 'bf16-mixed', 'bf16-true' or '16-mixed'"

# The GradScaler settings that say "built by Lightning for precision='16-mixed'" (torch's defaults).
_SCALER_DEFAULTS = {"_init_scale": 2.0**16, "_growth_factor": 2.0, "_backoff_factor": 0.5, "_growth_interval": 2000}


def _is_default_fresh_scaler(scaler: Any) -> bool:
    """A ``GradScaler`` with torch's default settings that never scaled anything."""
    if not isinstance(scaler, torch.amp.GradScaler):
        return False
    settings_default = all(getattr(scaler, k, None) == v for k, v in _SCALER_DEFAULTS.items())
    return settings_default and getattr(scaler, "_scale", None) is None and scaler.is_enabled()


def swap_grad_scaler(plugin: Any, kinds: PluginKinds = FABRIC) -> Any:
    """``plugin``, or for ``MixedPrecision("16-mixed")`` with a fresh default ``GradScaler`` the same plugin without it.

    Anything else is returned as it is (and judged by :func:`check_precision` at setup).
    """
    if is_fp16_mixed(plugin, kinds) and _is_default_fresh_scaler(plugin.scaler):
        swapped = kinds.mixed("16-mixed", device=plugin.device)
        swapped.scaler = None  # zerofn's loss scaler takes its place (ZeroOptimizer.backward scales the loss)
        return swapped
    return plugin


def is_fp16_mixed(plugin: Any, kinds: PluginKinds = FABRIC) -> bool:
    """Whether ``plugin`` is ``"16-mixed"`` (autocast to float16): zerofn's dynamic loss scaler is then on."""
    return isinstance(plugin, kinds.mixed) and plugin.precision == "16-mixed"


def check_precision(plugin: Any, who: str, kinds: PluginKinds = FABRIC) -> None:
    """Raise ``ValueError`` unless ``plugin`` is one the strategy runs (see the module docstring).

    The plugin's class must be one of ``kinds`` exactly: a subclass may change what the
    strategy relies on (its backward, its optimizer step).
    """
    kind = type(plugin)
    if kind is kinds.precision:
        return
    if kind is kinds.mixed:
        if plugin.precision == "bf16-mixed":
            return
        if plugin.scaler is None:
            return
        scaler = plugin.scaler
        settings = ", ".join(f"{k.lstrip('_')}={getattr(scaler, k, None)!r}" for k in _SCALER_DEFAULTS)
        raise ValueError(
            f"{who}: precision='16-mixed' came with a torch GradScaler ({settings}, "
            f"{'already used' if getattr(scaler, '_scale', None) is not None else 'not the defaults'}). A GradScaler "
            "decides on each rank alone whether to skip a step, from the gradients that rank holds; with zerofn a rank "
            "holds only its shards, so ranks could disagree and their weights drift apart. zerofn's own loss scaler "
            f"decides for every rank at once. Drop the scaler ({kinds.entry}(precision='16-mixed') or "
            "MixedPrecision('16-mixed', device) without scaler=) and give its settings to the strategy: "
            f"{kinds.strategy}(initial_scale=..., growth_factor=..., backoff_factor=..., growth_interval=..., "
            "hysteresis=1) (hysteresis=1 backs off at every overflow, as GradScaler does)."
        )
    if kind is kinds.half and plugin.precision == "bf16-true":
        return
    name = getattr(plugin, "precision", None)
    instead = {
        "16-true": "precision='16-mixed' (float32 params, float16 autocast, zerofn's loss scaler) or 'bf16-true'",
        "64-true": "precision='32-true' (zerofn shards float32 and lower; float64 params are not a ZeRO use case)",
    }.get(name, f"one of {_SUPPORTED}")
    raise ValueError(
        f"{who}: precision {name!r} ({kind.__name__}) is not supported by zerofn's strategy; it runs {_SUPPORTED} "
        f"(the last with zerofn's loss scaler). Write {instead}."
    )
