"""zerofn.data.GlobalBatchSampler: one data stream at every world size, across stops and resumes.

The ranks are simulated in one process (``rank=``, ``world_size=``): the sampler talks to
no one. The property tests run the stream at ``N`` ranks, stop it at a drawn global step,
and resume it at ``M`` ranks from the saved position (a ``StatefulDataLoader``'s own state,
with 0 or 2 worker processes that prefetch batches past the stop), and check the stream
against the definition: epoch ``e`` is ``randperm(dataset_len, seed + e)`` cut into global
batches, every sample of every epoch seen exactly once.
"""

from __future__ import annotations

import doctest
import gc
import itertools
import math
from collections.abc import Iterable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader  # the data extra, installed by make install

import zerofn.data
from zerofn.data import GlobalBatchSampler

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates, in StatefulDataLoader.__init__.
TORCHDATA_WARNING = "ignore:'set_vital' is deprecated:UserWarning"


class Indices(Dataset):
    """Sample ``i`` is ``i``: a batch shows which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def concat(lists: Iterable[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def as_list(batch: list[int]) -> list[int]:
    return list(batch)


def reference_epoch(dataset_len: int, global_batch: int, seed: int, epoch: int, drop_last: bool) -> list[list[int]]:
    """The global batches of one epoch, from the definition (not from the sampler)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)  # the definition; the seed knob moves the seeds hypothesis draws
    perm = torch.randperm(dataset_len, generator=g).tolist()
    stop = dataset_len - dataset_len % global_batch if drop_last else dataset_len
    return [perm[i : min(i + global_batch, stop)] for i in range(0, stop, global_batch)]


def test_docstring_examples_run():
    assert doctest.testmod(zerofn.data, verbose=False).failed == 0


def test_global_step_holds_the_same_samples_at_every_world_size():
    for n in (1, 2, 3, 4, 6):
        ranks = [GlobalBatchSampler(30, 12, seed=5, rank=r, world_size=n) for r in range(n)]
        batches = [concat(parts) for parts in zip(*ranks, strict=True)]
        assert batches == reference_epoch(30, 12, 5, 0, drop_last=True), n
        assert {len(s.local_indices(0, step)) for s in ranks for step in (0, 1)} == {12 // n}
    # drop_last=False: the last global batch of 30 % 12 = 6 samples, in near-equal contiguous parts.
    ranks = [GlobalBatchSampler(30, 12, seed=5, drop_last=False, rank=r, world_size=4) for r in range(4)]
    assert [len(s.local_indices(0, 2)) for s in ranks] == [2, 2, 1, 1]
    assert [concat(p) for p in zip(*ranks, strict=True)] == reference_epoch(30, 12, 5, 0, drop_last=False)


def test_iteration_moves_the_position_and_ends_the_epoch():
    s = GlobalBatchSampler(10, 4, seed=1)
    assert (len(s), s.steps_per_epoch, s.local_batch) == (2, 2, 4)
    it = iter(s)
    first = next(it)
    assert (s.epoch, s.step) == (0, 1)  # moved as the batch was handed out
    rest = list(it)
    assert [first, *rest] == reference_epoch(10, 4, 1, 0, drop_last=True)
    assert (s.epoch, s.step) == (1, 0)
    assert list(s) == reference_epoch(10, 4, 1, 1, drop_last=True)
    # A position at the end of an epoch (saved after its last batch) ends that epoch first.
    s.load_state_dict({**s.state_dict(), "epoch": 4, "step": 2})
    assert list(s) == [] and (s.epoch, s.step) == (5, 0)
    # DistributedSampler's idiom: set_epoch keeps a restored mid-epoch step, moves to another epoch's start.
    s.load_state_dict({**s.state_dict(), "epoch": 3, "step": 1})
    s.set_epoch(3)
    assert (s.epoch, s.step) == (3, 1)
    s.set_epoch(7)
    assert (s.epoch, s.step) == (7, 0)
    assert s.position(5) == {"epoch": 2, "step": 1}


def test_bad_arguments_are_refused_with_the_reason():
    with pytest.raises(
        ValueError, match=r"rank 1 of 4\): global_batch=6 is not a multiple of the world size 4.*e\.g\. 8"
    ):
        GlobalBatchSampler(100, 6, rank=1, world_size=4)
    with pytest.raises(ValueError, match="drop_last=False the last global batch of each epoch has 2 samples"):
        GlobalBatchSampler(10, 8, drop_last=False, rank=0, world_size=4)
    with pytest.raises(ValueError, match="smaller than global_batch=8"):
        GlobalBatchSampler(6, 8)
    with pytest.raises(ValueError, match="give rank and world_size together"):
        GlobalBatchSampler(10, 2, rank=0)
    with pytest.raises(ValueError, match="rank 2 is not below world_size 2"):
        GlobalBatchSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(TypeError, match="global_batch must be an int"):
        GlobalBatchSampler(10, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no process group is initialised"):
        GlobalBatchSampler(10, 2, group=object())  # type: ignore[arg-type]


def test_a_position_from_another_stream_is_refused_and_changes_nothing():
    s = GlobalBatchSampler(20, 4, seed=3)
    next(iter(s))
    before = s.state_dict()
    other = {**GlobalBatchSampler(20, 4, seed=4).state_dict(), "step": 3}
    with pytest.raises(ValueError, match=r"another stream: seed=4 \(this sampler: 3\)"):
        s.load_state_dict(other)
    with pytest.raises(ValueError, match=r"has no \['dataset_len'"):
        s.load_state_dict({"epoch": 0, "step": 1})
    with pytest.raises(ValueError, match="step 9 is past the epoch's 5 steps"):
        s.load_state_dict({**before, "step": 9})
    assert s.state_dict() == before


def test_rank_and_world_size_come_from_the_process_group(zerofn_world):
    def ranks():
        s = GlobalBatchSampler(12, 4)
        return s.rank, s.world_size, next(iter(s))

    got = zerofn_world(2).run(ranks)
    assert [g[:2] for g in got] == [(0, 2), (1, 2)]
    assert got[0][2] + got[1][2] == reference_epoch(12, 4, 0, 0, drop_last=True)[0]


@pytest.mark.filterwarnings(TORCHDATA_WARNING)
def test_torch_dataloader_takes_it_as_batch_sampler():
    s = GlobalBatchSampler(10, 4, seed=2, drop_last=False, rank=1, world_size=2)
    loader = DataLoader(Indices(10), batch_sampler=s, collate_fn=as_list)
    assert len(loader) == 3
    ref = reference_epoch(10, 4, 2, 0, drop_last=False)
    assert list(loader) == [ref[0][2:], ref[1][2:], ref[2][1:]]


@pytest.mark.filterwarnings(TORCHDATA_WARNING)
def test_a_position_ahead_of_the_loop_is_refused_under_a_prefetching_torch_dataloader():
    s = GlobalBatchSampler(40, 4, seed=0)
    prefetching = iter(DataLoader(Indices(40), batch_sampler=s, num_workers=2, collate_fn=as_list))
    next(prefetching)
    assert s.step > 1  # the workers have drawn more than the loop received
    with pytest.raises(ValueError, match=r"workers draw batches ahead of the training loop.*StatefulDataLoader"):
        s.state_dict()
    del prefetching
    next(iter(DataLoader(Indices(40), batch_sampler=s, collate_fn=as_list)))  # no workers: the position is exact
    assert s.state_dict()["step"] == s.step


# --------------------------------------------------------------------------- stop and resume


@st.composite
def streams(draw: st.DrawFn, max_world: int = 4, max_epochs: int = 3) -> dict:
    """A stream, the world sizes before and after the stop, the number of epochs and the stop."""
    n, m = draw(st.integers(1, max_world)), draw(st.integers(1, max_world))
    global_batch = math.lcm(n, m) * draw(st.integers(1, 3))
    drop_last = draw(st.booleans())
    dataset_len = draw(st.integers(global_batch if drop_last else 1, 3 * global_batch + 5))
    rest = dataset_len % global_batch
    if not drop_last and 0 < rest < max(n, m):
        dataset_len += max(n, m) - rest  # the sampler refuses a last batch with fewer samples than ranks
    probe = GlobalBatchSampler(dataset_len, global_batch, drop_last=drop_last)
    epochs = draw(st.integers(1, max_epochs))
    stop = draw(st.integers(0, epochs * probe.steps_per_epoch))
    seed = draw(st.integers(0, 2**16))
    return dict(n=n, m=m, global_batch=global_batch, drop_last=drop_last, dataset_len=dataset_len, epochs=epochs,
                stop=stop, seed=seed)  # fmt: skip


def loaders(case: dict, world_size: int, num_workers: int) -> list:
    return [
        StatefulDataLoader(
            Indices(case["dataset_len"]),
            batch_sampler=GlobalBatchSampler(
                case["dataset_len"],
                case["global_batch"],
                seed=case["seed"],
                drop_last=case["drop_last"],
                rank=r,
                world_size=world_size,
            ),
            num_workers=num_workers,
            collate_fn=as_list,
            timeout=60 if num_workers else 0,
        )
        for r in range(world_size)
    ]


def global_batches(ranks: list, steps: int) -> list[list[int]]:
    """``steps`` global batches from the ranks' loaders in lockstep, a new pass (epoch) when one ends."""
    out: list[list[int]] = []
    passes = 0
    while len(out) < steps:
        passes += 1
        assert passes <= steps + 2, "the loaders stopped yielding"
        for parts in zip(*ranks, strict=True):  # every rank ends its epoch at the same step
            out.append(concat(parts))
            if len(out) == steps:
                break
    return out


def _stop_workers(num_workers: int) -> None:
    """Shut the dropped loaders' worker processes down here and now (if they had any).

    A ``StatefulDataLoader`` keeps its live iterator (its ``state_dict`` reads it), so a
    dropped loader can sit in a reference cycle that only the garbage collector breaks, at
    some later allocation, inside whatever test runs then. There the iterator's
    ``__del__`` joined each worker after its 5-second poll: a later test stalled for minutes.
    Loaders without workers are left to the collector: a full collection of this process
    costs a tenth of a second, a hundred examples' worth of it half a minute.
    """
    if num_workers:
        gc.collect()


def check_stop_and_resume(case: dict, num_workers: int) -> None:
    spe = GlobalBatchSampler(case["dataset_len"], case["global_batch"], drop_last=case["drop_last"]).steps_per_epoch
    total = case["epochs"] * spe
    before = loaders(case, case["n"], num_workers)
    seen = global_batches(before, case["stop"])
    states = [loader.state_dict() for loader in before]
    sampler = before[0].batch_sampler
    if num_workers and case["stop"] % spe:  # stopped mid-epoch (a new epoch starts with a new pass)
        # The workers prefetched past the stop: the live sampler is ahead of what the loop received.
        ahead = sampler.epoch * spe + sampler.step
        assert ahead > case["stop"], (ahead, case["stop"])
    del before  # the killed job's loaders (and their workers) are gone
    _stop_workers(num_workers)
    after = loaders(case, case["m"], num_workers)
    for loader in after:
        loader.load_state_dict(states[0])  # every rank saved the same position; rank 0's is enough
    seen += global_batches(after, total - case["stop"])
    del after
    _stop_workers(num_workers)

    expected = [b for e in range(case["epochs"]) for b in reference_epoch(
        case["dataset_len"], case["global_batch"], case["seed"], e, case["drop_last"])]  # fmt: skip
    assert seen == expected
    for e in range(case["epochs"]):  # every sample of every epoch exactly once
        epoch = concat(seen[e * spe : (e + 1) * spe])
        assert (
            len(epoch)
            == len(set(epoch))
            == (case["dataset_len"] if not case["drop_last"] else spe * case["global_batch"])
        )


@pytest.mark.filterwarnings(TORCHDATA_WARNING)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=streams())
def test_stop_and_resume_at_another_world_size_sees_every_sample_once(case):
    check_stop_and_resume(case, num_workers=0)


@pytest.mark.filterwarnings(TORCHDATA_WARNING)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=streams(max_world=2, max_epochs=2))  # each pass starts 2 worker processes per rank: few, small
def test_prefetched_batches_are_not_counted_with_two_workers(case):
    check_stop_and_resume(case, num_workers=2)
