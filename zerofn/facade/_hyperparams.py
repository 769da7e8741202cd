"""The live hyperparameters: ``param_groups`` (what LR schedulers edit) read into the state.

``ZeroOptimizer.param_groups`` are torch's dicts (a wrapped torch optimizer's own groups);
every ``step``, ``state_dict`` and ``save_checkpoint`` reads them into the state's
functional optimizer (:func:`zerofn.torch_optim.with_live_hyperparams`, cached between
calls), and every load writes the loaded hyperparameters back into them, as torch's
``load_state_dict`` does. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerofn import optim, torch_optim
from zerofn.state import ZeroState

__all__ = ["LiveHyperparams"]


class LiveHyperparams:
    """Between ``param_groups`` and the state's functional optimizer.

    Args:
      wrapped: the wrapped torch optimizers (one, several, or none for a functional one).
      group_names: per param group, the names of its params (layout names).
    """

    def __init__(self, wrapped: Sequence[torch.optim.Optimizer], group_names: Sequence[Sequence[str]]) -> None:
        self._wrapped = list(wrapped)
        self._group_names = group_names
        self._cache: tuple[Any, ...] | None = None

    def apply(self, state: ZeroState, param_groups: list[dict[str, Any]]) -> ZeroState:
        """``state`` with the functional optimizer carrying the hyperparameters now in ``param_groups``."""
        # What the wrapped optimizers' own step would do for an LR scheduler built on one of them:
        # the scheduler then knows its optimizer stepped (torch warns otherwise, by this attribute).
        for wrapped in self._wrapped:
            wrapped._opt_called = True  # type: ignore[attr-defined]
        fopt, self._cache = torch_optim.with_live_hyperparams(state.optimizer, param_groups, self._cache)
        return state.replace(optimizer=fopt)

    def reset(self) -> None:
        """Forget the cache: a loaded state brought another functional optimizer."""
        self._cache = None

    def load_saved(self, param_groups: list[dict[str, Any]], state_dict: Any) -> None:
        """A torch-format state dict's (or list's) saved hyperparameters into ``param_groups``, as torch loads them."""
        dicts = state_dict if isinstance(state_dict, (list, tuple)) else [state_dict]
        saved_groups = [g for d in dicts for g in d["param_groups"]]
        if len(saved_groups) == len(param_groups):  # a functional partition has one group of all params
            for group, saved in zip(param_groups, saved_groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})

    def load_from(self, param_groups: list[dict[str, Any]], opt: optim.Optimizer) -> None:
        """The hyperparameters of a loaded functional optimizer into ``param_groups``."""
        for i, group in enumerate(param_groups):
            names = self._group_names[i]
            if names:
                # A partition (a list of torch optimizers): the part that updates the group's params.
                part = opt
                if part.parts:
                    part = part.parts[part.part_index(names[0])][1]
                group.update(torch_optim.group_hyperparams(part, part.hyperparams(names[0])))
