"""Turn raw per-rank measurements into figures, targets, a markdown table and a plot.

Pure functions of the results dict (no torch), so a saved JSON can be re-rendered::

    import json
    from benchmarks import report
    print(report.markdown(json.load(open("benchmarks/results/cpu.json"))))

Definitions (also in benchmarks/README.md):

* step time: wall time of one whole training step on a rank; per step the slowest
  rank's time counts; the table shows the median over all timed steps of all rounds.
* state + master bytes: bytes of the optimizer state this rank holds (AdamW's exp_avg and
  exp_avg_sq, fp32, plus its per-tensor step counters) plus the fp32 weights the optimizer
  kernel writes on this rank (DDP: the full params; ZeroRedundancyOptimizer: its partition;
  FSDP2: its parameter shards; DeepSpeed and zerofn: their fp32 master partition/shards).
  Theory for a sharded system is (4+K)·ceil(Ψ/N) with K = 8 (4 B master + 4 B exp_avg +
  4 B exp_avg_sq per element); for DDP it is (4+K)·Ψ.
* bytes sent: what this rank sends per step under the textbook algorithm of each
  collective actually issued (ring all-reduce 2(N-1)/N·m·b, ring all-gather and
  reduce-scatter (N-1)/N·m·b, broadcast (N-1)·m·b on the root), against the byte-optimal
  2(N-1)/N·Ψ·b.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["SUMMARY_SYSTEMS", "derive", "markdown", "plot", "targets"]

# The systems the benchmarks page and the plot compare, (name, what a reader calls it), in order.
SUMMARY_SYSTEMS = (
    ("ddp-fused", "DDP + fused AdamW"),
    ("zero-redundancy", "ZeroRedundancy&shy;Optimizer"),  # may break on a phone
    ("fsdp2", "FSDP2"),
    ("deepspeed-z2", "DeepSpeed ZeRO-2"),
    ("zerofn-s2-overlap", "zerofn facade, stage 2"),
    ("zerofn-fn-donated", "zerofn functional"),
    ("zerofn-s2-compiled", "zerofn facade, compiled"),
    ("zerofn-fn-compiled", "zerofn functional, compiled"),
    ("zerofn-fn-compiled-inductor", "zerofn functional, inductor"),
)

K_ADAMW = 8  # exp_avg + exp_avg_sq, fp32
MASTER_B = 4  # fp32 master
ELEM_B = 4  # fp32 params and grads on the wire


def _ok(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    s = run["systems"].get(name)
    return s if s is not None and s.get("status") == "ok" and s.get("median_ms") is not None else None


def zerofn_expected_bytes(n: int, shard_elems: int, elem: int, stage_reduce_all_reduce: bool) -> int:
    """Bucket bytes zerofn's realisation sends per step: reduce + gather (no checks, no scalars).

    reduce: all-reduce (stage 1) 2(N-1)·S·b, or reduce-scatter or all-to-all (N-1)·S·b;
    gather: one broadcast per rank or all-gather, (N-1)·S·b either way; S = sum of this
    rank's shard elements.
    """
    reduce = 2 if stage_reduce_all_reduce else 1
    return (n - 1) * shard_elems * elem * (reduce + 1)


def derive(run: dict[str, Any], reference: str = "ddp-fused") -> None:
    """Add ratios, loss agreement, state and byte figures to every system of ``run`` (in place)."""
    n, psi = run["world_size"], run["psi"]
    ref = _ok(run, reference)
    ref_foreach = _ok(run, "ddp-foreach")
    byte_theory = 2 * (n - 1) * psi * ELEM_B / n
    for name, s in run["systems"].items():
        if s.get("status") != "ok" or s.get("median_ms") is None:
            continue
        s["ratio_ddp_fused"] = s["median_ms"] / ref["median_ms"] if ref else None
        s["ratio_ddp_foreach"] = s["median_ms"] / ref_foreach["median_ms"] if ref_foreach else None
        losses = s["losses"]
        s["final_loss"] = sum(r[-1] for r in losses) / len(losses) if losses and losses[0] else None
        if ref is not None:
            diffs = [
                abs(a - b)
                for mine, theirs in zip(losses, ref["losses"], strict=True)
                for a, b in zip(mine, theirs, strict=False)
            ]
            s["max_loss_diff_vs_ref"] = max(diffs) if diffs else None
            s["final_loss_diff_vs_ref"] = (
                abs(s["final_loss"] - ref["final_loss"])
                if s.get("final_loss") is not None and ref.get("final_loss") is not None
                else None
            )
        # state + master bytes
        desc = s.get("describe")
        if desc:
            totals = [
                (d["state"]["opt_state"] or 0) + (d["state"]["master"] or 0)
                for d in desc
                if d["state"]["opt_state"] is not None
            ]
            s["state_master_bytes"] = max(totals) if totals else None
            s["param_bytes"] = max((d["state"]["params"] or 0) for d in desc)
            sharded = s["family"] == "zerofn" or name in ("fsdp2", "zero-redundancy") or name.startswith("deepspeed")
            theory = (MASTER_B + K_ADAMW) * (math.ceil(psi / n) if sharded else psi)
            s["state_theory"] = theory
            s["state_ratio"] = s["state_master_bytes"] / theory if s.get("state_master_bytes") else None
        # bytes sent per rank per step
        s["bytes_theory"] = byte_theory
        if "-compiled" in name:
            # A compiled graph's collectives are not counted when it runs (count_bytes sees the eager calls).
            s["bytes_sent"] = None
            s["bytes_source"] = "not counted: the compiled step's collectives run inside its graph"
            s.pop("bytes_extra", None)
        elif s["family"] == "zerofn":
            s["bytes_sent"] = s.get("zerofn_bytes")
            s["bytes_source"] = "zerofn count_bytes"
            d0 = desc[0] if desc else None
            if d0 and "shard_elems" in d0:
                all_reduce = name.startswith("zerofn-s1")  # stage 2: reduce-scatter, or all-to-all on gloo
                exp = zerofn_expected_bytes(n, d0["shard_elems"], d0["elem_size"], all_reduce)
                s["bytes_expected_buckets"] = exp
                s["bytes_extra"] = s["bytes_sent"] - exp if s.get("bytes_sent") is not None else None
        elif name in ("ddp-fused", "ddp-foreach", "zero-redundancy"):
            visible = s.get("python_bytes") or 0
            s["bytes_sent"] = byte_theory + visible
            s["bytes_source"] = "DDP all-reduce from theory" + (" + counted broadcasts" if visible else "")
        else:
            s["bytes_sent"] = s.get("python_bytes")
            s["bytes_source"] = "counted (torch.distributed wrapper)"
        s["bytes_ratio"] = s["bytes_sent"] / byte_theory if s.get("bytes_sent") is not None and byte_theory else None


def _best(run: dict[str, Any], names: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    cands = [(nm, _ok(run, nm)) for nm in names]
    cands = [(nm, s) for nm, s in cands if s is not None]
    return min(cands, key=lambda c: c[1]["median_ms"]) if cands else None


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The speed, memory and byte targets zerofn is held to, evaluated on every run they apply to."""
    out: list[dict[str, Any]] = []

    def add(target: str, run: dict[str, Any], value: float | None, limit: float, detail: str) -> None:
        out.append(
            {
                "target": target,
                "model": run["model"],
                "world_size": run["world_size"],
                "value": value,
                "limit": limit,
                "met": None if value is None else value <= limit,
                "detail": detail,
            }
        )

    s2 = ("zerofn-s2", "zerofn-s2-overlap", "zerofn-s2-overlap-ag")
    for run in runs:
        best = _best(run, s2)
        if best is not None:
            nm, s = best
            add("stage-2 facade <= 0.75x DDP foreach", run, s.get("ratio_ddp_foreach"), 0.75, nm)
            add("stage-2 facade <= 1.0x DDP fused", run, s.get("ratio_ddp_fused"), 1.0, nm)
            for peer in ("zero-redundancy", "fsdp2", "deepspeed-z2"):
                p = _ok(run, peer)
                if p is not None:
                    add(f"stage-2 facade faster than {peer}", run, s["median_ms"] / p["median_ms"], 1.0, nm)
        pure, donated = _ok(run, "zerofn-fn-pure"), _ok(run, "zerofn-fn-donated")
        if pure and donated:
            add("pure functional <= 1.10x donated", run, pure["median_ms"] / donated["median_ms"], 1.10, "")
        zsys = [(nm, s) for nm, s in run["systems"].items() if s.get("family") == "zerofn" and _ok(run, nm)]
        states = [(s["state_ratio"], nm) for nm, s in zsys if s.get("state_ratio") is not None]
        if states:
            worst = max(states)
            add("state bytes <= theory + 0.1%", run, worst[0], 1.001, f"worst: {worst[1]}")
        for label, pick in (("default policy", lambda nm: nm != "zerofn-s2-byteopt"), ("byte-optimal", None)):
            cands = [
                (s["bytes_ratio"], nm, s.get("bytes_extra"))
                for nm, s in zsys
                if s.get("bytes_ratio") is not None and (pick(nm) if pick else nm == "zerofn-s2-byteopt")
            ]
            if cands:
                ratio, nm, extra = max(cands)
                detail = f"{label}, worst: {nm}" + (f"; +{extra:.0f} B/step of checks and scalars" if extra else "")
                add("bytes sent = 2(N-1)/N·Ψ·b (+ O(1))", run, ratio, 1.001, detail)
    by_key = {(r["model"], r["world_size"]): r for r in runs}
    for (model, n), small in by_key.items():
        large = by_key.get(("mlp-large", n))
        if model != "mlp-small" or large is None:
            continue
        for names in (s2, ("ddp-fused",)):
            bs, bl = _best(small, names), _best(large, names)
            if bs and bl:
                add(
                    "mlp-small <= 1.5x mlp-large",
                    small,
                    bs[1]["median_ms"] / bl[1]["median_ms"],
                    1.5,
                    f"{bs[0]} vs {bl[0]}" + (" (context: the baseline's own ratio)" if names[0] == "ddp-fused" else ""),
                )
    return out


# ----------------------------------------------------------------------------- rendering


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def markdown(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    args = meta.get("args", {})
    lines = [
        "# zerofn benchmark results",
        "",
        f"- date: {meta.get('date')}; zerofn commit {meta.get('zerofn_commit')}; torch {meta.get('torch')}; "
        f"deepspeed {meta.get('deepspeed') or 'not installed'}; python {meta.get('python')}",
        f"- machine: {meta.get('cpus')} CPUs, {meta.get('gpus')} GPUs; load average at start "
        f"{_loads(meta.get('loadavg_start'))}, at end {_loads(meta.get('loadavg_end'))}",
        f"- settings: {args.get('threads')} thread(s) per rank, AdamW kernel `{args.get('kernel')}`, "
        f"{args.get('rounds')} rounds x {args.get('steps')} timed steps per system (+{args.get('block_warmup')} "
        f"untimed per block, +{args.get('warmup')} warm-up), quick={args.get('quick')}",
    ]
    if meta.get("note"):
        lines.append(f"- note: {meta['note']}")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    for run in results.get("runs", []):
        n = run["world_size"]
        lines += [
            "",
            f"## {run['model']}, N = {n} ({run['backend']}, {run['device']}): Ψ = {run['psi']:,} in "
            f"{run['n_params']} tensors",
            "",
            "| system | median ms | min ms | p10–p90 ms | × DDP fused | × DDP foreach | max abs Δloss vs DDP |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        # the memory and byte figures in a second table, so that neither is wider than a page
        costs = [
            "",
            "| system | peak RSS MiB/rank (Δ) | state+master MiB/rank | ÷ (4+K)·⌈Ψ/N⌉ | sent MiB/rank/step "
            "| ÷ 2(N-1)/N·Ψ·b | page faults/step |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        notes = []
        for name, s in run["systems"].items():
            if s.get("status") != "ok":
                notes.append(f"- `{name}` {s.get('status')}: {s.get('note')}")
                continue
            mem = s.get("memory") or {}
            rss = "–"
            if mem.get("peak_rss"):
                rss = f"{max(mem['peak_rss']) / 2**20:.0f} ({max(mem['delta']) / 2**20:+.0f})"
            elif mem.get("error"):
                rss = "error"
            theory_mark = "" if s.get("family") == "zerofn" or name in ("fsdp2",) or "deepspeed" in name else "*"
            if s.get("source"):  # joined from another run (benchmarks/page.py --merge)
                notes.append(f"- `{name}` †: from another run, its ratios against that run's DDP: {s['source']}")
            label = f"`{name}`" + (" †" if s.get("source") else "")
            lines.append(
                f"| {label} | {_f(s.get('median_ms'))} | {_f(s.get('min_ms'))} "
                f"| {_f(s.get('p10_ms'))}–{_f(s.get('p90_ms'))} "
                f"| {_f(s.get('ratio_ddp_fused'), '{:.2f}')} | {_f(s.get('ratio_ddp_foreach'), '{:.2f}')} "
                f"| {_f(s.get('max_loss_diff_vs_ref'), '{:.1e}')} |"
            )
            costs.append(
                f"| {label} | {rss} | {_mib(s.get('state_master_bytes'))} | {_f(s.get('state_ratio'), '{:.4f}')} "
                f"| {_mib(s.get('bytes_sent'))}{theory_mark} | {_f(s.get('bytes_ratio'), '{:.3f}')} "
                f"| {_f(s.get('minor_faults'), '{:,.0f}')} |"
            )
            if s.get("note"):
                notes.append(f"- `{name}`: {s['note']}")
            per_rank = [d.get("compile") for d in s.get("describe") or [] if d and d.get("compile")]
            if per_rank:  # the slowest rank's
                # (ZEROFN_BENCH_WARM_COMPILE=0 compiles once: no warm time, a dash)
                cold, warm = (
                    max((c[k] for c in per_rank if c.get(k) is not None), default=None) for k in ("cold_s", "warm_s")
                )
                notes.append(
                    f"- `{name}` compile time (slowest rank): cold {_f(cold)} s (a fresh process), "
                    f"warm {_f(warm)} s (after a dynamo reset, caches filled)"
                )
        lines += costs
        lines.append("")
        lines.append(
            "\\* DDP's gradient all-reduce runs in C++ and is not counted: its bytes are the ring all-reduce "
            "volume 2(N-1)/N·Ψ·b (plus, for ZeroRedundancyOptimizer, its counted broadcasts)."
        )
        zf_extra = [
            f"`{nm}` {s['bytes_extra']:.0f} B"
            for nm, s in run["systems"].items()
            if s.get("bytes_extra") is not None and s.get("status") == "ok"
        ]
        if zf_extra:
            lines.append(
                "zerofn bytes beyond its bucket formula (rank-agreement checks + norm scalars): " + ", ".join(zf_extra)
            )
        lines += notes
    tg = results.get("targets") or []
    if tg:
        lines += [
            "",
            "## Targets",
            "",
            "| target | model | N | value | limit | met | system |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for t in tg:
            met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(
                f"| {t['target']} | {t['model']} | {t['world_size']} | {_f(t['value'], '{:.3f}')} | {t['limit']} "
                f"| {met} | {t['detail']} |"
            )
    return "\n".join(lines) + "\n"


def _loads(x: Any) -> str:
    return "–" if not x else "/".join(f"{v:.1f}" for v in x)


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Step time against DDP + fused AdamW: one group of bars per compared system, one bar per
    (model, N), on one axis; returns a note if it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no plot: matplotlib is not installed; pip install matplotlib to get one)"
    runs = [r for r in results.get("runs", []) if _ok(r, "ddp-fused")]
    names = [(nm, label.replace("&shy;", "")) for nm, label in SUMMARY_SYSTEMS if any(_ok(r, nm) for r in runs)]
    if not runs or len(names) < 2:
        return "(no plot: no system ran beside ddp-fused)"
    fig, ax = plt.subplots(figsize=(7.0, 0.16 * len(names) * len(runs) + 1.4))
    height = 0.8 / len(runs)
    for i, run in enumerate(runs):
        ys, vals = [], []
        for j, (nm, _) in enumerate(names):
            s = _ok(run, nm)
            if s is not None:
                ys.append(j + i * height)
                # a system joined from another run keeps its ratio to that run's DDP
                vals.append(s.get("ratio_ddp_fused") or s["median_ms"] / _ok(run, "ddp-fused")["median_ms"])
        ax.barh(ys, vals, height=height, label=f"{run['model']}, N={run['world_size']}")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    centres = [j + (len(runs) - 1) * height / 2 for j in range(len(names))]
    ax.set_yticks(centres, [label for _, label in names], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("median step time / DDP + fused AdamW's (lower is faster)")
    ax.legend(fontsize=8, loc="lower right")
    date = str(results.get("meta", {}).get("date", ""))[:10]
    ax.set_title(f"zerofn and its peers, {date}; dashed: DDP + fused AdamW", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
