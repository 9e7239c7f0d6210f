"""Terminal rendering with rich: the status screen, training progress, metric tables."""

from __future__ import annotations

from typing import Any, Mapping

from rich.console import Group
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def si(value: float | None, unit: str = "") -> str:
    """1.23e12 -> '1.23 T'."""
    if value is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{prefix}{unit}"
    return f"{value:.3g}{unit}"


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def status_view(status: Mapping[str, Any]):
    title = (f"[bold]{status['run_id']}[/] · {status['workload']} · {status['backend']} · "
             f"[bold]{status['state']}[/]" + (f" · {status['note']}" if status.get("note") else ""))
    groups = Table(title=title, title_justify="left", expand=False)
    for column in ("grp", "state", "step", "loss", "img/s", "FLOP/s", "sustained",
                   "xchg age", "stale", "rest."):
        groups.add_column(column, justify="left" if column == "state" else "right", no_wrap=True)
    for g in status["groups"]:
        stale = "-"
        if g.get("staleness_mean") is not None:
            stale = f"{g['staleness_mean']:.1f}/{g.get('staleness_max', 0)}"
        slurm = g["backend"].get("nodes")
        state = g["state"] + (f" ({slurm})" if slurm else "")
        groups.add_row(str(g["group"]), state, f"{g['step']}/{g['steps']}", _num(g["loss"]),
                       _num(g["images_per_s"], "{:.1f}"), si(g["flops_per_s"]),
                       si(g["sustained_flops_per_s"]), _age(g.get("exchange_age_s")), stale,
                       str(g["restarts"]))
    parts = [groups]
    warnings = storage_warnings(status.get("storage") or [])
    if warnings is not None:
        parts.insert(0, warnings)
    applier = status.get("applier")
    if applier is not None:
        table = Table(title="applier (master weights)", title_justify="left")
        for column in ("state", "version", "applied", "dropped", "rejected", "backlog", "stale mean/max"):
            table.add_column(column, justify="right", no_wrap=True)
        backend = applier.get("backend") or {}
        running = backend.get("state") or ("running" if backend.get("running") else "stopped")
        table.add_row(running, _num(applier.get("version"), "{}"), _num(applier.get("applied"), "{}"),
                      _num(applier.get("dropped"), "{}"), _num(applier.get("rejected"), "{}"),
                      _num(applier.get("backlog"), "{}"),
                      f"{_num(applier.get('staleness_mean'), '{:.2f}')}/{_num(applier.get('staleness_max'), '{}')}")
        parts.append(table)
    t = status["totals"]
    per_node = (t["sustained_flops_per_s"] / t["nodes"]) if t.get("sustained_flops_per_s") else None
    parts.append(
        f"total: {_num(t['images_per_s'], '{:.1f}')} images/s · sustained {si(t['sustained_flops_per_s'], 'FLOP/s')}"
        f" ({si(per_node, 'FLOP/s')} per node) · peak {si(t['peak_flops_per_s'], 'FLOP/s')}"
    )
    return Group(*parts)


def storage_warnings(warnings: list[Mapping[str, Any]]):
    """A red block listing storage problems (full disk, quota), or None when there are none."""
    if not warnings:
        return None
    table = Table(title="[bold red]⚠ storage problems[/] (writes failed; training goes on)",
                  title_justify="left", show_header=False, border_style="red")
    table.add_column("where", style="bold red", no_wrap=True)
    table.add_column("what", style="red", no_wrap=True)
    table.add_column("problem", style="red")
    for w in warnings:
        count = f" ({w['count']}×)" if w.get("count") else ""
        age = f", last {_age(w['age_s'])} ago" if w.get("age_s") else ""
        detail = f" — {w['detail']}" if w.get("detail") else ""
        table.add_row(escape(str(w.get("where", ""))), escape(str(w.get("what", ""))),
                      escape(f"{w.get('error', '')}{count}{age}{detail}"))
    return table


def metrics_table(title: str, metrics: Mapping[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("metric")
    numbers = all(isinstance(v, (int, float)) for v in metrics.values())
    table.add_column("value", justify="right" if numbers else "left")  # digits align; prose reads
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        table.add_row(key, str(value))
    return table


def training_progress(console) -> Progress:
    return Progress(
        TextColumn("[bold]group {task.fields[group]}[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console,
    )


def counting_progress(console, description: str, total: int | None) -> tuple[Progress, int]:
    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console)
    return progress, progress.add_task(description, total=total)
