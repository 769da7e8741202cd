"""zerofn against its peers: step time, memory, state bytes, bytes sent, loss agreement.

One command (from the repository root)::

    python -m benchmarks.run                       # everything: 3 models x N in {2, 4}
    python -m benchmarks.run --quick               # tiny models, N=2, a few steps (smoke)
    python -m benchmarks.run --models transformer --world-sizes 2 --systems ddp-fused zerofn-s2
    python -m benchmarks.run --profile zerofn-s2 ddp-fused --models transformer --world-sizes 2

Each (model, N) pair gets one :class:`zerofn.testing.World` of N rank processes (gloo on
CPU; with ``--device cuda``, or ``auto`` when N GPUs are present, NCCL with rank r on
``cuda:r``), every rank installing the collective byte counter (:mod:`benchmarks._count`)
in its init hook. Every selected system is built in those processes,
warmed up, and then the systems take turns: in each round every system runs a block of
``--steps`` timed steps (after ``--block-warmup`` untimed ones), starting with a different
system each round, so load drift on the machine hits all systems alike. Peak RSS is
measured separately, one fresh pool per system (``--memory isolated``), because a
process's high-water mark cannot be split between systems that share it.

Writes ``<out>.json`` (everything, raw step times included), ``<out>.md`` (the tables)
and ``<out>.png`` (if matplotlib is importable). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import models, report
from zerofn.testing import World, WorldError

__all__ = ["main", "parse_args", "run"]

ALL_SYSTEMS = (
    "ddp-fused",
    "ddp-foreach",
    "ddp-compiled",
    "zero-redundancy",
    "fsdp2",
    "deepspeed-z1",
    "deepspeed-z2",
    "zerofn-fn-pure",
    "zerofn-fn-donated",
    "zerofn-fn-overlap",
    "zerofn-fn-compiled",
    "zerofn-fn-compiled-inductor",
    "zerofn-s1",
    "zerofn-s1-overlap",
    "zerofn-s2",
    "zerofn-s2-overlap",
    "zerofn-s2-overlap-ag",
    "zerofn-s2-byteopt",
    "zerofn-s2-compiled",
)
REFERENCE = "ddp-fused"
# glibc malloc that keeps what it frees: blocks up to its largest mmap threshold (32 MiB) come
# from the heap, and the heap's top is never given back. A compiled step allocates its buffers
# on every call, and with glibc's defaults the pages of the largest are returned to the system
# and faulted in again each time (docs/jit.md, "Time").
MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
# Run only when named (--systems): inductor compiles the step for minutes on a small CPU.
SLOW_TO_BUILD = ("zerofn-fn-compiled-inductor", "ddp-compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=models.MODELS, default=None, help="default: all three")
    p.add_argument("--world-sizes", nargs="+", type=int, default=None, help="default: 2 4 (--quick: 2)")
    p.add_argument("--systems", nargs="+", choices=ALL_SYSTEMS, default=None, help="default: all")
    p.add_argument("--skip", nargs="+", choices=ALL_SYSTEMS, default=(), help="systems to leave out")
    p.add_argument("--steps", type=int, default=None, help="timed steps per system per round (default 5)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved blocks (default 6)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per system before round 1 (default 3)")
    p.add_argument("--block-warmup", type=int, default=None, help="untimed steps at the start of every block (1)")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (transformer: sequences; MLP: rows)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    p.add_argument(
        "--kernel",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW kernel of every system except ddp-foreach (default fused)",
    )
    p.add_argument(
        "--bucket-numel",
        type=int,
        default=None,
        help="zerofn's bucket size in elements, every zerofn system (default: zerofn's own default)",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of zerofn-s2-compiled (default: ZeroOptimizer's compile=True, inductor)",
    )
    p.add_argument(
        "--malloc",
        choices=("default", "keep"),
        default="default",
        help="keep: the ranks' glibc malloc keeps freed memory (MALLOC_*_THRESHOLD_, docs/jit.md)",
    )
    p.add_argument("--memory", choices=("isolated", "off"), default=None, help="peak-RSS phase (default isolated)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path prefix (default benchmarks/results/<device>)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--quick", action="store_true", help="tiny models, N=2, 2 steps x 1 round, no memory phase")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    p.add_argument("--profile", nargs="+", choices=ALL_SYSTEMS, default=None, help="profile these systems instead")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--strict", action="store_true", help="fail instead of skipping a system that fails")
    p.add_argument("--note", default="", help="free text stored in the JSON and the table header (e.g. machine load)")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "models": list(models.MODELS),
        "world_sizes": [2] if q else [2, 4],
        "systems": [s for s in ALL_SYSTEMS if s not in SLOW_TO_BUILD],
        "steps": 2 if q else 5,
        "rounds": 1 if q else 6,
        "warmup": 1 if q else 3,
        "block_warmup": 0 if q else 1,
        "memory": "off" if q else "isolated",
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("steps", "rounds", "threads"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be at least 1")
    for k in ("warmup", "block_warmup"):
        if getattr(args, k) < 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0")
    if any(n < 1 for n in args.world_sizes):
        p.error("--world-sizes must be >= 1")
    args.systems = [s for s in args.systems if s not in set(args.skip)]
    if not args.systems:
        p.error("no systems left to run")
    return args


def _backend_for(n: int, device: str) -> tuple[str, str | None]:
    """(backend, note) for world size ``n``: NCCL when n GPUs are there (or asked for)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu":
        return "gloo", None
    if gpus >= n:
        return "nccl", None
    if device == "cuda":
        return "", f"N={n} needs {n} GPUs, found {gpus}; skipped"
    return "gloo", None


def _rank_init(threads: int) -> None:
    """Each rank's set-up, once, before any system is built: the byte counter and threads."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    from benchmarks import _count

    _count.install()  # before FSDP2 or DeepSpeed bind any collective
    # zerofn itself is already imported here (the World worker lives in the zerofn package),
    # and a module of it may hold a collective it bound at import time (e.g. the flat
    # all-gather it picks per torch version): point those references at the wrappers too.
    wrapped = {}
    for name in dir(c10d):
        fn = getattr(c10d, name)
        original = getattr(fn, "__benchmark_wrapped__", None)
        if original is not None:
            wrapped[id(original)] = fn
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "zerofn" or module_name.startswith("zerofn.")):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped:
                setattr(module, attr, wrapped[id(value)])
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or inter-op work already ran in this process
        pass


def _world(n: int, backend: str, args: argparse.Namespace) -> World:
    """N rank processes for one (model, N): gloo on the CPU, or NCCL with rank r on cuda:r."""
    if args.compile_backend:  # read by zerofn-s2-compiled in the rank processes (they inherit the environment)
        os.environ["ZEROFN_BENCH_COMPILE_BACKEND"] = args.compile_backend
    if args.malloc == "keep":  # read by glibc when a rank process starts: every system runs with it
        os.environ.update(MALLOC_KEEP)
    return World(
        n,
        backend=backend,
        device="cuda" if backend == "nccl" else "cpu",
        threads=args.threads,
        timeout=args.timeout,
        init=functools.partial(_rank_init, args.threads),
    )


def _short(exc: WorldError) -> str:
    """One line for the report: the first failing rank's exception."""
    failure = next(iter(exc.failures.values()))
    first = failure.message.splitlines()[0] if failure.message else ""
    return f"{failure.type_name}: {first}"[:300]


def _log(msg: str) -> None:
    print(msg, flush=True)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    try:  # the version only: importing DeepSpeed in the parent would cost seconds
        from importlib.metadata import version

        ds_version: str | None = version("deepspeed")
    except Exception:
        ds_version = None
    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "zerofn_commit": _git_commit(),
        "argv": sys.argv[1:],
        "args": {k: v for k, v in vars(args).items() if k != "skip"},
        "note": args.note,
    }


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _bench_one(model: str, n: int, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import systems

    cfg = models.model_config(model, quick=args.quick, batch=args.batch)
    n_batches = 8
    run: dict[str, Any] = {
        "model": model,
        "world_size": n,
        "backend": backend,
        "model_config": dataclasses.asdict(cfg),
        "systems": {},
        "notes": [],
    }
    out = run["systems"]
    ds_note = systems.deepspeed_available()
    with _world(n, backend, args) as world:
        info = world.run(systems.setup, cfg, args.seed, n_batches, args.kernel, args.bucket_numel)[0]
        run.update(psi=info["psi"], n_params=info["n_params"], device=info["device"])
        _log(f"== {model} (Ψ={info['psi']:,} in {info['n_params']} tensors), N={n}, {backend} on {info['device']}")
        built: list[str] = []
        for name in args.systems:
            meta = systems.SYSTEMS[name]
            entry: dict[str, Any] = {"label": meta.label, "family": meta.family, "status": "ok"}
            out[name] = entry
            if name.startswith("deepspeed") and ds_note:
                entry.update(status="skipped", note=ds_note)
                _log(f"   {name}: skipped: {ds_note}")
                continue
            try:
                world.run(systems.build, name)
                built.append(name)
            except WorldError as exc:
                if args.strict or exc.restarted:  # the ranks' built systems are gone
                    raise
                entry.update(status="failed", note=f"build failed: {_short(exc)}")
                _log(f"   {name}: build failed, skipped: {_short(exc)}")
        records: dict[str, dict[str, Any]] = {
            name: {"times": [[] for _ in range(n)], "losses": [[] for _ in range(n)], "blocks": []} for name in built
        }

        def block(name: str, count: int, untimed: int) -> None:
            try:
                res = world.run(systems.run_block, name, count, untimed)
            except WorldError as exc:
                if args.strict or exc.restarted:  # the ranks' built systems are gone
                    raise
                out[name].update(status="failed", note=f"step failed: {_short(exc)}")
                _log(f"   {name}: step failed, dropped: {_short(exc)}")
                built.remove(name)
                world.run(systems.drop, name)
                return
            rec = records[name]
            for r, rr in enumerate(res):
                rec["times"][r].extend(rr["times"])
                rec["losses"][r].extend(rr["losses"])
            if count:
                rec["blocks"].append(res)

        t_start = time.monotonic()
        for name in list(built):
            block(name, 0, args.warmup)
        for rnd in range(args.rounds):
            order = built[rnd % len(built) :] + built[: rnd % len(built)] if built else []
            for name in order:
                if name in built:
                    block(name, args.steps, args.block_warmup)
            _log(f"   round {rnd + 1}/{args.rounds} done ({time.monotonic() - t_start:.0f}s)")
        for name in list(built):
            try:
                desc = world.run(systems.describe, name)
                evals = world.run(systems.eval_loss, name)
            except WorldError as exc:
                if args.strict or exc.restarted:  # the ranks' built systems are gone
                    raise
                desc, evals = None, None
                out[name]["note"] = f"describe failed: {_short(exc)}"
            rec = records[name]
            entry = out[name]
            compile_s = [d["compile"] for d in desc or [] if d.get("compile")]
            if compile_s:  # the slowest rank's compile, cold (fresh process) and warm (caches filled)
                cold, warm = (
                    max((c[k] for c in compile_s if c.get(k) is not None), default=math.nan)
                    for k in ("cold_s", "warm_s")
                )
                entry.update(compile_cold_s=cold, compile_warm_s=warm)
                entry["note"] = "the collectives inside a compiled graph are not counted (sent MiB)"
                _log(f"   {name}: compile cold {cold:.1f} s, warm {warm:.1f} s; {entry['note']}")
            per_step = [max(ts) for ts in zip(*rec["times"], strict=True)]  # the slowest rank sets the pace
            entry.update(
                step_ms=[t * 1e3 for t in per_step],
                median_ms=_ms(_median(per_step)),
                min_ms=_ms(min(per_step) if per_step else None),
                p10_ms=_ms(_quantile(per_step, 0.1)),
                p90_ms=_ms(_quantile(per_step, 0.9)),
                losses=rec["losses"],
                eval_loss=evals[0] if evals else None,
                describe=desc,
            )
            last = rec["blocks"][-1] if rec["blocks"] else None
            if last is not None:
                entry.update(
                    zerofn_bytes=max(rr["zerofn_bytes"] for rr in last),
                    zerofn_by_collective=last[0]["zerofn_by_collective"],
                    python_bytes=max(rr["python_bytes"] for rr in last),
                    python_by_collective=last[0]["python_by_collective"],
                    minor_faults=max(rr["minor_faults"] for rr in last),
                )
            world.run(systems.drop, name)
        run["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if args.memory == "isolated":
        for name in [s for s in args.systems if out[s]["status"] == "ok"]:
            out[name]["memory"] = _memory_one(name, cfg, n, backend, args)
            m = out[name]["memory"]
            if "error" not in m:
                _log(f"   memory {name}: peak RSS {max(m['peak_rss']) / 2**20:.0f} MiB/rank")
    report.derive(run, reference=REFERENCE)
    return run


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _memory_one(name: str, cfg: models.ModelConfig, n: int, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS of ``name`` alone: a fresh pool, warm-up + one block, then VmHWM per rank."""
    from benchmarks import systems

    try:
        with _world(n, backend, args) as world:
            world.run(systems.setup, cfg, args.seed, 8, args.kernel, args.bucket_numel)
            base = world.run(systems.memory)
            world.run(systems.build, name)
            world.run(systems.run_block, name, args.steps, args.warmup)
            after = world.run(systems.memory)
    except WorldError as exc:
        if args.strict:
            raise
        return {"error": _short(exc)}
    out = {
        "baseline_rss": [b["VmRSS"] for b in base],
        "peak_rss": [a["VmHWM"] for a in after],
        "delta": [a["VmHWM"] - b["VmRSS"] for a, b in zip(after, base, strict=True)],
    }
    if "cuda_max_allocated" in after[0]:
        out["cuda_max_allocated"] = [a["cuda_max_allocated"] for a in after]
    return out


def _profile(args: argparse.Namespace, out_prefix: Path) -> list[Path]:
    from benchmarks import systems

    written = []
    for model in args.models:
        cfg = models.model_config(model, quick=args.quick, batch=args.batch)
        for n in args.world_sizes:
            backend, note = _backend_for(n, args.device)
            if not backend:
                _log(note or "")
                continue
            for name in args.profile:
                with _world(n, backend, args) as world:
                    world.run(systems.setup, cfg, args.seed, 8, args.kernel, args.bucket_numel)
                    world.run(systems.build, name)
                    res = world.run(systems.profile, name, args.profile_steps, max(args.warmup, 1))[0]
                path = out_prefix.with_name(f"{out_prefix.name}-profile-{name}-{model}-n{n}.txt")
                path.parent.mkdir(parents=True, exist_ok=True)
                ms = ", ".join(f"{t * 1e3:.1f}" for t in res["times"])
                traced = ", ".join(f"{t * 1e3:.1f}" for t in res["traced_times"])
                phases = "\n".join(f"  {k:<28} {v:9.2f} ms/step" for k, v in sorted(res["phases_ms"].items()))
                path.write_text(
                    f"# profile of {name}, {model}, N={n}, {backend}, rank 0, {args.profile_steps} steps each\n"
                    f"# step times without a profiler (ms): {ms}\n"
                    f"# step times under torch.profiler (ms): {traced}\n\n"
                    f"## phases (torch.profiler, CPU time per step)\n{phases}\n\n"
                    f"## torch.profiler, by self CPU time\n{res['torch']}\n\n"
                    f"## torch.profiler, by total CPU time\n{res['torch_total']}\n\n"
                    f"## cProfile (separate steps), by cumulative time\n{res['cprofile_cumulative']}\n\n"
                    f"## cProfile, by own time\n{res['cprofile_tottime']}\n"
                )
                _log(f"wrote {path}")
                written.append(path)
            try:
                with _world(n, backend, args) as world:
                    world.run(systems.setup, cfg, args.seed, 8, args.kernel, args.bucket_numel)
                    per_rank = world.run(systems.parts, max(2 * args.profile_steps, 3))
            except WorldError as exc:  # it reaches into zerofn's private bucket helpers
                if args.strict:
                    raise
                _log(f"parts of the step not timed: {_short(exc)}")
                continue
            path = out_prefix.with_name(f"{out_prefix.name}-parts-{model}-n{n}.txt")
            rows = [
                f"{label:<78} "
                + "  ".join(f"{r[i][1]:8.2f}" for r in per_rank)
                + "  "
                + "  ".join(f"{r[i][2]:8.2f}" for r in per_rank)
                for i, (label, *_) in enumerate(per_rank[0])
            ]
            head = (
                f"{'part (min over reps, ms)':<78} "
                + "  ".join(f"{'wall r' + str(r):>8}" for r in range(n))
                + "  "
                + "  ".join(f"{'cpu r' + str(r):>8}" for r in range(n))
            )
            path.write_text(
                f"# the parts of a step timed alone: {model}, N={n}, {backend}, {args.threads} thread(s) per rank\n"
                "# wall: elapsed; cpu: process CPU time of the rank (all its threads, gloo's included)\n"
                f"{head}\n" + "\n".join(rows).replace("     nan", "        ") + "\n"
            )
            _log(f"wrote {path}")
            written.append(path)
    return written


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; write the outputs; return the results dict."""
    import torch

    device_kind = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    out_prefix = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / device_kind
    if args.profile:
        return {"profiles": [str(p) for p in _profile(args, out_prefix)]}
    results: dict[str, Any] = {"meta": _meta(args), "runs": [], "notes": []}
    for model in args.models:
        for n in args.world_sizes:
            backend, note = _backend_for(n, args.device)
            if note:
                results["notes"].append(note)
                _log(note)
            if not backend:
                continue
            results["runs"].append(_bench_one(model, n, backend, args))
    results["meta"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["targets"] = report.targets(results["runs"])
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path = out_prefix.with_suffix(".json")
    md_path = out_prefix.with_suffix(".md")
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = report.markdown(results)
    plot_note = None if args.no_plot else report.plot(results, out_prefix.with_suffix(".png"))
    if plot_note:
        md += f"\n{plot_note}\n"
        _log(plot_note)
    md_path.write_text(md)
    _log(f"wrote {json_path} and {md_path}")
    print(md)
    return results


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
