"""Muon + AdamW under zerofn against DDP with the same two torch optimizers.

The usual recipe: ``torch.optim.Muon`` on the transformer blocks' 2-D weight matrices
(placed whole: each lives on one owner rank, orthogonalised there), ``torch.optim.AdamW``
on the rest (token and position embeddings, the LM head, every 1-D param; split evenly).
Systems, all on the benchmark transformer of :mod:`benchmarks.models`:

``ddp``
    ``DistributedDataParallel`` + the two torch optimizers, every rank holding all state.
``zerofn-s2``
    ``zf.ZeroOptimizer([muon, adamw], partition_grad=True)``: ZeRO stage 2.
``zerofn-s2-overlap``
    The same with ``overlap_communication=True`` (buckets reduced during backward).

One command (from the repository root; gloo, 1 thread per rank)::

    python -m benchmarks.whole_optimizers                      # N=2, the default transformer
    python -m benchmarks.whole_optimizers --quick              # tiny transformer, a few steps (smoke)

The systems take turns as in :mod:`benchmarks.run`: after ``--warmup`` untimed steps each,
every round runs a block of ``--steps`` timed steps per system, starting with a different
system each round (load drift hits all alike); a step's time is the slowest rank's, the
figure the median over all timed steps. Every system sees the same batches in the same
order, so their losses are comparable step by step (printed: the largest relative
difference to DDP's). Optimizer-state bytes per rank (masters + optimizer state, what the
optimizer holds between steps) are printed against the balanced share (the sum over ranks
divided by N) and the documented bound: at most one largest whole param's state above it.
Prints a markdown table; ``--json`` also writes everything to a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/whole_optimizers.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks import models
from zerofn.testing import World

__all__ = ["SYSTEMS", "main", "parse_args", "run"]

SYSTEMS = ("ddp", "zerofn-s2", "zerofn-s2-overlap")
REFERENCE = "ddp"
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
ADAMW = dict(lr=3e-4, weight_decay=0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.whole_optimizers", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--steps", type=int, default=None, help="timed steps per system per round (default 4)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved blocks (default 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per system first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    p.add_argument("--kernel", choices=("fused", "foreach"), default="fused", help="AdamW's kernel (both sides)")
    p.add_argument("--bucket-numel", type=int, default=None, help="zerofn's bucket size (default: zerofn's)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny transformer, 2 steps x 1 round")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    for key, full, quick in (("steps", 4, 2), ("rounds", 4, 1), ("warmup", 2, 1)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.world_size < 1 or args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--world-size, --steps and --rounds must be >= 1, --warmup >= 0")
    if REFERENCE not in args.systems:
        args.systems = [REFERENCE, *args.systems]
    return args


# --------------------------------------------------------------------------- on every rank

_CTX: dict[str, Any] = {}  # per rank process: the config, the batches, the built systems


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's params: the blocks' 2-D weights (not the embeddings, not the head, nothing 1-D)."""
    return p.ndim == 2 and name.startswith("blocks.")


def _optimizers(model: nn.Module, kernel: str) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    adamw_kw = {**ADAMW, "fused": True} if kernel == "fused" else {**ADAMW, "foreach": True}
    return [
        torch.optim.Muon([p for n, p in named if is_hidden_matrix(n, p)], **MUON),
        torch.optim.AdamW([p for n, p in named if not is_hidden_matrix(n, p)], **adamw_kw),
    ]


def setup(cfg: models.ModelConfig, seed: int, kernel: str, bucket_numel: int | None) -> dict[str, Any]:
    """Rank set-up: the data; returns the model's size (Ψ, tensors, Muon's share)."""
    _CTX.clear()
    _CTX.update(cfg=cfg, seed=seed, kernel=kernel, bucket=bucket_numel, systems={})
    _CTX["batches"] = models.make_batches(cfg, seed, dist.get_rank(), 8, torch.device("cpu"))
    _CTX["loss"] = models.loss_fn(cfg)
    model = models.build_model(cfg, seed, torch.device("cpu"))
    muon = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    psi, tensors = models.param_count(model)
    return {"psi": psi, "tensors": tensors, "muon_numel": muon}


def build(name: str) -> None:
    cfg, kernel = _CTX["cfg"], _CTX["kernel"]
    model = models.build_model(cfg, _CTX["seed"], torch.device("cpu"))
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        system = {"model": ddp, "module": model, "opts": _optimizers(model, kernel), "zo": None}
    else:
        import zerofn as zf

        kw = {} if _CTX["bucket"] is None else {"reduce_bucket_size": _CTX["bucket"]}
        zo = zf.ZeroOptimizer(
            _optimizers(model, kernel),
            partition_grad=True,
            overlap_communication=name.endswith("overlap"),
            module=model,
            **kw,
        )
        system = {"model": model, "module": model, "opts": [], "zo": zo}
    system.update(step=0, times=[], losses=[])
    _CTX["systems"][name] = system


def _step(system: dict[str, Any]) -> float:
    x, y = _CTX["batches"][system["step"] % len(_CTX["batches"])]
    system["step"] += 1
    loss = _CTX["loss"](system["model"](x), y)
    zo = system["zo"]
    if zo is None:
        loss.backward()
        for o in system["opts"]:
            o.step()
        for o in system["opts"]:
            o.zero_grad(set_to_none=True)
    else:
        zo.backward(loss)
        zo.step()
        zo.zero_grad()
    return float(loss.detach())


def run_block(name: str, count: int, untimed: int) -> dict[str, list[float]]:
    """``untimed`` steps, then ``count`` timed ones: (times in s, losses) of the timed ones."""
    system = _CTX["systems"][name]
    for _ in range(untimed):
        system["losses"].append(_step(system))
    times = []
    for _ in range(count):
        dist.barrier()  # every rank starts the step together: the time is the step's, not the wait's
        start = time.perf_counter()
        system["losses"].append(_step(system))
        times.append(time.perf_counter() - start)
    return {"times": times}


def _nbytes(tensors: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(tensors)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def describe(name: str) -> dict[str, Any]:
    """This rank's optimizer-state bytes (masters + state), the largest whole param's, the losses."""
    system = _CTX["systems"][name]
    zo = system["zo"]
    if zo is None:  # DDP: the params are the masters; every rank holds every state tensor
        opts = system["opts"]
        state = _nbytes([list(o.state.values()) for o in opts])
        master = _nbytes(list(system["module"].parameters()))
        largest_whole = 0
    else:
        state = _nbytes(zo.state.opt_state)
        master = _nbytes(dict(zo.state.master))
        layout = zo.state.layout
        # One whole param's master + Muon momentum, in the masters' dtype (fp32 here): 2 x 4 B.
        largest_whole = max((8 * s.numel for s in layout.params if s.is_whole), default=0)
    return {
        "state_bytes": state + master,
        "master_bytes": master,
        "opt_state_bytes": state,
        "largest_whole_bytes": largest_whole,
        "losses": list(system["losses"]),
    }


def drop(name: str) -> None:
    system = _CTX["systems"].pop(name)
    if system["zo"] is not None:
        system["zo"].close()


# --------------------------------------------------------------------------- the parent


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; print and return the results."""
    # The rank functions by their module's name, not ``__main__``'s copies: the ranks import
    # the module and keep its ``_CTX`` between calls.
    from benchmarks import whole_optimizers as on_rank

    cfg = models.model_config("transformer", quick=args.quick, batch=args.batch)
    n = args.world_size
    out: dict[str, Any] = {"world_size": n, "args": vars(args), "systems": {}}
    with World(n, threads=args.threads, timeout=args.timeout) as world:
        info = world.run(on_rank.setup, cfg, args.seed, args.kernel, args.bucket_numel)[0]
        out.update(info)
        for name in args.systems:
            world.run(on_rank.build, name)
            world.run(on_rank.run_block, name, 0, args.warmup)
        per_step: dict[str, list[float]] = {name: [] for name in args.systems}
        for rnd in range(args.rounds):
            shift = rnd % len(args.systems)
            for name in args.systems[shift:] + args.systems[:shift]:
                res = world.run(on_rank.run_block, name, args.steps, 0)
                per_step[name] += [max(ts) for ts in zip(*(r["times"] for r in res), strict=True)]
        for name in args.systems:
            desc = world.run(on_rank.describe, name)
            world.run(on_rank.drop, name)
            state = [d["state_bytes"] for d in desc]
            out["systems"][name] = {
                "median_ms": 1e3 * statistics.median(per_step[name]),
                "step_ms": [1e3 * t for t in per_step[name]],
                "state_bytes": state,
                "balanced_bytes": sum(state) / n,
                "largest_whole_bytes": desc[0]["largest_whole_bytes"],
                "losses": desc[0]["losses"],
            }
    ref = out["systems"][REFERENCE]
    for entry in out["systems"].values():
        entry["ratio"] = entry["median_ms"] / ref["median_ms"]
        entry["max_loss_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(entry["losses"], ref["losses"], strict=True)
        )
    print(markdown(out, cfg), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


def markdown(out: dict[str, Any], cfg: models.ModelConfig) -> str:
    n = out["world_size"]
    mib = 2.0**20
    lines = [
        f"## Muon + AdamW: zerofn against DDP with the same torch optimizers (transformer, N={n}, gloo)",
        "",
        f"Ψ = {out['psi']:,} elements in {out['tensors']} tensors; Muon on the blocks' matrices: "
        f"{out['muon_numel']:,} ({100 * out['muon_numel'] / out['psi']:.1f} %), AdamW on the rest. "
        f"d_model={cfg.d_model}, layers={cfg.n_layer}, vocab={cfg.vocab}, batch {cfg.batch} x {cfg.seq_len} per rank.",
        "",
        "| system | median step (ms) | vs DDP | state per rank, max (MiB) | balanced share (MiB) "
        "| max / balanced | bound: balanced + largest whole (MiB) | max rel. loss diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in out["systems"].items():
        top, balanced = max(e["state_bytes"]), e["balanced_bytes"]
        bound = (balanced + e["largest_whole_bytes"]) / mib
        lines.append(
            f"| `{name}` | {e['median_ms']:.1f} | {e['ratio']:.2f}x | {top / mib:.2f} | {balanced / mib:.2f} "
            f"| {top / balanced:.3f} | {bound:.2f} | {e['max_loss_rel_diff']:.1e} |"
        )
    lines += [
        "",
        "State: masters + optimizer state held between steps (DDP: the params and all of Muon's and AdamW's "
        "state on every rank). Step: the slowest rank's, median over "
        f"{len(next(iter(out['systems'].values()))['step_ms'])} timed steps per system.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
