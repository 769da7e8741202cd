"""A data stream that does not depend on the world size: :class:`GlobalBatchSampler`.

The unit of the stream is the *global batch*: ``global_batch`` samples per optimizer step,
summed over every rank. Epoch ``e`` is one seeded permutation of ``range(dataset_len)``
(``torch.randperm`` with a generator seeded ``seed + e``, the rule of torch's
``DistributedSampler``); global step ``s`` of the epoch is the contiguous slice
``perm[s * global_batch : (s + 1) * global_batch]``, and rank ``r`` of ``N`` takes the
``r``-th of ``N`` contiguous parts of it::

    epoch e:  perm = randperm(dataset_len, seed + e)
    step s:   perm[s*B : (s+1)*B]                      # the same samples at every N
    rank r:   perm[s*B + r*B/N : s*B + (r+1)*B/N]      # this rank's B/N of them

So global step ``s`` holds the same samples whatever the number of ranks, and the
position in the stream is two integers, ``(epoch, step)``, that every rank shares. A
checkpoint taken at ``N`` ranks resumes at ``M`` ranks on exactly the next sample: every
rank loads the same position and takes its part of the next global batch. (torch's
``DistributedSampler`` deals sample ``i`` to rank ``i % N``: the batches, and the position
after ``k`` steps, depend on ``N``, so a run cannot change its world size mid-epoch.)

The state (:meth:`GlobalBatchSampler.state_dict`) is the ``torch.distributed.checkpoint``
``Stateful`` protocol, so the sampler travels in a checkpoint's ``extra=`` and inside
torchdata's ``StatefulDataLoader``, which snapshots it as of the last batch the loop
*received*: batches its workers prefetched but the loop never consumed are not counted.
A plain ``torch.utils.data.DataLoader`` with ``num_workers > 0`` pulls batches from the
sampler ahead of the loop, so the sampler's own position runs ahead of training there;
:meth:`GlobalBatchSampler.state_dict` then raises rather than hand out a position that
would skip batches on resume. Checkpoint the ``StatefulDataLoader`` (``pip install
'zerofn[data]'``), or use ``num_workers=0``, or restore the position from your step count
with :meth:`GlobalBatchSampler.position`.

No collectives: the rank and the world size are read from the process group (or given),
nothing is exchanged.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from zerofn import _comm as comm
from zerofn._comm import Group

__all__ = ["GlobalBatchSampler"]

# What a saved position must agree on to mean the same samples (the world size is not one).
_STREAM_KEYS = ("dataset_len", "global_batch", "seed", "drop_last")

PREFETCHED = (
    "{where}: a torch DataLoader with worker processes is iterating this sampler, and its workers draw batches "
    "ahead of the training loop, so the sampler's position counts batches the loop has not trained on yet; a "
    "checkpoint of it would skip them. Checkpoint a torchdata StatefulDataLoader instead (its state holds the "
    "position of the last batch the loop received: extra={{'loader': loader}}), or use num_workers=0, or save "
    "your step count and restore the position with sampler.position(step)"
)


def _prefetching_caller(frame: Any) -> bool:
    """Whether ``frame`` (the caller of the sampler's iterator) is torch's multi-process loader.

    torch's ``_MultiProcessingDataLoaderIter`` pulls indices ahead of the loop; torchdata's
    ``StatefulDataLoader`` does too, but snapshots the sampler as of each batch it hands
    out, so it is not one of these.
    """
    from torch.utils.data import dataloader

    ahead = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    return ahead is not None and type(owner) is ahead


def _nonneg_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum``, or a ValueError naming ``name``."""
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(f"GlobalBatchSampler: {name} must be an int, got {type(value).__name__} {value!r}") from None
    if as_int < minimum:
        raise ValueError(f"GlobalBatchSampler: {name} must be >= {minimum}, got {as_int}")
    return as_int


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's part of each global batch of a seeded, world-size-free stream.

    A batch sampler: pass it as ``batch_sampler=`` to ``torch.utils.data.DataLoader`` or
    torchdata's ``StatefulDataLoader``. Each item it yields is the list of dataset indices
    for this rank's part of the next global batch (``global_batch // world_size`` of them).

    **Not divisible.** ``global_batch`` must be a multiple of the world size: a ValueError
    says so at construction. Uneven parts would weigh samples unequally under the mean
    that DDP and zerofn take over ranks (each rank's loss is a mean over its own part), so
    the stream would train differently at different world sizes. Choose a global batch
    divisible by every world size the run may use (a multiple of 12 covers 1, 2, 3, 4, 6).

    **The last, partial global batch.** With ``drop_last=True`` (the default) an epoch is
    ``dataset_len // global_batch`` full global batches; the ``dataset_len % global_batch``
    samples left at the end of the permutation are not used that epoch (they are other
    samples each epoch). With ``drop_last=False`` the epoch ends with one smaller global
    batch of those samples, cut into ``world_size`` contiguous parts whose sizes differ by
    at most one (the first ranks take the larger parts, ``numpy.array_split``'s rule); it is
    refused at construction when it has fewer samples than there are ranks, as a rank
    would get an empty batch. On that step each rank's loss is a mean over a part of
    another size, so the mean over ranks weighs its samples slightly unequally, as under
    DDP; ``drop_last=True`` keeps every step's arithmetic the same at every world size.

    **The position.** The sampler's state is ``(epoch, step)``: the epoch and the global
    step within it that the next batch belongs to. Iterating yields the rest of the
    current epoch from the position, moving it one step per batch handed out; once the
    epoch's last batch is out, the iteration ends (as does a new ``iter()`` from a position
    saved just then) and the position moves to ``(epoch + 1, 0)``. So ``for epoch in
    range(E): for batch in loader:`` runs one epoch per pass, and a loader restored
    mid-epoch finishes that epoch first.

    Args:
      dataset_len: the number of samples (``len(dataset)``), ``>= 1``.
      global_batch: samples per optimizer step over all ranks; a multiple of the world size.
      seed: the permutation of epoch ``e`` is seeded ``seed + e``; every rank must use the same.
      drop_last: leave out the last, partial global batch of each epoch (see above).
      rank: this rank (``0 <= rank < world_size``); give it with ``world_size``, for
        instance to simulate ranks in one process. Default: the rank in ``group``.
      world_size: the number of ranks sharing each global batch; given with ``rank``.
        Default: the size of ``group``, or 1 when no process group is initialised.
      group: the process group whose ranks share the batches (``None``: the default
        group). Only its rank and size are read; no communication.

    Raises:
      ValueError: a bad size, rank, world size, or a global batch the world size does not
        divide; before anything else happens.

    Examples:
      >>> from zerofn.data import GlobalBatchSampler
      >>> s0 = GlobalBatchSampler(10, 4, seed=0, rank=0, world_size=2)
      >>> s1 = GlobalBatchSampler(10, 4, seed=0, rank=1, world_size=2)
      >>> whole = GlobalBatchSampler(10, 4, seed=0, rank=0, world_size=1)
      >>> # the same global batches at N = 2 and N = 1
      >>> [a + b for a, b in zip(s0, s1)] == list(whole)
      True
      >>> whole.epoch, whole.step  # the epoch's 2 global batches are done: next is epoch 1, step 0
      (1, 0)
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        drop_last: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        group: Group = None,
    ) -> None:
        super().__init__()
        dataset_len = _nonneg_int("dataset_len", dataset_len, 1)
        global_batch = _nonneg_int("global_batch", global_batch, 1)
        seed = _nonneg_int("seed", seed, 0)
        if not isinstance(drop_last, bool):
            raise TypeError(f"GlobalBatchSampler: drop_last must be a bool, got {drop_last!r}")
        if (rank is None) != (world_size is None):
            raise ValueError(
                f"GlobalBatchSampler: give rank and world_size together (got rank={rank!r}, "
                f"world_size={world_size!r}), or neither to read them from the process group"
            )
        if rank is None:
            if comm.initialized():
                rank, world_size = comm.group_rank(group), comm.group_size(group)
            elif group is not None:
                raise ValueError("GlobalBatchSampler: group= was given but no process group is initialised")
            else:
                rank, world_size = 0, 1
        elif group is not None:
            raise ValueError("GlobalBatchSampler: give either group= or rank= and world_size=, not both")
        world_size = _nonneg_int("world_size", world_size, 1)
        rank = _nonneg_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"GlobalBatchSampler: rank {rank} is not below world_size {world_size}")
        where = f"GlobalBatchSampler (rank {rank} of {world_size})"
        if global_batch % world_size:
            raise ValueError(
                f"{where}: global_batch={global_batch} is not a multiple of the world size {world_size}, so its "
                f"ranks cannot take equal parts of each global batch; use a global batch divisible by every "
                f"world size the run may use (e.g. {global_batch + (-global_batch) % world_size} here)"
            )
        rest = dataset_len % global_batch
        if drop_last and dataset_len < global_batch:
            raise ValueError(
                f"{where}: dataset_len={dataset_len} is smaller than global_batch={global_batch}, so with "
                "drop_last=True an epoch has no global batch; use a smaller global batch or drop_last=False"
            )
        if not drop_last and 0 < rest < world_size:
            raise ValueError(
                f"{where}: with drop_last=False the last global batch of each epoch has {rest} samples "
                f"(dataset_len={dataset_len} % global_batch={global_batch}), fewer than the {world_size} ranks, "
                "so a rank would get an empty batch; use drop_last=True or another global batch"
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self._epoch = 0
        self._step = 0
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation), the last one used
        self._prefetched = False  # being iterated by torch's multi-process DataLoader (state_dict refuses)

    # ------------------------------------------------------------------ the stream

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in one epoch (the last, partial one included when ``drop_last=False``)."""
        full, rest = divmod(self.dataset_len, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def local_batch(self) -> int:
        """``global_batch // world_size``: this rank's samples per full global batch."""
        return self.global_batch // self.world_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def step(self) -> int:
        """The global step within :attr:`epoch` the next batch belongs to (``steps_per_epoch``: the epoch is done)."""
        return self._step

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.dataset_len, generator=g))
        return self._perm[1]

    def global_batch_indices(self, epoch: int, step: int) -> list[int]:
        """Every rank's samples of global step ``step`` of epoch ``epoch``, in rank order.

        Shape: ``global_batch`` indices (fewer for the last step when ``drop_last=False``).
        Independent of the world size and of the position; changes nothing.
        """
        epoch = _nonneg_int("epoch", epoch, 0)
        step = _nonneg_int("step", step, 0)
        if step >= self.steps_per_epoch:
            raise ValueError(f"GlobalBatchSampler: step {step} is past the epoch's {self.steps_per_epoch} steps")
        start = step * self.global_batch
        stop = min(start + self.global_batch, self.dataset_len)
        return self._permutation(epoch)[start:stop].tolist()

    def local_indices(self, epoch: int, step: int) -> list[int]:
        """This rank's part of :meth:`global_batch_indices` (its contiguous ``rank``-th of ``world_size`` parts)."""
        whole = self.global_batch_indices(epoch, step)
        base, extra = divmod(len(whole), self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return whole[start : start + base + (1 if self.rank < extra else 0)]

    def __len__(self) -> int:
        """Batches in one whole epoch (:attr:`steps_per_epoch`), as ``len(DataLoader)`` expects."""
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches from the position to the end of the epoch; then the position is the next epoch.

        The position moves as each batch is handed out (before the caller receives it),
        so :meth:`state_dict` right after a batch names the one that follows it.
        """
        # Runs at the first next(): frame 1 is whoever pulls the batches.
        self._prefetched = _prefetching_caller(sys._getframe(1))
        while self._step < self.steps_per_epoch:
            batch = self.local_indices(self._epoch, self._step)
            self._step += 1
            yield batch
        self._epoch, self._step = self._epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step, unless the position is already in it.

        ``DistributedSampler``'s idiom (``sampler.set_epoch(epoch)`` before each epoch) keeps
        working: at the start of an epoch it names the epoch the sampler is at, and after a
        resume mid-epoch it keeps the restored step instead of replaying the epoch.
        """
        epoch = _nonneg_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._step = epoch, 0

    def position(self, global_step: int) -> dict[str, int]:
        """The state after ``global_step`` global batches from the start of epoch 0: ``{"epoch", "step"}``.

        For restoring the position from a step count with :meth:`load_state_dict` (merge it
        into :meth:`state_dict`) where no saved position is at hand.
        """
        epoch, step = divmod(_nonneg_int("global_step", global_step, 0), self.steps_per_epoch)
        return {"epoch": epoch, "step": step}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position, and what the stream is, as plain ints and bools (no world size, no rank).

        ``{"epoch", "step", "dataset_len", "global_batch", "seed", "drop_last"}``: the same
        on every rank, loadable at any world size the global batch allows.

        Raises:
          ValueError: a ``torch.utils.data.DataLoader`` with ``num_workers > 0`` is iterating
            the sampler: its workers prefetch, so the position is ahead of the training
            loop (checkpoint torchdata's ``StatefulDataLoader`` instead).
        """
        if self._prefetched:
            raise ValueError(PREFETCHED.format(where=f"GlobalBatchSampler.state_dict (rank {self.rank})"))
        return {
            "epoch": self._epoch,
            "step": self._step,
            "dataset_len": self.dataset_len,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict` (at any world size).

        Raises:
          ValueError: the state is not one of this sampler's, or it was saved from another
            stream (another ``dataset_len``, ``global_batch``, ``seed`` or ``drop_last``: the
            same position would be other samples); the position is then unchanged.
        """
        where = f"GlobalBatchSampler.load_state_dict (rank {self.rank} of {self.world_size})"
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"{where}: expected the dict state_dict() returns, got {type(state_dict).__name__}")
        missing = [k for k in ("epoch", "step", *_STREAM_KEYS) if k not in state_dict]
        if missing:
            raise ValueError(f"{where}: the state has no {missing}; pass what GlobalBatchSampler.state_dict() returned")
        differ = [
            f"{k}={state_dict[k]!r} (this sampler: {getattr(self, k)!r})"
            for k in _STREAM_KEYS
            if state_dict[k] != getattr(self, k)
        ]
        if differ:
            raise ValueError(
                f"{where}: the position was saved from another stream: {', '.join(differ)}; the same (epoch, step) "
                "would be other samples. Build the sampler with the saved values to resume that stream"
            )
        epoch = _nonneg_int("epoch", state_dict["epoch"], 0)
        step = _nonneg_int("step", state_dict["step"], 0)
        if step > self.steps_per_epoch:
            raise ValueError(f"{where}: step {step} is past the epoch's {self.steps_per_epoch} steps")
        self._epoch, self._step = epoch, step
