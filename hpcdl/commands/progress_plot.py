"""`hpcdl status --plot FILE`: a run's curves as one PNG, from the groups' metrics.jsonl.

Panels: loss against step; each group's FLOP/s against wall time since the run's first logged
step, with their sum (the run's aggregate, the paper's figure of merit); and, for a hybrid run,
the master version each group last adopted against time (a group whose line flattens is not
receiving the applier's weights). TensorBoard shows the same per group; this is one file to look
at on a login node.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcdl.rundir.runs import RunDir
from hpcdl.fs.files import read_jsonl
from hpcdl.workloads.common import save_png

# Bins of the aggregate FLOP/s curve: groups log at different moments.
AGGREGATE_BINS = 60


def plot_run(run: RunDir, path: Path) -> Path:
    """Write the PNG to `path` (atomically); ValueError if no group has logged a step yet."""
    series = {g: rows for g in run.groups() if (rows := [m for m in read_jsonl(run.metrics_file(g)) if "step" in m])}
    if not series:
        raise ValueError(f"{run.root}: no group has logged a step yet, nothing to plot")
    t0 = min(rows[0]["time"] for rows in series.values())
    hybrid = any("exchange_version" in m for rows in series.values() for m in rows)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = 3 if hybrid else 2
    fig = Figure(figsize=(6.4, 2.6 * panels), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1)
    loss_ax, rate_ax = axes[0], axes[1]
    for g, rows in series.items():
        label = f"group {g}" if len(series) > 1 else None
        loss_ax.plot([m["step"] for m in rows], [m["loss"] for m in rows], lw=1.2, label=label)
        rate_ax.plot([m["time"] - t0 for m in rows], [m["flops_per_s_group"] / 1e9 for m in rows], lw=1, label=label)
        if hybrid:
            axes[2].step([m["time"] - t0 for m in rows], [m.get("exchange_version", -1) for m in rows],
                         where="post", lw=1, label=label)
    validated = sorted({(m["val_step"], m["val_loss"]) for rows in series.values() for m in rows
                        if m.get("val_loss") is not None and m.get("val_step") is not None})
    if validated:
        loss_ax.plot(*zip(*validated), "o--", color="black", ms=3, lw=1,
                     label="validation" + (" (master weights)" if hybrid else ""))
        loss_ax.legend(fontsize=7)
    if len(series) > 1:
        edges, total = aggregate_flops(series, t0)
        rate_ax.plot(edges, total / 1e9, color="black", lw=1.6, label="all groups")
    loss_ax.set(xlabel="step", ylabel="loss", title=f"{run.run_id}")
    if all(m["loss"] > 0 for rows in series.values() for m in rows):
        loss_ax.set_yscale("log")
    rate_ax.set(xlabel="seconds since the first logged step", ylabel="GFLOP/s")
    if hybrid:
        axes[2].set(xlabel="seconds since the first logged step", ylabel="master version adopted")
    for ax in axes:
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    return save_png(fig, Path(path))


def aggregate_flops(series: dict[int, list[dict]], t0: float) -> tuple[np.ndarray, np.ndarray]:
    """The groups' FLOP/s summed on a common time grid. A logged rate covers the window that ends
    at its time, so a grid point takes the group's next log; after its last log a group counts 0."""
    end = max(rows[-1]["time"] for rows in series.values()) - t0
    grid = np.linspace(0.0, end, AGGREGATE_BINS + 1)
    total = np.zeros_like(grid)
    for rows in series.values():
        times = np.array([m["time"] - t0 for m in rows])
        rates = np.array([m["flops_per_s_group"] for m in rows])
        index = np.searchsorted(times, grid, side="left")
        inside = index < len(times)
        total[inside] += rates[index[inside]]
    return grid, total
