"""Low-bit optimizer state (torchao's 8-bit, 4-bit, fp8 AdamW) under zerofn: padding, memory, step time.

Three parts, all on the benchmark transformer of :mod:`benchmarks.models`:

``--tables`` (pure, seconds, no processes)
    Per world size N: which params are quantized (placed ``blocked(B)``: global
    ``numel >= 4096`` and ``numel % B == 0``), the padding that whole-block chunks add
    (elements per rank, the largest per param per rank, against B), and the optimizer state
    bytes per rank (masters + state, the largest rank) for fp32 AdamW, 8-bit, 4-bit and fp8:
    measured on the real state tensors (torchao's, built on the ``meta`` device by the
    optimizer's own ``init`` for every rank's shards) against the formula

        fp32 AdamW: 4 (master) + 8 bytes per element of the rank's chunk;
        low-bit:    4 + 2 * (c + 4 / B) per element of a quantized chunk (c = 1 for 8-bit
                    and fp8, 0.5 for 4-bit; one fp32 scale per block) + torchao's code
                    table per moment (8-bit: 256 fp32, 4-bit: 16, fp8: none); 12 for the rest;
                    plus 4 bytes per param held for the ``step`` counter (a 0-d fp32 tensor).

``--speed`` (gloo ranks, slow on a busy machine)
    Median step time (the slowest rank's) of ``zerofn-fp32`` (ZeroOptimizer over fused
    torch AdamW, stage 2), ``zerofn-8bit`` (ZeroOptimizer over torchao's AdamW8bit: torchao's
    update run eagerly), ``zerofn-8bit-compiled`` (the functional ``zf.optim.adamw8bit(
    compile=True)`` in the facade: torchao's update compiled, as torchao runs it) and
    ``ddp-8bit`` (DDP + torchao's AdamW8bit, its own compiled step, every rank holding all
    state), taking turns block by block.

``--numerics`` (one process)
    torchao's update compiled against eager on the same shards (the test model of
    tests/test_lowbit.py, 30 steps): whether compiled results are the same at N = 1..4 and
    equal to the plain torchao optimizer, and how far compiled is from eager.

    python -m benchmarks.lowbit --tables
    python -m benchmarks.lowbit --speed --world-size 2 --json benchmarks/results/cpu-lowbit-n2.json
    python -m benchmarks.lowbit --numerics
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import unittest.mock
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/lowbit.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn as nn

import zerofn as zf
from benchmarks import models
from zerofn import lowbit
from zerofn.layout import make_layout

__all__ = ["memory_table", "numerics", "padding_table", "parse_args", "run_speed"]

KINDS = ("adamw8bit", "adamw4bit", "adamwfp8")
CODES = {"adamw8bit": 1.0, "adamw4bit": 0.5, "adamwfp8": 1.0}
QMAP = {"adamw8bit": 256, "adamw4bit": 16, "adamwfp8": 0}  # fp32 entries of torchao's code table per moment
HP = dict(lr=3e-4, weight_decay=0.1)


def _meta_params(cfg: models.ModelConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = models.build_model(cfg, 0, torch.device("meta"))
    return {n: p.detach() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- tables


def padding_table(cfg: models.ModelConfig, world_sizes: list[int], kind: str = "adamw8bit") -> list[dict[str, Any]]:
    """Per N: quantized params, their padding (per rank, the largest per param per rank), and split padding."""
    params = _meta_params(cfg)
    opt = getattr(zf.optim, kind)()
    placement = {n: opt.placement(n, tuple(p.shape)) for n, p in params.items()}
    block = opt.static["lowbit"].block_size
    rows = []
    for n in world_sizes:
        layout = make_layout(params, n, placement=placement)
        blocked = [s for s in layout.params if s.block]
        split = [s for s in layout.params if not s.block]
        rows.append(
            {
                "world_size": n,
                "block": block,
                "quantized_params": len(blocked),
                "quantized_numel": sum(s.numel for s in blocked),
                "params": len(layout.params),
                "numel": layout.numel,
                "blocked_padding_per_rank": sum(s.padding for s in blocked) / n,
                "blocked_padding_max_per_param_per_rank": max((s.padding / n for s in blocked), default=0),
                "blocked_padding_max_per_param": max((s.padding for s in blocked), default=0),
                "split_padding_per_rank": sum(s.padding for s in split) / n,
                "padding_fraction": sum(s.padding for s in layout.params) / layout.numel,
            }
        )
    return rows


def _formula_bytes(layout: Any, rank: int, kind: str | None) -> int:
    """Masters + state bytes rank ``rank`` holds, by the formula in the module docstring."""
    total = 0.0
    for s in layout.params:
        if not s.holds(rank):
            continue
        chunk = s.stored_numel(rank)
        total += 4  # the step counter
        if kind is None or not s.block:
            total += 12 * chunk
        else:
            total += 4 * chunk + 2 * (CODES[kind] * chunk + 4 * chunk / s.block + 4 * QMAP[kind])
    return int(total)


def memory_table(cfg: models.ModelConfig, world_sizes: list[int]) -> list[dict[str, Any]]:
    """Per N and optimizer: the largest rank's measured masters + state bytes, and the formula's."""
    params = _meta_params(cfg)
    rows = []
    for n in world_sizes:
        for kind in (None, *KINDS):
            opt = zf.optim.adamw(**HP) if kind is None else getattr(zf.optim, kind)(**HP)
            placement = {name: opt.placement(name, tuple(p.shape)) for name, p in params.items()}
            layout = make_layout(params, n, placement=placement)
            measured, formula = [], []
            for r in range(n):
                masters = {s.name: torch.empty(s.local_shape(r), device="meta") for s in layout.params if s.holds(r)}
                state = opt.init(masters, layout=layout)
                leaves = torch.utils._pytree.tree_leaves((masters, state))
                measured.append(sum(lowbit.state_nbytes(t) for t in leaves if isinstance(t, torch.Tensor)))
                formula.append(_formula_bytes(layout, r, kind))
            rows.append(
                {
                    "world_size": n,
                    "optimizer": kind or "adamw (fp32)",
                    "measured_bytes": max(measured),
                    "formula_bytes": max(formula),
                    "bytes_per_param_element": max(measured) / (layout.numel / n),
                }
            )
    return rows


def tables_markdown(cfg: models.ModelConfig, pads: list[list[dict[str, Any]]], mem: list[dict[str, Any]]) -> str:
    lines = []
    for pad in pads:
        lines += [*_padding_markdown(pad), ""]
    return "\n".join(lines + _memory_markdown(mem))


def _padding_markdown(pad: list[dict[str, Any]]) -> list[str]:
    first = pad[0]
    lines = [
        f"### Padding of the blocked placement (transformer, Ψ = {first['numel']:,} in {first['params']} tensors, "
        f"B = {first['block']})",
        "",
        f"{first['quantized_params']} params ({first['quantized_numel']:,} elements, "
        f"{100 * first['quantized_numel'] / first['numel']:.1f} % of Ψ) are quantized at every N; the others keep "
        "fp32 state and the usual split.",
        "",
        "| N | blocked padding per rank (elements) | largest per param per rank | largest per param (all ranks) "
        "| split padding per rank | padding / Ψ |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in pad:
        lines.append(
            f"| {row['world_size']} | {row['blocked_padding_per_rank']:.1f} "
            f"| {row['blocked_padding_max_per_param_per_rank']:.1f} | {row['blocked_padding_max_per_param']} "
            f"| {row['split_padding_per_rank']:.1f} | {row['padding_fraction']:.2e} |"
        )
    return lines


def _memory_markdown(mem: list[dict[str, Any]]) -> list[str]:
    mib = 2.0**20
    lines = [
        "",
        "### Optimizer state per rank: masters + moments, the largest rank (MiB; measured = formula?)",
        "",
        "| N | " + " | ".join(["fp32 AdamW", *KINDS]) + " |",
        "|---:|" + "---:|" * (1 + len(KINDS)),
    ]
    by_n: dict[int, list[dict[str, Any]]] = {}
    for row in mem:
        by_n.setdefault(row["world_size"], []).append(row)
    for n, entries in by_n.items():
        cells = [
            f"{e['measured_bytes'] / mib:.2f} ({e['bytes_per_param_element']:.2f} B/el)"
            + ("" if e["measured_bytes"] == e["formula_bytes"] else f" formula {e['formula_bytes'] / mib:.2f}")
            for e in entries
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "B/el: bytes per element of Ψ/N. Every measured figure equals the formula unless it says otherwise."]
    return lines


# --------------------------------------------------------------------------- speed, on every rank

SYSTEMS = ("zerofn-fp32", "zerofn-8bit", "zerofn-8bit-compiled", "ddp-8bit")
_CTX: dict[str, Any] = {}


def setup(cfg: models.ModelConfig, seed: int) -> None:
    import warnings

    warnings.simplefilter("ignore")  # torch.compile's own deprecation warnings, on the ranks only
    _CTX.clear()
    _CTX.update(cfg=cfg, seed=seed, systems={})
    _CTX["batches"] = models.make_batches(cfg, seed, dist.get_rank(), 8, torch.device("cpu"))
    _CTX["loss"] = models.loss_fn(cfg)


def build(name: str) -> None:
    import torchao.optim

    model = models.build_model(_CTX["cfg"], _CTX["seed"], torch.device("cpu"))
    if name == "ddp-8bit":
        system = {
            "model": nn.parallel.DistributedDataParallel(model),
            "opt": torchao.optim.AdamW8bit(model.parameters(), **HP),
        }
    else:
        if name == "zerofn-fp32":
            wrapped: Any = torch.optim.AdamW(model.parameters(), fused=True, **HP)
            zo = zf.ZeroOptimizer(wrapped, partition_grad=True, module=model)
        elif name == "zerofn-8bit":
            zo = zf.ZeroOptimizer(torchao.optim.AdamW8bit(model.parameters(), **HP), partition_grad=True, module=model)
        else:
            zo = zf.ZeroOptimizer(
                model.named_parameters(), zf.optim.adamw8bit(compile=True, **HP), partition_grad=True, module=model
            )
        system = {"model": model, "zo": zo}
    system.update(step=0, losses=[])
    _CTX["systems"][name] = system


def _step(system: dict[str, Any]) -> None:
    x, y = _CTX["batches"][system["step"] % len(_CTX["batches"])]
    system["step"] += 1
    loss = _CTX["loss"](system["model"](x), y)
    if "zo" in system:
        system["zo"].backward(loss)
        system["zo"].step()
        system["zo"].zero_grad()
    else:
        loss.backward()
        system["opt"].step()
        system["opt"].zero_grad(set_to_none=True)
    system["losses"].append(float(loss.detach()))


def run_block(name: str, count: int, untimed: int) -> list[float]:
    system = _CTX["systems"][name]
    for _ in range(untimed):
        _step(system)
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        _step(system)
        times.append(time.perf_counter() - start)
    return times


def describe(name: str) -> dict[str, Any]:
    system = _CTX["systems"].pop(name)
    if "zo" in system:
        leaves = torch.utils._pytree.tree_leaves((dict(system["zo"].state.master), system["zo"].state.opt_state))
        system["zo"].close()
    else:
        leaves = [
            *system["model"].module.parameters(),
            *torch.utils._pytree.tree_leaves(list(system["opt"].state.values())),
        ]
    nbytes = sum(lowbit.state_nbytes(t) for t in leaves if isinstance(t, torch.Tensor))
    return {"state_bytes": nbytes, "losses": system["losses"]}


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import lowbit as on_rank
    from zerofn.testing import World

    cfg = models.model_config("transformer", quick=args.quick)
    out: dict[str, Any] = {"world_size": args.world_size, "args": vars(args), "systems": {}}
    with World(args.world_size, threads=1, timeout=args.timeout) as world:
        world.run(on_rank.setup, cfg, 0)
        for name in args.systems:
            world.run(on_rank.build, name)
            world.run(on_rank.run_block, name, 0, args.warmup)
        per_step: dict[str, list[float]] = {name: [] for name in args.systems}
        for rnd in range(args.rounds):
            shift = rnd % len(args.systems)
            for name in args.systems[shift:] + args.systems[:shift]:
                res = world.run(on_rank.run_block, name, args.steps, 0)
                per_step[name] += [max(ts) for ts in zip(*res, strict=True)]
        for name in args.systems:
            desc = world.run(on_rank.describe, name)
            out["systems"][name] = {
                "median_ms": 1e3 * statistics.median(per_step[name]),
                "step_ms": [1e3 * t for t in per_step[name]],
                "state_bytes": [d["state_bytes"] for d in desc],
                "losses": desc[0]["losses"],
            }
    ref = out["systems"].get("zerofn-fp32")
    lines = [
        f"### Step time, transformer, N = {args.world_size} (gloo, 1 thread per rank)",
        "",
        "| system | median step (ms) | vs zerofn fp32 | state per rank, max (MiB) |",
        "|---|---:|---:|---:|",
    ]
    for name, e in out["systems"].items():
        ratio = f"{e['median_ms'] / ref['median_ms']:.2f}x" if ref else "-"
        lines.append(f"| `{name}` | {e['median_ms']:.0f} | {ratio} | {max(e['state_bytes']) / 2**20:.2f} |")
    out["markdown"] = "\n".join(lines)
    print(out["markdown"], flush=True)
    return out


# --------------------------------------------------------------------------- numerics


def numerics(steps: int = 30) -> dict[str, Any]:
    """Compiled against eager, on shards cut from one param and one gradient per step (one process)."""
    import warnings

    import torchao.optim

    from zerofn.buckets import cut_shard

    warnings.simplefilter("ignore")
    shapes = {"w": (64, 64), "b": (64,), "odd": (7, 9)}
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(steps)]
    classes = {
        "adamw8bit": torchao.optim.AdamW8bit,
        "adamw4bit": torchao.optim.AdamW4bit,
        "adamwfp8": torchao.optim.AdamWFp8,
    }
    out: dict[str, Any] = {}
    for kind in KINDS:
        results: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for mode in ("eager", "compiled"):
            opt = getattr(zf.optim, kind)(compile=mode == "compiled", lr=1e-2, weight_decay=0.1)
            results[mode] = {}
            for n in (1, 2, 3, 4):
                layout = make_layout(full, n, placement={k: opt.placement(k, s) for k, s in shapes.items()})
                ranks = []
                for r in range(n):
                    master = {s.name: cut_shard(full[s.name], s, r) for s in layout.params}
                    state = opt.init(master, layout=layout)
                    for g in grads:
                        master, state = opt.update(
                            {s.name: cut_shard(g[s.name], s, r) for s in layout.params}, state, master
                        )
                    ranks.append(master)
                results[mode][n] = {
                    s.name: torch.cat([m[s.name] for m in ranks])[: s.numel].view(s.shape) for s in layout.params
                }
        plain = {}
        for mode in ("eager", "compiled"):
            ps = {n: nn.Parameter(t.clone()) for n, t in full.items()}
            o = classes[kind](list(ps.values()), lr=1e-2, weight_decay=0.1)
            patch = unittest.mock.patch.object(torch, "compile", lambda fn, **kw: fn) if mode == "eager" else None
            with patch or _null():
                for g in grads:
                    for n, p in ps.items():
                        p.grad = g[n]
                    o.step()
            plain[mode] = {n: p.detach() for n, p in ps.items()}

        def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
            return all(torch.equal(a[k], b[k]) for k in a)

        out[kind] = {
            "eager_same_at_N=1..4": all(same(results["eager"][n], results["eager"][1]) for n in (2, 3, 4)),
            "compiled_same_at_N=1..4": all(same(results["compiled"][n], results["compiled"][1]) for n in (2, 3, 4)),
            "eager_equals_plain_torchao_eager": same(results["eager"][1], plain["eager"]),
            "compiled_equals_plain_torchao_compiled": same(results["compiled"][1], plain["compiled"]),
            "compiled_vs_eager_max_abs_diff": {
                k: float((results["compiled"][1][k] - results["eager"][1][k]).abs().max()) for k in shapes
            },
        }
        print(kind, json.dumps(out[kind]), flush=True)
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lowbit", description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", action="store_true", help="padding and memory tables (pure, seconds)")
    p.add_argument("--speed", action="store_true", help="step time on gloo ranks")
    p.add_argument("--numerics", action="store_true", help="compiled against eager (one process)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--table-world-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="the tiny transformer")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict[str, Any] = {}
    if args.tables or not (args.speed or args.numerics):
        cfg = models.model_config("transformer", quick=args.quick)
        out["padding"] = {k: padding_table(cfg, args.table_world_sizes, k) for k in ("adamw8bit", "adamw4bit")}
        out["memory"] = memory_table(cfg, args.table_world_sizes)
        print(tables_markdown(cfg, list(out["padding"].values()), out["memory"]), flush=True)
    if args.numerics:
        out["numerics"] = numerics()
    if args.speed:
        out["speed"] = run_speed(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
