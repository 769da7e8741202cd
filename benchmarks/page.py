"""The answer at the top of the benchmarks page, generated from one results file.

``docs/benchmarks.md`` holds the line ``<!-- benchmarks-summary: benchmarks/results/latest.json -->``;
when the site is built, ``scripts/docs_hooks.py`` replaces it with :func:`summary` of that
file: one table (step time of zerofn against DDP with fused AdamW, torch's
ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO-2 on every benchmark model; memory and
bytes sent per rank; the compiled step's compile time) and the machine it ran on. The
plot beside it is the ``.png`` the same run wrote (:func:`benchmarks.report.plot`). So one
run refreshes the page::

    python -m benchmarks.run --out benchmarks/results/latest --note "quiet machine"

Pure functions of the results dict (no torch). ``python -m benchmarks.page FILE.json``
prints the summary; ``python -m benchmarks.page --merge OUT A.json B.json ...`` joins the
runs of several files into one (systems a later file adds to a run keep their own
ratios and are marked with the file they come from) and writes ``OUT.json``, ``.md`` and
``.png`` as a run would.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/page.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report

__all__ = ["COMPILED_SYSTEMS", "SUMMARY_SYSTEMS", "compiled", "merge", "summary"]

SUMMARY_SYSTEMS = report.SUMMARY_SYSTEMS
REFERENCE = "ddp-fused"
# What the jit page compares: each compiled step beside the eager step it compiles.
COMPILED_SYSTEMS = (
    ("zerofn-fn-donated", "functional, eager"),
    ("zerofn-fn-compiled", "functional, aot_eager"),
    ("zerofn-fn-compiled-inductor", "functional, inductor"),
    ("zerofn-s2", "facade, eager"),
    ("zerofn-s2-compiled", "facade, inductor"),
)


def _ok(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    s = run["systems"].get(name)
    return s if s is not None and s.get("status") == "ok" and s.get("median_ms") is not None else None


def _memory_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run whose memory and bytes the table shows: the first with peak RSS measured."""
    for run in runs:
        if any((s.get("memory") or {}).get("peak_rss") for s in run["systems"].values()):
            return run
    return runs[0] if runs else None


def _compile(s: dict[str, Any]) -> str:
    cold, warm = s.get("compile_cold_s"), s.get("compile_warm_s")
    if cold is None or cold != cold:  # absent or nan
        return ""
    return f"{cold:.0f}" + (f" / {warm:.0f}" if warm is not None and warm == warm else "")


def _source_mark(s: dict[str, Any], sources: list[str]) -> str:
    src = s.get("source")
    if not src:
        return ""
    if src not in sources:
        sources.append(src)
    return "†" * (sources.index(src) + 1)


def summary(results: dict[str, Any]) -> str:
    """The page's tables and the machine, as Markdown (see the module docstring).

    Two narrow tables of the same run rather than one wide one, so that both read on a
    phone: step time per model and world size; memory, bytes and compile time.
    """
    runs = [r for r in results.get("runs", []) if _ok(r, REFERENCE)]
    if not runs:
        return "*(no run with DDP + fused AdamW in this results file)*\n"
    mem = _memory_run(runs)
    shown = [(name, label) for name, label in SUMMARY_SYSTEMS if any(_ok(r, name) for r in runs)]
    heads = [f"{r['model']}<br>N={r['world_size']}" for r in runs]
    time_rows = ["| system | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    cost_rows = ["| system | peak RSS<br>MiB/rank | sent<br>MiB/step | compile<br>s |", "|---|---:|---:|---:|"]
    sources: list[str] = []
    for name, label in shown:
        cells = []
        for r in runs:
            s = _ok(r, name)
            if s is None:
                cells.append("–")
            elif name == REFERENCE:
                cells.append(f"{s['median_ms']:.0f} ms")
            else:
                ratio = s.get("ratio_ddp_fused")
                cells.append(("–" if ratio is None else f"{ratio:.2f}×") + _source_mark(s, sources))
        time_rows.append(f"| {label} | " + " | ".join(cells) + " |")
        m = _ok(mem, name) if mem else None
        rss = ((m or {}).get("memory") or {}).get("peak_rss")
        rss_cell = f"{max(rss) / 2**20:.0f}" if rss else "–"
        sent = None if "-compiled" in name else (m or {}).get("bytes_sent")  # inside the graph: not counted
        star = "\\*" if name in ("ddp-fused", "zero-redundancy") else ""  # DDP's all-reduce: from theory
        sent_cell = "–" if sent is None else f"{sent / 2**20:.1f}{star}"
        comp = next((_compile(s) for r in runs if (s := _ok(r, name)) and _compile(s)), "") or "–"
        if (rss_cell, sent_cell, comp) != ("–", "–", "–"):
            cost_rows.append(f"| {label} | {rss_cell} | {sent_cell} | {comp} |")
    meta = results.get("meta", {})
    args = meta.get("args") if isinstance(meta.get("args"), dict) else {}
    where = f"{mem['model']} at N = {mem['world_size']}" if mem else "–"
    lines = [
        "**Step time**, the median step as a multiple of DDP + fused AdamW's in the same run (its "
        "row: milliseconds); lower is faster:",
        "",
        *time_rows,
        "",
    ]
    for i, src in enumerate(sources):
        lines += [f"{'†' * (i + 1)} From another run, against that run's DDP: {src}.", ""]
    lines += [
        f"**Memory, bytes and compile time** ({where}): the largest rank's peak RSS, each system "
        "alone in fresh processes; bytes sent per rank per step (\\* DDP's all-reduce runs in C++: "
        "its ring volume 2(N-1)/N·Ψ·b); the compiled step's first call in a fresh process / again "
        "after `torch._dynamo.reset()`, slowest rank:",
        "",
        *cost_rows,
        "",
        _machine(meta, args),
    ]
    for src in meta.get("sources", [])[1:]:
        when = src["date"].replace("T", " ")
        lines += ["", f"Merged with `{src['file']}` ({when} UTC, zerofn {src['commit']}, load average {src['load']})."]
    return "\n".join(lines) + "\n"


def compiled(results: dict[str, Any]) -> str:
    """The compiled steps beside the eager ones (``<!-- benchmarks-compiled: PATH.json -->`` on
    the jit page), as Markdown: step time as a multiple of DDP + fused AdamW's per model and
    world size, then each compiled step's first call cold / again after a reset, in seconds.
    Systems the file does not hold are left out."""
    runs = [r for r in results.get("runs", []) if _ok(r, REFERENCE)]
    shown = [(name, label) for name, label in COMPILED_SYSTEMS if any(_ok(r, name) for r in runs)]
    if not runs or not shown:
        return "*(no compiled step in this results file)*\n"
    heads = [f"{r['model']}<br>N={r['world_size']}" for r in runs]
    time_rows = ["| zerofn step | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    compile_rows = ["| compiled step | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for name, label in shown:
        ok = [_ok(r, name) for r in runs]
        ratios = [(s or {}).get("ratio_ddp_fused") for s in ok]
        time_rows.append(f"| {label} | " + " | ".join("–" if x is None else f"{x:.2f}×" for x in ratios) + " |")
        if "-compiled" in name:
            compile_rows.append(f"| {label} | " + " | ".join((s and _compile(s)) or "–" for s in ok) + " |")
    meta = results.get("meta", {})
    args = meta.get("args") if isinstance(meta.get("args"), dict) else {}
    lines = [
        "**Step time**, the median step as a multiple of DDP + fused AdamW's in the same run; lower is faster:",
        "",
        *time_rows,
        "",
        "**Compile time**, seconds: the first call in a fresh process / again after `torch._dynamo.reset()`, "
        "slowest rank:",
        "",
        *compile_rows,
        "",
        _machine(meta, args),
    ]
    return "\n".join(lines) + "\n"


def _machine(meta: dict[str, Any], args: dict[str, Any]) -> str:
    load = "/".join(f"{v:.1f}" for v in (meta.get("loadavg_start") or [])[:1] + (meta.get("loadavg_end") or [])[:1])
    threads = args.get("threads", 1)
    return (
        f"**Machine:** {meta.get('cpus')} CPU cores, {meta.get('gpus') or 'no'} GPUs, gloo, {threads} thread per rank; "
        f"torch {meta.get('torch')}, DeepSpeed {meta.get('deepspeed') or 'not installed'}, "
        f"Python {meta.get('python')}; "
        f"zerofn {meta.get('zerofn_commit')}, {str(meta.get('date', ''))[:16].replace('T', ' ')} UTC; load average "
        f"{load or '–'} (start/end)." + (f" Note: {meta['note']}" if meta.get("note") else "")
    )


def merge(paths: list[Path]) -> dict[str, Any]:
    """One results dict from several files' runs (see the module docstring)."""
    files = [(p, json.loads(p.read_text())) for p in paths]
    first = files[0][1]
    out = {"meta": dict(first["meta"]), "runs": [], "notes": list(first.get("notes", []))}
    out["meta"]["sources"] = []
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for path, res in files:
        meta = res["meta"]
        label = f"`{path.name}` ({str(meta.get('date', ''))[:10]}, zerofn {meta.get('zerofn_commit')})"
        out["meta"]["sources"].append(
            {
                "file": path.name,
                "date": str(meta.get("date", ""))[:16],
                "commit": meta.get("zerofn_commit"),
                "load": "/".join(f"{v:.1f}" for v in (meta.get("loadavg_start") or [])[:1]),
            }
        )
        for run in res["runs"]:
            key = (run["model"], run["world_size"])
            if key not in by_key:
                by_key[key] = run
                out["runs"].append(run)
                continue
            for name, s in run["systems"].items():
                if name not in by_key[key]["systems"]:
                    by_key[key]["systems"][name] = {**s, "source": label}
    out["targets"] = report.targets(out["runs"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.page", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="results JSON files")
    p.add_argument("--merge", type=Path, default=None, help="write OUT.json/.md/.png from the files' runs joined")
    p.add_argument("--note", default=None, help="with --merge: the merged file's note (default: the first file's)")
    args = p.parse_args(argv)
    if args.merge is None:
        for f in args.files:
            print(summary(json.loads(f.read_text())))
        return 0
    res = merge(args.files)
    if args.note is not None:
        res["meta"]["note"] = args.note
    out = args.merge
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    md = report.markdown(res)
    note = report.plot(res, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(md + (f"\n{note}\n" if note else ""))
    print(summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
