"""Checkpoints: torch-format state dicts, sharded DCP saves, and resharding N -> M.

Two formats, both world-size free:

**Full state dict** (:func:`full_state_dict` / :func:`shard_state_dict`): exactly what
``torch.optim.Optimizer.state_dict()`` returns — ``{"state": {index: {...}},
"param_groups": [...]}`` with unpadded, param-shaped CPU tensors — plus one ``"zerofn"``
entry for what torch has no slot for: names, shapes and dtypes of the params, the fp32
master weights, the completed step count, the loss-scale state and a compressed wire's
residual. A plain
``torch.optim.AdamW`` loads it (and ignores the extra entry), and zerofn loads a plain
torch state dict back at any world size. Every rank gathers the whole state: use it for
small models, interop and tests.

**Sharded checkpoint** (:func:`save` / :func:`load`): every rank writes only its own
shards through ``torch.distributed.checkpoint`` (DCP). Each shard is described as the
local part of a DTensor over the *unpadded* flattened parameter with ``Shard(0)``
placement — zerofn's even split is exactly DTensor's chunking rule — so DCP knows where
every element lives and a load at another world size reads just the overlapping pieces.
Model weights (replicated, written once) can go in the same checkpoint, so resume is
one call.

Nothing is lost: a save writes a new directory ``<path>.<token>/`` (files fsynced), records
each file's size and SHA-256 in ``zerofn.json``, and only then atomically repoints the
symlink ``<path>`` at it (``os.replace``) and removes the previous target. A process killed
at any moment leaves ``<path>`` pointing at the last complete checkpoint. A load checks
sizes and hashes, the rank files and the model's names, shapes and dtypes before reading
any tensor, and raises :class:`CheckpointError` naming what is wrong.

The rest of the training state travels in the same checkpoint: ``extra=`` (any object with
``state_dict()`` / ``load_state_dict()``: LR schedulers, data loaders, counters) and every
rank's RNG, restored all or nothing (see :func:`load` for what restores at which world size).

The package, one file per part: ``_format`` (the on-disk metadata, hashes and atomic
commit), ``_manifest`` (what a sharded checkpoint says was saved), ``_dcp`` (the sharded
save), ``_load`` (the sharded load as one pipeline: read and verify the metadata, the
manifest, check it against the live state, read the tensors, assemble), ``_torch_format``
(the torch-format full state dict; ``_gather`` gathers a state whole for it),
``_residual`` (the compressed wire's residual, per param and sender, in both formats, and
its N -> M rule), ``_validate`` (what a load checks against the live state),
``_optimizer`` (the optimizer state as torch keeps it, and the optimizer a checkpoint
describes), ``_extras`` (``extra=`` objects and every rank's RNG, as data), ``_rng`` (the
RNG states as data, and what a state dict may hold), ``_unpickle`` (reading a pickle as
data: the allowlists), ``_reader`` (DCP's files read as data: the metadata, checked, the
reader and the planner a load hands DCP), ``_async`` (saving in the background: staging,
the write on a side group, the commit when it completes), ``_errors``.

A load reads data, never code: see "Loading a checkpoint someone else wrote" in the
checkpoints guide for what it admits and what ``safe_globals=`` adds.
"""

from zerofn.checkpoint._async import PendingCheckpoint
from zerofn.checkpoint._dcp import save
from zerofn.checkpoint._errors import CheckpointError, raise_alike
from zerofn.checkpoint._format import FORMAT_VERSION as FORMAT_VERSION
from zerofn.checkpoint._format import META_FILE as META_FILE
from zerofn.checkpoint._load import load
from zerofn.checkpoint._torch_format import full_state_dict, shard_state_dict
from zerofn.checkpoint._validate import check_buffers, persistent_buffers

__all__ = [
    "CheckpointError",
    "PendingCheckpoint",
    "check_buffers",
    "full_state_dict",
    "load",
    "persistent_buffers",
    "raise_alike",
    "save",
    "shard_state_dict",
]
