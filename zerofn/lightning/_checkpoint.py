"""How Lightning's state (``{"model": model, "optimizer": optimizer, "step": 3}``) maps onto zerofn's checkpoints.

Two formats, chosen by ``ZeroStrategy(state_dict_type=...)``:

``"sharded"`` (default): one zerofn sharded checkpoint at ``path`` (a directory: a symlink
to the committed ``path.<token>/``, see :mod:`zerofn.checkpoint`). Every rank writes its
own shards of the optimizer state through DCP; the model the optimizer trains (its params
and persistent buffers) goes in the same checkpoint, written once; every other entry (an
LR scheduler, another module, a plain value such as a step counter) is one of the
checkpoint's ``extra=`` objects, saved by every rank. The state keys of the optimizer and
of its model are recorded in the name of one more extra (``zerofn.lightning [...]``), so a
load knows them before it reads anything. A load at another world size reshards; the
checkpoint's all-or-nothing rule holds: if anything does not fit, every rank raises
:class:`~zerofn.checkpoint.CheckpointError` and nothing changed.

``"full"``: Lightning's own file (``torch.save`` on rank 0, as with DDP), where the
optimizer entry is ``ZeroOptimizer.state_dict()``: torch's format, gathered on every rank
(a collective every rank runs: the rank-0-only ``consolidate_state_dict`` path is never
taken), loadable by a plain torch optimizer and by zerofn at any world size.

Both load as data, never as code: the sharded checkpoint as :func:`zerofn.checkpoint.load`
reads one, Lightning's file with ``torch.load(weights_only=True)`` (:func:`load_file`;
``weights_only=False`` is refused). The strategies' ``safe_globals`` option admits classes
beyond data by name, on save and on load. Lightning's own entries: loops, callbacks,
schedulers, counters and version strings are data; its hyper-parameters (an
``AttributeDict``) are saved as a plain ``dict`` of the same items (Lightning reads them
back as a mapping), and a value in them that is not data (an ``argparse.Namespace``, a
class) is refused at save, naming its key path and type, unless ``safe_globals`` admits it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.types import _Stateful

from zerofn.checkpoint import META_FILE, CheckpointError
from zerofn.checkpoint._unpickle import data_only
from zerofn.facade.optimizer import ZeroOptimizer

__all__ = ["is_sharded_checkpoint", "load_file", "load_sharded", "plain_hyperparameters", "save_sharded"]

# Lightning's entries that hold its AttributeDict of hyper-parameters.
_HPARAMS = ("hyper_parameters", "datamodule_hyper_parameters")

_KEYS_PREFIX = "zerofn.lightning "
_FROZEN = "zerofn.lightning frozen params"
_VALUE = "zerofn.lightning value"


class _Value:
    """A plain entry of the state (an int, a dict) as an ``extra=`` object; after a load, ``value`` holds it."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {_VALUE: self.value}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # A saved plain value comes back as itself; a saved object's state dict as that dict.
        self.value = state_dict[_VALUE] if set(state_dict) == {_VALUE} else dict(state_dict)


class _Frozen:
    """The model's params the optimizer does not train (``requires_grad=False``), which zerofn's weights leave out."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = dict(params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if set(state_dict) != set(self.params):
            raise KeyError(f"frozen params saved {sorted(state_dict)}, the model has {sorted(self.params)}")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state_dict[n])


def _frozen_params(zero: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """The params of the optimizer's model that the optimizer does not hold."""
    module = zero._module
    if module is None:
        return {}
    mine = {id(p) for p in zero._params.values()}
    return {n: p for n, p in module.named_parameters() if id(p) not in mine}


def _the_optimizer(state: Mapping[str, Any], who: str) -> tuple[str, ZeroOptimizer]:
    """The one ZeroOptimizer entry of ``state`` (several are refused: one checkpoint holds one sharded state)."""
    found = [(k, v) for k, v in state.items() if isinstance(v, ZeroOptimizer)]
    if len(found) != 1:
        raise ValueError(
            f"{who}: a sharded zerofn checkpoint holds one ZeroOptimizer; this state has {len(found)} "
            f"({[k for k, _ in found]}). Save each in its own fabric.save(path, ...) call."
        )
    return found[0]


def _module_key(state: Mapping[str, Any], zero: ZeroOptimizer) -> str | None:
    """The key under which ``state`` holds the model ``zero`` trains (``None``: it is not in the state)."""
    for k, v in state.items():
        if isinstance(v, torch.nn.Module) and v is zero._module:
            return k
    return None


def plain_hyperparameters(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with Lightning's hyper-parameters (``AttributeDict``, a ``dict`` subclass) as plain dicts."""
    return {k: dict(v) if k in _HPARAMS and isinstance(v, dict) else v for k, v in checkpoint.items()}


def load_file(load: Any, path: Any, safe_globals: tuple[Any, ...], weights_only: bool | None, who: str) -> Any:
    """Lightning's file through ``load(weights_only=True)``, admitting ``safe_globals`` only.

    Raises :class:`CheckpointError` naming the file and the global when it names one that
    is not data (on every rank: every rank reads the file), ``ValueError`` for
    ``weights_only=False``, which a zerofn strategy does not do.
    """
    if weights_only is False:
        raise ValueError(
            f"{who}: weights_only=False would unpickle {path} as code; zerofn's strategies load data only. Admit "
            "the classes the file needs by name with the strategy's safe_globals=[...] option instead"
        )
    with data_only(os.fspath(path), safe_globals, os.fspath(path)):
        return load(weights_only=True)


def save_sharded(path: str, state: Mapping[str, Any], filter: Any, who: str, safe_globals: tuple[Any, ...]) -> None:
    """Save ``state`` (Lightning's, unwrapped) as one zerofn sharded checkpoint at ``path``; every rank calls it."""
    if filter:
        raise ValueError(
            f"{who}: fabric.save(..., filter=...) is not supported with the sharded checkpoint (zerofn saves whole "
            "params and their optimizer shards); use ZeroStrategy(state_dict_type='full') to filter."
        )
    key, zero = _the_optimizer(state, who)
    module_key = _module_key(state, zero)
    extra: dict[str, Any] = {}
    for k, v in state.items():
        if k in (key, module_key):
            continue
        if k.startswith("zerofn.lightning"):
            raise ValueError(f"{who}: state keys starting with 'zerofn.lightning' are reserved, got {k!r}")
        extra[k] = v if isinstance(v, _Stateful) else _Value(v)
    extra[_KEYS_PREFIX + json.dumps([key, module_key])] = _Value()
    frozen = _frozen_params(zero) if module_key is not None else {}
    if frozen:
        extra[_FROZEN] = _Frozen(frozen)
    zero.save_checkpoint(
        os.fspath(path), with_model=module_key is not None, extra=extra, rng=False, safe_globals=safe_globals
    )


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a zerofn sharded checkpoint (a directory with ``zerofn.json``)."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, META_FILE))


def _saved_extras(path: str) -> dict[str, bool]:
    """The ``extra=`` names a checkpoint holds (from its ``zerofn.json``, before anything is read)."""
    with open(os.path.join(path, META_FILE)) as f:
        return dict(json.load(f).get("extras") or {})


def load_sharded(
    path: str, state: dict[str, Any], strict: bool, who: str, safe_globals: tuple[Any, ...]
) -> dict[str, Any]:
    """Restore ``state`` (Lightning's, unwrapped; changed in place) from :func:`save_sharded`'s checkpoint.

    Returns the saved entries ``state`` did not ask for (plain values, and the state dicts
    of saved objects), as Lightning's ``load_checkpoint`` does.
    """
    path = os.fspath(path)
    if not state:
        raise ValueError(
            f"{who}: {path} is a sharded zerofn checkpoint, which loads into the objects it restores: "
            "fabric.load(path, {'model': model, 'optimizer': optimizer, ...}) with the optimizer from fabric.setup"
        )
    saved = _saved_extras(path)
    keys = [n for n in saved if n.startswith(_KEYS_PREFIX)]
    if len(keys) != 1:
        raise CheckpointError(f"{who}: {path} was not saved by zerofn.lightning (no state keys recorded)")
    opt_key, module_key = json.loads(keys[0][len(_KEYS_PREFIX) :])
    key, zero = _the_optimizer(state, who)
    if key != opt_key:
        raise KeyError(f"{who}: the checkpoint holds the optimizer under {opt_key!r}, the state passes it as {key!r}")
    plain = {n for n in saved if not n.startswith("zerofn.lightning")}
    known = plain | {opt_key} | ({module_key} if module_key is not None else set())
    missing = [k for k in state if k not in known]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key '{missing[0]}' that does not exist in the loaded checkpoint."
            " To disable strict loading, set `strict=False`."
        )
    with_model = module_key is not None and module_key in state
    if with_model and state[module_key] is not zero._module:
        raise ValueError(
            f"{who}: state[{module_key!r}] is not the model the optimizer was set up with (fabric.setup(model, opt))"
        )
    holders: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name in saved:
        if name == _FROZEN:
            extra[name] = _Frozen(_frozen_params(zero)) if with_model else _Value()
        elif name in state and isinstance(state[name], _Stateful):
            extra[name] = state[name]
        else:
            extra[name] = holders[name] = _Value()
    zero.load_checkpoint(path, with_model=with_model, extra=extra, rng=False, safe_globals=safe_globals)
    remainder: dict[str, Any] = {}
    for name, holder in holders.items():
        if name.startswith("zerofn.lightning"):
            continue
        if name in state:
            state[name] = holder.value
        else:
            remainder[name] = holder.value
    return remainder
