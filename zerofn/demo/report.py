"""What the demo shows: the progress bar while it trains, the report text, the plot.

The report is the dict :func:`zerofn.demo.train` returns (its docstring lists the keys).
matplotlib is imported by :func:`write_plot` only, so the demo runs without it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from zerofn.demo.runs import CLASSES, HIDDEN, IN_DIM

__all__ = ["ProgressBar", "format_report", "write_plot"]


class ProgressBar:
    """One line of progress: redrawn in place on a terminal, printed once at the end otherwise.

    Written here so that torch stays zerofn's only run-time dependency.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.live = enabled and self.stream.isatty()  # no \r redraws in logs and pipes

    def update(self, done: int, note: str = "") -> None:
        """Show ``done`` of ``total`` steps, with ``note`` after the bar."""
        if not self.enabled or not (self.live or done == self.total):
            return
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{self.total} {time.perf_counter() - self.start:5.1f}s {note}"
        self.stream.write(f"\r{line}" if self.live else f"{line}\n")
        if self.live and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


# ---------------------------------------------------------------------------- the report


def _what_ran(r: dict[str, Any]) -> str:
    """The run in words: stage, API, ranks, dtype, steps."""
    api = "functional API" if r["api"] == "functional" else "ZeroOptimizer facade"
    if r["overlap"]:
        api += " with overlap"
    steps = f"{r['steps']} steps"
    if r["accumulate"] > 1:
        steps += f" x {r['accumulate']} micro-batches"
    wire = ", float64 wire" if r.get("wire") == "fp64" else ""
    return f"ZeRO stage {r['stage']}, {api}, {r['world_size']} gloo rank(s), {r['precision']}{wire}, {steps}"


def format_report(r: dict[str, Any]) -> str:
    """The report :func:`zerofn.demo.train` returns, as the lines the command line prints."""
    n = r["world_size"]
    theory, measured = r["theory_bytes_per_step"], r["bytes_sent_per_step"]
    bytes_ratio = f": {measured / theory:.2f}x" if theory else ""
    kinds = " + ".join(r["bytes_by_collective"]) or "none"
    clip = f", clip {r['max_norm']:g}" if r["max_norm"] is not None else ""
    if r["max_abs_diff"] == 0:
        verdict = "bitwise equal"
    else:
        verdict = "within" if r["parity_ok"] else "NOT within"
        verdict += f" the {r['precision']} tolerance (max rel diff <= {r['tolerance']:g})"
    state, ddp_state = r["state_bytes_per_rank"], r["ddp_state_bytes"]
    lines = [
        f"zerofn demo: {_what_ran(r)}, AdamW{clip}, MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{CLASSES} "
        f"(Ψ = {r['num_params']:,} params)",
        f"  loss             {r['loss_start']:.4f} -> {r['loss_end']:.4f}   "
        f"(DDP {r['ddp_loss_start']:.4f} -> {r['ddp_loss_end']:.4f})",
        f"  params vs DDP    max abs diff {r['max_abs_diff']:.3g}, max rel diff {r['max_rel_diff']:.3g}: {verdict}",
    ]
    if r["precision"] == "fp16":
        lines.append(
            f"  loss scale       {r['loss_scale_start']:g} -> {r['loss_scale_end']:g}, "
            f"{r['skipped']} of {r['steps']} steps skipped for overflow "
            f"(DDP + torch.amp.GradScaler: {r['ddp_skipped']})"
        )
    lines += [
        f"  optimizer state  {state:,} B per rank (fp32 master + AdamW shards) vs DDP {ddp_state:,} B "
        f"(replicated): {state / ddp_state:.2f}x",
        f"  bytes sent       {measured:,.0f} B per rank per step ({kinds})",
        f"                   vs 2(N-1)/N·Ψ·b = {theory:,.0f} B byte-optimal (b = {r['precision']}){bytes_ratio}",
    ]
    if r["accumulate"] > 1:
        lines.append(
            f"  accumulation     {r['accumulate']} micro-batches per step, one reduction: "
            f"{r['accumulation_bytes']:,} B sent before the last micro-batch"
        )
    lines.append(f"  time per step    zerofn {r['ms_per_step']:.2f} ms, DDP {r['ddp_ms_per_step']:.2f} ms (median)")
    if n > 1 and r["reduce"] != "reduce_scatter" and r["comm"] == "auto":
        lines.append(
            f"  (on gloo zerofn reduces with {r['reduce']} and gathers with {r['gather']}, gloo's\n"
            "   fastest; --comm byte-optimal uses reduce_scatter + all_gather)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the plot


def write_plot(r: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw a report into a PNG: both loss curves, and optimizer-state bytes per rank as bars.

    Needs matplotlib (imported here, so the demo runs without it when there is no plot).
    """
    import matplotlib

    matplotlib.use("Agg")  # draw into files only: no window, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.8, 1]})
    steps = range(1, len(r["losses"]) + 1)
    ax_loss.plot(steps, r["ddp_losses"], color="C0", lw=5, alpha=0.35, label="DDP + torch.optim.AdamW")
    ax_loss.plot(steps, r["losses"], color="C1", lw=1.3, ls="--", label=f"zerofn ZeRO-{r['stage']}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (global batch)")
    parity = "bitwise equal" if r["max_abs_diff"] == 0 else f"max rel diff {r['max_rel_diff']:.2g}"
    ax_loss.set_title(f"loss; final params vs DDP: {parity}", fontsize=10)
    ax_loss.legend(frameon=False)

    labels = ["DDP\n(replicated)", f"zerofn ZeRO-{r['stage']}\n(1/{r['world_size']} per rank)"]
    kib = 1024.0
    master = [r["ddp_master_bytes"] / kib, r["master_bytes_per_rank"] / kib]
    total = [r["ddp_state_bytes"] / kib, r["state_bytes_per_rank"] / kib]
    rest = [t - m for t, m in zip(total, master, strict=True)]
    ax_mem.bar(labels, master, color="C2", label="fp32 master weights")
    ax_mem.bar(labels, rest, bottom=master, color="C4", label="AdamW state")
    for i, t in enumerate(total):
        ax_mem.annotate(f"{t:,.0f} KiB", (i, t), ha="center", va="bottom", fontsize=9)
    ax_mem.set_ylim(0, max(total) * 1.2)
    ax_mem.set_ylabel("KiB per rank")
    ax_mem.set_title("optimizer state per rank", fontsize=10)
    ax_mem.legend(frameon=False, fontsize=8, loc="upper right")

    fig.suptitle(f"zerofn demo: {_what_ran(r)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
