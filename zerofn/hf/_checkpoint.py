"""The optimizer and its schedule in the Trainer's ``checkpoint-<step>`` folder.

The Trainer keeps its own files (the model as ``save_pretrained`` writes it, once, from the
process that ``should_save``; ``trainer_state.json``; ``rng_state_<rank>.pth``;
``scheduler.pt``). Where it would write ``optimizer.pt`` from that one process (which holds
only its shards), every rank writes its own shards into one zerofn sharded checkpoint,
``checkpoint-<step>/zerofn_optimizer`` (DCP, atomic: a symlink to the committed
``zerofn_optimizer.<token>/``; see :mod:`zerofn.checkpoint`), without the model (the
Trainer's file has it) and without RNG states (the Trainer saves those).

A resume reads it back at any world size (the shards are resharded). A checkpoint the
Trainer wrote without zerofn (``optimizer.pt``, torch's format, e.g. a DDP run) loads too,
at any world size, through ``ZeroOptimizer.load_state_dict``. A folder with neither (saved
with ``save_only_model=True``) resumes the weights only, as the Trainer does.
"""

from __future__ import annotations

import os
import warnings

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.utils.import_utils import check_torch_load_is_safe

from zerofn.checkpoint import META_FILE
from zerofn.facade.optimizer import ZeroOptimizer

__all__ = ["ZEROFN_DIR", "load", "save"]

#: The zerofn sharded checkpoint's name inside ``checkpoint-<step>/``.
ZEROFN_DIR = "zerofn_optimizer"


def save(output_dir: str, zero: ZeroOptimizer, scheduler: object, should_save: bool) -> None:
    """Every rank writes its shards into ``output_dir/zerofn_optimizer``; the ``should_save`` one ``scheduler.pt``.

    Collectives: the ZeroOptimizer's ``save_checkpoint`` (the entry wait, a broadcast of the
    directory's name, DCP's plan exchange, two barriers). No rank saves alone.
    """
    zero.save_checkpoint(os.path.join(output_dir, ZEROFN_DIR), with_model=False, rng=False)
    if should_save:
        with warnings.catch_warnings(record=True) as caught:
            torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))  # type: ignore[attr-defined]
        reissue_pt_warnings(caught)


def load(checkpoint: str, zero: ZeroOptimizer, scheduler: object) -> bool:
    """Restore the optimizer (and then the schedule) from ``checkpoint``; ``False`` when it holds no optimizer state.

    Any world size. Files are read as data (zerofn's checkpoint as :func:`zerofn.checkpoint.load`
    reads one; ``optimizer.pt`` and ``scheduler.pt`` with ``torch.load(weights_only=True)``).

    Collectives: the ZeroOptimizer's ``load_checkpoint`` or ``load_state_dict`` (every rank
    sees the same folder, so every rank takes the same branch).
    """
    ours = os.path.join(checkpoint, ZEROFN_DIR)
    torch_file = os.path.join(checkpoint, OPTIMIZER_NAME)
    if os.path.isdir(ours) and os.path.exists(os.path.join(ours, META_FILE)):
        zero.load_checkpoint(ours, with_model=False, rng=False)
    elif os.path.isfile(torch_file):
        check_torch_load_is_safe()
        zero.load_state_dict(torch.load(torch_file, map_location="cpu", weights_only=True))
    else:
        return False
    schedule = os.path.join(checkpoint, SCHEDULER_NAME)
    if os.path.isfile(schedule):
        with warnings.catch_warnings(record=True) as caught:
            check_torch_load_is_safe()
            scheduler.load_state_dict(torch.load(schedule, weights_only=True))  # type: ignore[attr-defined]
        reissue_pt_warnings(caught)
    return True
