"""Training over the compressed wire against the float32 wire, on text nobody here wrote.

    python -m benchmarks.compressed_wire                     # 300 steps, N = 2 and 4, seeds 0 and 1
    python -m benchmarks.compressed_wire --steps 30 --world-sizes 2 --seeds 0   # a smoke run
    python -m benchmarks.compressed_wire --from-json R.json --out R   # render a saved run again

The corpus is this Python's own standard library: the ``.py`` files directly in
``os.path.dirname(os.__file__)``, sorted by name and read as bytes (the results record the
Python version, the file count and a digest of the bytes). The last 10 % of the bytes are
held out. The model is a byte-level GPT (vocabulary 256, 2 blocks, width 64, 4 heads,
context 64; 141k params), trained with zerofn's functional loop (``torch.func.grad``,
``reduce_grads``, ``step_shards``, ``gather_params``) and AdamW (lr 3e-3), each rank on
its own batches of 16 windows, under three wires in turn, the same data and init:

* ``fp32``: a float32 wire (gloo's all-reduce; the default);
* ``int8+ef``: ``CompressedWire()``, int8 codes with a scale per 256 elements, error feedback;
* ``int8``: the same without error feedback (``error_feedback=False``).

Reported per wire, world size and seed: the training loss (the mean over ranks, every 10
steps; the final figure the mean of the last 20 steps) and the held-out loss (64 fixed
windows, every 50 steps and at the end); the bytes each rank hands to the reduction per
step; the median step time and the median time of its reduction. ``--out`` writes
``<out>.json``, ``<out>.md`` and ``<out>.png`` (the curves).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerofn as zf
from zerofn.testing import World

CONTEXT, WIDTH, HEADS, BLOCKS, BATCH, LR = 64, 64, 4, 2, 16, 3e-3
EVAL_WINDOWS, EVAL_EVERY, LOG_EVERY = 64, 50, 10
WIRES: dict[str, zf.CompressedWire | None] = {
    "fp32": None,
    "int8+ef": zf.CompressedWire(),
    "int8": zf.CompressedWire(error_feedback=False),
}


def corpus() -> tuple[torch.Tensor, dict[str, Any]]:
    """The standard library's top-level ``.py`` files, concatenated, as a uint8 tensor, and where it came from."""
    root = os.path.dirname(os.__file__)
    names = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    data = b"".join(open(os.path.join(root, f), "rb").read() for f in names)
    about = {
        "source": f"{root}/*.py",
        "python": platform.python_version(),
        "files": len(names),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest()[:16],
    }
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), about


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A byte-level GPT: token and position embeddings, ``BLOCKS`` pre-norm blocks, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def _windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts.unsqueeze(1) + torch.arange(CONTEXT + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def _run(wire_name: str, seed: int, steps: int) -> dict[str, Any]:
    """One training run on this rank; every rank returns the same curves (means over ranks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data, _ = corpus()
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    torch.manual_seed(seed)
    model = TinyGPT()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    policy = zf.PrecisionPolicy(wire=WIRES[wire_name])
    state = zf.shard_params(params, zf.optim.adamw(lr=LR), precision=policy)
    keeps = bool(state.residual)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.cross_entropy(torch.func.functional_call(model, p, (x,)).flatten(0, 1), y.flatten())
        return loss, loss.detach()

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    eval_gen = torch.Generator().manual_seed(12345)
    eval_batch = _windows(held, torch.randint(0, len(held) - CONTEXT - 1, (EVAL_WINDOWS,), generator=eval_gen))
    gen = torch.Generator().manual_seed(1_000_003 * seed + rank)

    def held_out() -> float:
        with torch.no_grad():
            return float(
                F.cross_entropy(
                    torch.func.functional_call(model, params, (eval_batch[0],)).flatten(0, 1), eval_batch[1].flatten()
                )
            )

    losses, evals, step_ms, reduce_ms, sent = [], [(0, held_out())], [], [], []
    window = []
    for step in range(1, steps + 1):
        x, y = _windows(train, torch.randint(0, len(train) - CONTEXT - 1, (BATCH,), generator=gen))
        t0 = time.perf_counter()
        grads, loss = grad_fn(params, x, y)
        t1 = time.perf_counter()
        with zf.count_bytes() as counter:
            if keeps:
                shards, residual = zf.reduce_grads(grads, state.layout, precision=policy, residual=state.residual)
            else:
                shards, residual = zf.reduce_grads(grads, state.layout, precision=policy), None
        t2 = time.perf_counter()
        state, _ = zf.step_shards(state, shards, residual=residual)
        params = zf.gather_params(state)
        step_ms.append(1e3 * (time.perf_counter() - t0))
        reduce_ms.append(1e3 * (t2 - t1))
        sent.append(counter.bytes_sent)
        mean = loss.reshape(1).clone()
        dist.all_reduce(mean)  # the logged loss: the mean over ranks (outside the counted reduction)
        window.append(float(mean) / n)
        if step % LOG_EVERY == 0:
            losses.append((step, statistics.fmean(window[-LOG_EVERY:])))
        if step % EVAL_EVERY == 0 or step == steps:
            evals.append((step, held_out()))
    return {
        "losses": losses,
        "evals": evals,
        "final_train": statistics.fmean(window[-20:]),
        "final_eval": evals[-1][1],
        "first_train": window[0],
        "step_ms": statistics.median(step_ms[5:] or step_ms),
        "reduce_ms": statistics.median(reduce_ms[5:] or reduce_ms),
        "bytes_per_step": statistics.median(sent),
        "residual_bytes": sum(r.numel() * r.element_size() for r in state.residual),
        "state_bytes": state.nbytes,
    }


def run(steps: int, world_sizes: list[int], seeds: list[int]) -> dict[str, Any]:
    """Every wire at every world size and seed; the wires take turns within one pool of ranks."""
    runs: list[dict[str, Any]] = []
    for n in world_sizes:
        with World(n, timeout=600.0) as world:
            for seed in seeds:
                for wire in WIRES:
                    result = world.run(_run, wire, seed, steps)[0]
                    runs.append({"wire": wire, "world_size": n, "seed": seed, **result})
                    print(
                        f"N={n} seed={seed} {wire:8s} train {result['final_train']:.4f} "
                        f"held-out {result['final_eval']:.4f} step {result['step_ms']:.1f} ms",
                        file=sys.stderr,
                    )
    _, about = corpus()
    params = sum(p.numel() for p in TinyGPT().parameters())
    load = os.getloadavg()[0]
    return {"corpus": about, "params": params, "steps": steps, "load_at_start": load, "runs": runs}


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per world size and seed: each wire's final losses relative to fp32's, its bytes and step time."""
    rows = []
    for r in result["runs"]:
        base = next(
            b
            for b in result["runs"]
            if b["wire"] == "fp32" and (b["world_size"], b["seed"]) == (r["world_size"], r["seed"])
        )
        rows.append(
            {
                "world_size": r["world_size"],
                "seed": r["seed"],
                "wire": r["wire"],
                "train": r["final_train"],
                "held_out": r["final_eval"],
                "train_vs_fp32": r["final_train"] / base["final_train"] - 1,
                "held_out_vs_fp32": r["final_eval"] / base["final_eval"] - 1,
                "fp32_fall": base["final_train"] / base["first_train"],
                "bytes_vs_fp32": r["bytes_per_step"] / base["bytes_per_step"],
                # A byte-optimal fp32 reduce-scatter sends (N - 1) / N of the params' 4 bytes
                # (no padding counted, so the ratio is if anything overstated).
                "bytes_vs_reduce_scatter": r["bytes_per_step"]
                / ((r["world_size"] - 1) / r["world_size"] * 4 * result["params"]),
                "step_vs_fp32": r["step_ms"] / base["step_ms"],
                "reduce_ms": r["reduce_ms"],
                "step_ms": r["step_ms"],
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    c = result["corpus"]
    lines = [
        f"# The compressed wire in training: {result['steps']} steps of a {result['params']:,}-param byte-level GPT",
        "",
        f"Corpus: {c['source']} (Python {c['python']}, {c['files']} files, {c['bytes']:,} bytes, sha256 "
        f"{c['sha256']}), the last 10 % held out. Load average at the start: {result['load_at_start']:.2f}.",
        "",
        "Bytes are what each rank hands to the reduction per step, against the fp32 wire's (gloo's "
        "all-reduce) and against a byte-optimal fp32 reduce-scatter ((N - 1) / N of 4 bytes per param).",
        "",
        "| N | seed | wire | train | held-out | vs fp32 (train, held-out) | bytes vs fp32 | bytes vs fp32 "
        "reduce-scatter | step ms | reduce ms |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary(result):
        lines.append(
            f"| {r['world_size']} | {r['seed']} | {r['wire']} | {r['train']:.4f} | {r['held_out']:.4f} | "
            f"{100 * r['train_vs_fp32']:+.2f} %, {100 * r['held_out_vs_fp32']:+.2f} % | {r['bytes_vs_fp32']:.3f}x | "
            f"{r['bytes_vs_reduce_scatter']:.3f}x | {r['step_ms']:.1f} | {r['reduce_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["world_size"] for r in result["runs"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    styles = {"fp32": "-", "int8+ef": "--", "int8": ":"}
    for ax, n in zip(axes[0], sizes, strict=True):
        for r in (r for r in result["runs"] if r["world_size"] == n):
            steps, losses = zip(*r["losses"], strict=True)
            ax.plot(steps, losses, styles[r["wire"]], label=f"{r['wire']} seed {r['seed']} (train)")
            es, ev = zip(*r["evals"], strict=True)
            ax.plot(
                es,
                ev,
                styles[r["wire"]],
                marker="o",
                markersize=3,
                alpha=0.6,
                label=f"{r['wire']} seed {r['seed']} (held-out)",
            )
        ax.set_title(f"N = {n} gloo ranks")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=None, help="write <out>.json, <out>.md and <out>.png")
    parser.add_argument("--from-json", default=None, help="render a saved <out>.json again instead of training")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    else:
        result = run(args.steps, args.world_sizes, args.seeds)
    result["summary"] = summary(result)
    if args.out:
        with open(f"{args.out}.json", "w") as f:
            json.dump(result, f, indent=1)
        with open(f"{args.out}.md", "w") as f:
            f.write(markdown(result))
        plot(result, f"{args.out}.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
