"""Train with zerofn under torchrun, resuming by itself: elastic and fault-tolerant runs.

At start-up every rank loads the newest *committed* checkpoint in ``--ckpt-dir`` (if any),
at whatever world size this run has, and trains on from there; every ``--save-every``
steps it saves one. A job killed at any moment, or restarted by torchrun on fewer or more
ranks, continues on exactly the next sample of the same data stream, with the same
optimizer state and RNG, and redoes at most ``--save-every`` steps.

Run it alone (one rank), or under torchrun, the same code::

    python examples/train.py --ckpt-dir /tmp/run1
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 examples/train.py --ckpt-dir /tmp/run1

Elastic, across machines (here two agents on one machine; one may leave and the other
re-forms the job at the world size that is left, loading the checkpoint resharded)::

    torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=job1 examples/train.py --ckpt-dir /shared/run1

What makes the stream and the state world-size free:

* the data: :class:`zerofn.data.GlobalBatchSampler` cuts one seeded permutation per epoch
  into global batches of ``--global-batch`` samples and gives each rank a contiguous part;
  torchdata's ``StatefulDataLoader`` snapshots its position as of the last batch the loop
  received (batches its workers prefetched are not counted);
* the model and optimizer: :meth:`zerofn.ZeroOptimizer.save_checkpoint` writes each rank's
  shards and the weights once, and :meth:`~zerofn.ZeroOptimizer.load_checkpoint` reads them
  at any world size;
* the rest travels in the same checkpoint (``extra=``): the loader, the LR scheduler, a
  step counter, and every rank's RNG (restored at the world size it was saved at; at
  another, each rank keeps the RNG it seeded at start-up, as a fresh start would);
* a checkpoint is committed atomically: ``step-000010`` is a symlink that appears only
  once every file of ``step-000010.<token>/`` is written and hashed, so a run killed while
  saving resumes from the previous one.

Each rank appends one JSON line per event to ``--log-dir`` (``start``, ``step`` with the
indices of the samples it trained on, ``save``, ``done``): the tests read the stream back
from them. ``--kill-at STEP --kill-rank R`` makes rank R SIGKILL itself after step STEP in
the first attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT`` 0), to test restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchdata.stateful_dataloader import StatefulDataLoader

import zerofn as zf
from zerofn.data import GlobalBatchSampler

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates, in every StatefulDataLoader.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

CHECKPOINT = re.compile(r"^step-(\d{6})$")  # a committed checkpoint: the symlink; its target is step-NNNNNN.<token>
WRITTEN = re.compile(r"^step-(\d{6})\.\w+$")  # a checkpoint's directory (a save cut short leaves one with no link)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--ckpt-dir", required=True, help="where checkpoints are saved and resumed from")
    p.add_argument("--resume-from", help="a checkpoint to start from instead of the newest in --ckpt-dir")
    p.add_argument("--steps", type=int, default=60, help="global steps of the whole run")
    p.add_argument("--save-every", type=int, default=10, help="save a checkpoint every K global steps")
    p.add_argument("--keep", type=int, default=2, help="committed checkpoints to keep (0: all)")
    p.add_argument("--global-batch", type=int, default=16, help="samples per step over all ranks")
    p.add_argument("--dataset-len", type=int, default=200, help="samples in the synthetic data set")
    p.add_argument("--num-workers", type=int, default=0, help="data loader worker processes per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="one JSON-lines file per rank and attempt (default: no log)")
    p.add_argument("--out", help="rank 0 writes the final weights here (torch.save of name -> tensor)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (to watch it)")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    p.add_argument("--kill-at", type=int, help="test hook: after this step of the first attempt ...")
    p.add_argument("--kill-rank", type=int, default=0, help="... this rank SIGKILLs itself")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- data and model


class Synthetic(torch.utils.data.Dataset):
    """A fixed classification set: sample ``i`` is ``(x_i, y_i, i)``, the same on every rank."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),  # uses each rank's RNG: a resume must restore it
        torch.nn.Linear(32, 4),
    )


# --------------------------------------------------------------------------- checkpoints


def committed(ckpt_dir: str) -> list[tuple[int, str]]:
    """The committed checkpoints in ``ckpt_dir`` as (step, path), oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        m = CHECKPOINT.match(name)
        path = os.path.join(ckpt_dir, name)
        if m and os.path.islink(path) and os.path.isdir(path):  # a dangling link is not a checkpoint
            found.append((int(m.group(1)), path))
    return sorted(found)


def prune(ckpt_dir: str, keep: int) -> None:
    """Rank 0, after a save: drop all but the ``keep`` newest committed checkpoints, and what
    saves cut short left behind before the newest one."""
    kept = committed(ckpt_dir)
    if keep > 0:
        for _, path in kept[:-keep]:
            target = os.path.realpath(path)
            os.remove(path)  # the link first: from here on the checkpoint is not committed
            shutil.rmtree(target, ignore_errors=True)
        kept = kept[-keep:]
    targets = {os.path.realpath(path) for _, path in kept}
    for name in os.listdir(ckpt_dir):
        m = WRITTEN.match(name)
        path = os.path.realpath(os.path.join(ckpt_dir, name))
        if m and kept and int(m.group(1)) < kept[-1][0] and path not in targets and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


class Steps:
    """The global steps done: a user's counter, saved with the checkpoint as any ``Stateful`` is."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = int(state["done"])


class Log:
    """One JSON object per line, flushed at once (a SIGKILL loses no finished line)."""

    def __init__(self, log_dir: str | None, rank: int, attempt: int) -> None:
        self.file = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, f"attempt{attempt}-rank{rank}-pid{os.getpid()}.jsonl"), "a")

    def __call__(self, event: str, **fields: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"event": event, **fields}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# --------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Train in the initialised default process group; return the final weights (name -> tensor)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = Log(args.log_dir, rank, attempt)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    dataset = Synthetic(args.dataset_len, args.seed)
    sampler = GlobalBatchSampler(len(dataset), args.global_batch, seed=args.seed)  # rank, world from the group
    # Its own generator: a DataLoader draws a seed at every iter() from the one it is given, by
    # default the global RNG, which a resumed run (one more iter(), mid-epoch) would then shift.
    loader_rng = torch.Generator().manual_seed(args.seed)
    loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=args.num_workers, generator=loader_rng)
    model = build_model(args.seed)
    optimizer = zf.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr), partition_grad=True, module=model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    torch.manual_seed(args.seed + 1 + rank)  # dropout: another stream on each rank
    steps = Steps()
    extra = {"loader": loader, "scheduler": scheduler, "steps": steps}  # saved and restored with the optimizer

    # Resume: the newest committed checkpoint (every rank lists the same directory).
    resume = args.resume_from or (committed(args.ckpt_dir)[-1][1] if committed(args.ckpt_dir) else None)
    if resume is not None:
        # Weights, optimizer shards, and the extras; at the saved world size each rank's RNG too
        # (at another, the RNG seeded per rank above stays: a fresh start's, docs/resuming.md).
        optimizer.load_checkpoint(resume, extra=extra)
    step = steps.done
    log("start", world=world, rank=rank, attempt=attempt, resumed_from=resume, step=step, time=time.time())

    steps_per_epoch = sampler.steps_per_epoch
    while step < args.steps:
        for x, y, index in loader:  # the rest of the current epoch
            loss = F.cross_entropy(model(x), y)
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step = steps.done = step + 1
            log("step", step=step, epoch=(step - 1) // steps_per_epoch, world=world, samples=index.tolist(),
                loss=loss.item())  # fmt: skip
            if step % args.save_every == 0 or step == args.steps:
                path = os.path.join(args.ckpt_dir, f"step-{step:06d}")
                optimizer.save_checkpoint(path, extra=extra)  # and every rank's RNG
                if rank == 0:
                    prune(args.ckpt_dir, args.keep)
                log("save", step=step, world=world, path=path)
            if args.kill_at == step and rank == args.kill_rank and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no flush beyond the log's
            time.sleep(args.step_delay)
            if step == args.steps:
                break
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    if args.out and rank == 0:
        tmp = f"{args.out}.tmp{os.getpid()}"
        torch.save(weights, tmp)
        os.replace(tmp, args.out)  # the file appears whole or not at all
    log("done", step=step, world=world)
    log.close()
    return weights


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    else:  # alone: a group of one
        store = tempfile.mkstemp(prefix="zerofn-train-")[1]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    train(args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown, where gloo now and then aborts after the group is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
