"""The architecture diagram: SLURM's array of groups, the exchange directory, the appliers.

Drawn from this file alone (no measurements); change the boxes here and run
`python -m docs.figures architecture`.
"""

from __future__ import annotations

from docs.figures import save

NAME = "architecture"

GROUP_COLOUR, EXCHANGE_COLOUR, APPLIER_COLOUR, RUN_COLOUR = "#dbe9f6", "#fdf0d5", "#e3f1df", "#eeeeee"


def _box(ax, x, y, w, h, text, colour, size=9, weight="normal", edge="#444444", style="round,pad=0.02"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=colour, edgecolor=edge, linewidth=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def _arrow(ax, start, end, text="", colour="#333333", offset=(0.0, 0.0), rad=0.0):
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.4, connectionstyle=f"arc3,rad={rad}"))
    if text:
        mx, my = (start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1]
        ax.text(mx, my, text, ha="center", va="center", fontsize=7.5, color=colour,
                bbox=dict(facecolor="white", edgecolor="none", pad=1.0))


def draw():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 7.1))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 7.1)
    ax.axis("off")

    # SLURM's job array: one element per group
    _box(ax, 0.1, 0.95, 3.9, 5.5, "", "white", edge="#1f5f99", style="round,pad=0.05")
    ax.text(2.05, 6.8, "SLURM job array (group.sbatch):\none element per group", ha="center", va="center", fontsize=9.5,
            weight="bold", color="#1f5f99")
    roots = []
    for i, (label, y) in enumerate((("group 0", 4.45), ("group 1", 2.85), ("group G−1", 1.15))):
        _box(ax, 0.3, y, 3.5, 1.35, "", GROUP_COLOUR)
        ax.text(0.42, y + 1.12, f"{label}: synchronous, Horovod\nallreduce (Gloo or MPI)", fontsize=7.5, va="center")
        for r in (3, 2, 1, 0):  # the root on the right, next to the exchange it talks to
            name = "rank 0\n(root)" if r == 0 else f"rank {r}"
            _box(ax, 0.42 + (3 - r) * 0.85, y + 0.12, 0.7, 0.62, name, "white", size=7,
                 weight="bold" if r == 0 else "normal")
        roots.append((3.67, y + 0.43))
    ax.text(2.05, 2.58, "⋮", ha="center", fontsize=14)
    ax.text(2.05, 0.55, "each rank streams its shard of data.train (HDF5);\nevery step: loss, gradient, "
            "allreduce, inner optimizer", ha="center", fontsize=7.5, color="#333333")

    # the exchange directory
    _box(ax, 5.4, 1.5, 2.5, 4.2, "", EXCHANGE_COLOUR, style="round,pad=0.05")
    ax.text(6.65, 6.8, "exchange directory\n(shared file system, e.g. Lustre)", ha="center", va="center",
            fontsize=9, weight="bold")
    listing = ("shard-<k>/\n"
               "  updates/u-g…-s….hx\n"
               "    a group's gradient or delta\n"
               "  weights/w-v….hx\n"
               "    master versions\n"
               "  applier/state.hx\n"
               "    durable state, ledger\n\n"
               "every file: temporary name,\n"
               "fsync, rename; Poly1305 tag\n"
               "under the run's key")
    ax.text(5.55, 3.3, listing, ha="left", va="center", fontsize=7.8, family="monospace")

    # the appliers: one per shard, in the applier's SLURM job
    _box(ax, 8.3, 0.95, 3.55, 5.5, "", "white", edge="#2e7d32", style="round,pad=0.05")
    ax.text(10.07, 6.8, "applier job (applier.sbatch):\none task per shard", ha="center", va="center", fontsize=9.5, weight="bold",
            color="#2e7d32")
    for k, y in enumerate((4.6, 3.1, 1.3)):
        label = "applier, shard K−1" if k == 2 else f"applier, shard {k}"
        _box(ax, 8.5, y, 3.15, 1.1, f"{label}\nreads, verifies, applies its rule\n(adam, sgd, momentum, nesterov)"
             "\ncommits its state, publishes v+1", APPLIER_COLOUR, size=7.5)
    ax.text(10.07, 2.7, "⋮", ha="center", fontsize=14)

    # the flow of one exchange
    (x0, y0), (x1, y1), (x2, y2) = roots
    _arrow(ax, (x0, y0 + 0.12), (5.4, 5.0), colour="#b35900")
    _arrow(ax, (5.4, 4.45), (x0, y0 - 0.12), colour="#1f5f99")
    ax.text(4.6, 5.65, "the root publishes\nan update every\nexchange.every steps", ha="center", fontsize=7,
            color="#b35900")
    ax.text(4.6, 3.75, "and adopts the\nnewest master\nversion; the group\nbroadcasts it", ha="center",
            fontsize=7, color="#1f5f99")
    _arrow(ax, (x1, y1), (5.4, 3.3), colour="#b35900")
    _arrow(ax, (x2, y2), (5.4, 2.0), colour="#b35900")
    _arrow(ax, (7.9, 4.75), (8.5, 5.05), colour="#b35900")
    _arrow(ax, (8.5, 4.8), (7.9, 4.35), colour="#2e7d32")
    ax.text(8.2, 5.25, "updates", ha="center", fontsize=7, color="#b35900")
    ax.text(8.2, 4.15, "weights", ha="center", fontsize=7, color="#2e7d32")
    _arrow(ax, (7.9, 3.3), (8.5, 3.65), colour="#b35900")
    _arrow(ax, (7.9, 1.9), (8.5, 1.85), colour="#b35900")

    # the run directory under everything
    _box(ax, 0.1, 0.05, 11.75, 0.35, "run directory runs/<run-id>/: job.toml, run.json, groups/<g>/metrics.jsonl, "
         "checkpoints/<g>/, scheduler/ — `hpcdl status` reads only these files", RUN_COLOUR, size=8)
    return save(fig, NAME)
