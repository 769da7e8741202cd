"""examples/train.py under torchrun: killed workers and a departed agent, resumed on the same stream.

Everything on loopback. Each run logs, per rank, the samples of every step it trained
(``examples/train.py --log-dir``); the tests rebuild the global data stream from those
logs and hold it against :class:`zerofn.data.GlobalBatchSampler`'s definition, and compare
the final weights bitwise with a run that was not interrupted (or, across a change of
world size, with a run started by hand from the same checkpoint, on the session's pool of
gloo ranks).

torch 2.13's torchrun keeps one rendezvous TCP store for every restart of the workers,
so the restarted workers' gloo can read the addresses of the dead ones and fail to
connect (pytorch/pytorch#135712); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each
round its own store, as docs/elastic.md tells users.
"""

from __future__ import annotations

import concurrent.futures
import glob
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import seeded

from zerofn.data import GlobalBatchSampler

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"
STEPS, SAVE_EVERY, GLOBAL_BATCH, DATASET_LEN, SEED = 20, 4, 8, 36, 3  # 4 steps per epoch: 5 epochs
TRAIN_ARGS = [
    f"--steps={STEPS}",
    f"--save-every={SAVE_EVERY}",
    f"--global-batch={GLOBAL_BATCH}",
    f"--dataset-len={DATASET_LEN}",
    f"--seed={SEED}",
    "--keep=0",  # keep every checkpoint: the by-hand run needs the one the survivor loaded
    "--pg-timeout=30",
]
ENV = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
WAIT_S = 180  # a bound on each torchrun job, far above its time on a loaded 2-core machine

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(launch: list[str], script_args: list[str], tmp: Path, tag: str) -> subprocess.Popen:
    """A torchrun agent, its output in ``tmp/<tag>.out``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, str(SCRIPT), *TRAIN_ARGS, *script_args]
    cmd += [f"--ckpt-dir={tmp / 'ckpt'}", f"--log-dir={tmp / 'log'}", f"--out={tmp / 'final.pt'}"]
    with open(tmp / f"{tag}.out", "w") as out:  # the agent writes to its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def kill_tree(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers at once, as when their machine dies."""
    for pid in process_tree(agent.pid):  # the agent first: it cannot react to its workers' deaths
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def finish(agent: subprocess.Popen, tmp: Path, tag: str) -> None:
    try:
        code = agent.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        kill_tree(agent)
        code = "timed out"
    assert code == 0, f"torchrun ({tag}) ended with {code}:\n{(tmp / f'{tag}.out').read_text()[-6000:]}"


def read_logs(log_dir: Path) -> list[dict[str, Any]]:
    """One entry per worker process: its start event and its steps (step -> samples)."""
    workers = []
    for path in sorted(glob.glob(str(log_dir / "*.jsonl"))):
        text = Path(path).read_text()
        events = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]  # whole lines only
        if not events:
            continue  # a worker that has not logged its start yet
        start = events[0]
        steps = {e["step"]: e["samples"] for e in events if e["event"] == "step"}
        workers.append({**start, "steps": steps, "done": any(e["event"] == "done" for e in events)})
    return workers


def rounds(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers grouped into the job's rounds (one world size, one checkpoint), in start order.

    A round's global batch at step s is its ranks' samples, in rank order, where every rank
    logged the step. Two rounds with the same world size and checkpoint would share a key:
    the check that each rank appears once catches it.
    """
    grouped: dict[tuple, list[dict]] = {}
    for w in workers:
        grouped.setdefault((w["world"], w["resumed_from"]), []).append(w)
    out = []
    for members in grouped.values():
        world = members[0]["world"]
        assert sorted(m["rank"] for m in members) == list(range(world)), members
        members.sort(key=lambda m: m["rank"])
        common = set.intersection(*(set(m["steps"]) for m in members))
        batches = {s: [i for m in members for i in m["steps"][s]] for s in sorted(common)}
        logged = max((s for m in members for s in m["steps"]), default=members[0]["step"])
        out.append({"world": world, "start": members[0]["step"], "resumed_from": members[0]["resumed_from"],
                    "batches": batches, "logged": logged, "done": all(m["done"] for m in members),
                    "time": min(m["time"] for m in members)})  # fmt: skip
    return sorted(out, key=lambda r: r["time"])


def reference_batch(step: int) -> list[int]:
    """Global step ``step`` (1-based) of the stream, from the sampler's definition at one rank."""
    s = GlobalBatchSampler(DATASET_LEN, GLOBAL_BATCH, seed=SEED, rank=0, world_size=1)
    epoch, within = divmod(step - 1, s.steps_per_epoch)
    return s.global_batch_indices(epoch, within)


def check_stream(job: list[dict[str, Any]]) -> list[str]:
    """Every round trained the stream's own batches, the last one to the end; the effective history is whole.

    Returns a line per round for the report.
    """
    effective: dict[int, list[int]] = {}
    lines = []
    for r in job:
        for step, batch in r["batches"].items():
            assert batch == reference_batch(step), (r["world"], step)  # continued exactly, at any world size
            effective[step] = batch  # a later round replaces the replayed steps
        lines.append(f"world {r['world']}: resumed at step {r['start']} ({r['resumed_from']}), "
                     f"trained to step {r['logged']}")  # fmt: skip
    assert job[-1]["done"] and sorted(effective) == list(range(1, STEPS + 1))
    spe = DATASET_LEN // GLOBAL_BATCH
    for e in range(STEPS // spe):  # every sample of every epoch once (drop_last: B * spe of them)
        seen = [i for s in range(e * spe + 1, (e + 1) * spe + 1) for i in effective[s]]
        assert len(seen) == len(set(seen)) == spe * GLOBAL_BATCH
    return lines


def _train_by_hand(argv: list[str]) -> dict[str, torch.Tensor]:
    """On a pool rank: examples/train.py's train() in the pool's process group."""
    spec = importlib.util.spec_from_file_location("zerofn_example_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train(module.parse_args(argv))


def by_hand(world, tmp: Path, resume_from: str | None = None) -> dict[str, torch.Tensor]:
    argv = [*TRAIN_ARGS, f"--ckpt-dir={tmp / 'ckpt'}"]
    if resume_from:
        argv.append(f"--resume-from={resume_from}")
    return world.run(_train_by_hand, argv)[0]


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    diff = max((got[k] - want[k]).abs().max().item() for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got), diff
    return diff


def test_a_killed_worker_is_restarted_and_the_run_ends_bitwise_as_if_it_never_stopped(tmp_path, zerofn_world):
    kill_at = random.Random(seeded(23)).randint(SAVE_EVERY + 1, STEPS - 2)  # a drawn step, past the first checkpoint
    launch = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
    agent = torchrun(launch, [f"--kill-at={kill_at}", "--kill-rank=1"], tmp_path, "standalone")
    try:
        want = by_hand(zerofn_world(2), tmp_path / "uninterrupted")  # meanwhile, the run that never stops
        finish(agent, tmp_path, "standalone")
    finally:
        if agent.poll() is None:
            kill_tree(agent)

    job = rounds(read_logs(tmp_path / "log"))
    lines = check_stream(job)
    assert [r["world"] for r in job] == [2, 2]
    redone = job[0]["logged"] - job[1]["start"]
    assert job[0]["logged"] >= kill_at and 0 <= redone <= SAVE_EVERY, (kill_at, lines)
    diff = assert_bitwise(torch.load(tmp_path / "final.pt"), want)
    print(f"killed rank 1 after step {kill_at}; steps redone {redone}; max |difference| {diff}", *lines, sep="\n")


def test_an_agent_leaves_and_the_survivor_reforms_at_half_the_world_on_the_same_stream(tmp_path, zerofn_world):
    port = free_port()
    conf = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    common = ["--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--monitor-interval=0.1",
              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zerofn-elastic",
              "--local-addr=127.0.0.1"]  # fmt: skip
    # The survivor hosts the rendezvous store; the other agent (and its workers) is killed as a node that dies.
    slow = ["--step-delay=0.1"]  # time to see the world of 4 save and train on before the kill
    survivor = torchrun([*common, f"--rdzv-conf={conf},is_host=1"], slow, tmp_path, "survivor")
    leaver = torchrun([*common, f"--rdzv-conf={conf},is_host=0"], slow, tmp_path, "leaver")
    try:
        deadline = time.monotonic() + WAIT_S
        while True:  # kill the leaver once the world of 4 has committed a checkpoint and trained past it
            assert time.monotonic() < deadline, (tmp_path / "survivor.out").read_text()[-4000:]
            assert survivor.poll() is None and leaver.poll() is None, "an agent ended before the kill"
            four = [w for w in read_logs(tmp_path / "log") if w["world"] == 4]
            # A rank logged the step after the world of 4's first save: that save is committed.
            if any(s > (w["step"] // SAVE_EVERY + 1) * SAVE_EVERY for w in four for s in w["steps"]):
                break
            time.sleep(0.05)
        kill_tree(leaver)  # the node is gone: its agent and its workers at once
        killed = time.time()
        while not (reformed := [w for w in read_logs(tmp_path / "log") if w["time"] > killed]):
            assert time.monotonic() < deadline and survivor.poll() is None, (tmp_path / "survivor.out").read_text()
            time.sleep(0.05)
        reform_s = reformed[0]["time"] - killed
        # Meanwhile, the run started by hand from the checkpoint the survivor loaded, on the pool's 2 ranks.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            hand = pool.submit(by_hand, zerofn_world(2), tmp_path / "by-hand", reformed[0]["resumed_from"])
            finish(survivor, tmp_path, "survivor")
            want = hand.result()
    finally:
        for agent in (survivor, leaver):
            if agent.poll() is None:
                kill_tree(agent)

    job = rounds(read_logs(tmp_path / "log"))
    lines = check_stream(job)
    four, last = [r for r in job if r["world"] == 4][-1], job[-1]
    assert last["world"] == 2 and last["resumed_from"] == reformed[0]["resumed_from"] is not None, lines
    saved_at = int(Path(last["resumed_from"]).name.split("-")[1])
    assert four["start"] < saved_at == last["start"], lines  # the checkpoint the world of 4 saved
    redone = four["logged"] - last["start"]
    assert 0 <= redone <= SAVE_EVERY, lines
    diff = assert_bitwise(torch.load(tmp_path / "final.pt"), want)
    lines.append(f"re-formed {reform_s:.1f} s after the kill")
    print(f"world 4 -> 2 at step {last['start']}; steps redone {redone}; max |difference| {diff}", *lines, sep="\n")
