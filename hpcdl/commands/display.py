"""Terminal rendering with rich: the status screen, training progress, metric tables."""

from __future__ import annotations

import json
from typing import Any, Mapping

from rich import box
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


def validation_text(v: Mapping[str, Any] | None) -> str:
    """The newest validation's figure of merit, e.g. "AUC 0.912 @400"."""
    if not v:
        return "-"
    for key, label in (("auc", "AUC"), ("map50", "mAP"), ("accuracy", "acc."), ("r2", "R²"), ("loss", "loss")):
        if v.get(key) is not None:
            return f"{label} {v[key]:.3f} @{v.get('step', '?')}"
    return "-"


def status_view(status: Mapping[str, Any]):
    """`hpcdl status`: storage warnings, the groups' table and what did not fit its cells, the
    appliers, the totals."""
    below: list[str] = []  # what does not fit a cell: long reasons would squeeze every column to "…"
    parts = [_groups_table(status, below), *below, *_group_notes(status)]
    warnings = storage_warnings(status.get("storage") or [])
    if warnings is not None:
        parts.insert(0, warnings)
    if status.get("applier") is not None:
        parts += _applier_parts(status["applier"])
    t = status["totals"]
    per_node = (t["sustained_flops_per_s"] / t["nodes"]) if t.get("sustained_flops_per_s") else None
    parts.append(
        f"total: {_num(t['images_per_s'], '{:.1f}')} images/s · sustained {si(t['sustained_flops_per_s'], 'FLOP/s')}"
        f" ({si(per_node, 'FLOP/s')} per node) · peak {si(t['peak_flops_per_s'], 'FLOP/s')}"
    )
    return Group(*parts)


def _status_title(status: Mapping[str, Any]) -> str:
    title = (f"[bold]{status['run_id']}[/] · {status['workload']} · {status['backend']} · "
             f"[bold]{status['state']}[/]" + (f" · {status['note']}" if status.get("note") else ""))
    x = status.get("exchange")
    if x:
        title += f" · exchange {x['kind']} every {x['every']} ({x['optimizer']})"
    e = status.get("emulated")
    if e:
        title += (f"\n[bold yellow]EMULATED stragglers (not real figures): step {e['step_seconds']:g} s, "
                  f"σ {e['sigma']:g}, stall {e['stall_probability']:g}×{e['stall_factor']:g}"
                  + (f", shard {e['slow_shard']} {e['slow_factor']:g}× slow" if e["slow_shard"] >= 0 else "")
                  + (f", shard {e['kill_shard']} killed at {e['kill_after_s']:g} s" if e["kill_shard"] >= 0 else "")
                  + "[/]")
    return title


def _groups_table(status: Mapping[str, Any], below: list[str]) -> Table:
    groups = Table(title=_status_title(status), title_justify="left", expand=False)
    for column in ("grp", "state", "step", "loss", "val", "img/s", "FLOP/s", "sustained",
                   "xchg age", "stale", "restarts", "requeues"):
        groups.add_column(column, justify="left" if column == "state" else "right", no_wrap=True)
    for g in status["groups"]:
        stale = "-"
        if g.get("staleness_mean") is not None:
            stale = f"{g['staleness_mean']:.1f}/{g.get('staleness_max', 0)}"
        groups.add_row(str(g["group"]), escape(_state_cell(g, below)), f"{g['step']}/{g['steps']}",
                       _num(g["loss"]), validation_text(g.get("validation")), _num(g["images_per_s"], "{:.1f}"),
                       si(g["flops_per_s"]), si(g["sustained_flops_per_s"]), _age(g.get("exchange_age_s")),
                       stale, str(g.get("crash_restarts", 0)), str(g.get("planned_requeues", 0)))
    return groups


def _group_notes(status: Mapping[str, Any]) -> list[str]:
    """Each failed group's last error and logs; why each other unfinished group ended."""
    notes = []
    for g in status["groups"]:
        if "logs" in g:
            reason = escape(g["last_error"]) if g.get("last_error") else "no error line in its logs"
            if g.get("reason") and g["reason"] not in (g.get("last_error") or ""):
                reason += f"\n  {escape(g['reason'])}"  # hpcdl's word on its restarts
            where = ", ".join(escape(p) for p in g["logs"]) or "no log files"
            notes.append(f"[red]group {g['group']} {g['state']}[/]: {reason}\n  logs: {where} "
                         f"(hpcdl logs {escape(status['run_dir'])} --group {g['group']})")
        elif g.get("why"):
            notes.append(f"[yellow]group {g['group']} {g['state']}[/]: {escape(g['why'])}")
    return notes


def _applier_parts(applier: Mapping[str, Any]) -> list:
    """The appliers' table (a row per shard) and each one's failure or recovery."""
    shards = applier.get("shards") or []
    table = Table(title="applier (master weights)" + (f", {len(shards)} shards" if shards else ""),
                  title_justify="left")
    columns = ["state", "version", "applied", "dropped", "rejected", "backlog", "stale mean/max", "CPU/update"]
    for column in (["shard"] if shards else []) + columns:
        table.add_column(column, justify="right", no_wrap=True)
    for row in shards or [applier]:
        backend = row.get("backend") or {}
        running = backend.get("state") or ("running" if backend.get("running") else
                                           "failed" if row.get("phase") == "failed" else "stopped")
        where = backend.get("nodes") or backend.get("reason") or row.get("host")  # its node, or why it waits
        running += f" ({where})" if where else ""
        cells = [running, _num(row.get("version"), "{}"), _num(row.get("applied"), "{}"),
                 _num(row.get("dropped"), "{}"), _num(row.get("rejected"), "{}"),
                 _num(row.get("backlog"), "{}"),
                 f"{_num(row.get('staleness_mean'), '{:.2f}')}/{_num(row.get('staleness_max'), '{}')}",
                 _num(row.get("cpu_per_update_s") and row["cpu_per_update_s"] * 1e3, "{:.1f} ms")]
        table.add_row(*([f"shard {row['shard']}"] if shards else []), *cells)
    parts: list = [table]
    for row in shards or [applier]:
        which = f"applier shard {row['shard']}" if shards else "applier"
        if row.get("error"):
            parts.append(f"[red]{which} failed[/]: {escape(row['error'])}")
        elif row.get("recovered"):
            parts.append(f"[yellow]{which} recovered[/]: {escape(row['recovered'])}")
    return parts


WHERE_IN_CELL = 24  # longer (a list of unavailable nodes) goes below the table


def _state_cell(group: Mapping[str, Any], below: list[str]) -> str:
    """hpcdl's state of a group, SLURM's beside it where it says something else, and where the
    element runs or why it waits, e.g. "cancelled (SLURM: COMPLETED)", "pending (Priority)"."""
    notes = [f"SLURM: {group['scheduler_state']}"] if group.get("scheduler_state") else []
    where = group.get("where")
    if where and len(where) <= WHERE_IN_CELL:
        notes.append(where)
    elif where:
        below.append(f"group {group['group']} {group['state']}: {escape(where)}")
    return group["state"] + (f" ({'; '.join(notes)})" if notes else "")


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


class GroupProgress:
    """A bar per group while a backend keeps the run attached (`Scheduler.schedule`'s watch):
    each group's state from the backend's view, its step, loss and rates from its root's state
    file. Shown only once the backend calls `update`."""

    def __init__(self, console, steps: int):
        self.console, self.steps = console, steps
        self.progress: Progress | None = None
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "GroupProgress":
        return self

    def __exit__(self, *_) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, run, view: dict[str, Any]) -> None:
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]group {task.fields[group]}[/]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console)
            self.progress.start()
        for g, backend in sorted((view.get("groups") or {}).items(), key=lambda item: int(item[0])):
            state = _read_state(run.group_state_file(int(g)))
            if g not in self.tasks:
                self.tasks[g] = self.progress.add_task("", total=self.steps, group=g, info="")
            info = str(backend.get("state", ""))
            if state.get("loss") is not None:
                info = (f"loss {state['loss']:.3f} · {state.get('images_per_s', 0):.0f} img/s · "
                        f"{state.get('flops_per_s_group', 0) / 1e9:.1f} GFLOP/s" +
                        (f" · restarts {backend['restarts']}" if backend.get("restarts") else ""))
            self.progress.update(self.tasks[g], completed=state.get("step", 0), info=info)


def _read_state(path) -> dict:
    """A group's state file: not written yet, torn or garbled reads as empty (the next refresh will do)."""
    from hpcdl.fs.files import read_regular

    try:
        state = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


class ScanProgress:
    """A byte-counting bar for each file the data's NaN/Inf scan reads (hpcdl.workloads.finite's
    progress factory), drawn only on a terminal: a scan is quiet in scripts and logs."""

    def __init__(self, console):
        self.console = console
        self.progress: Progress | None = None

    def __enter__(self) -> "ScanProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, description: str, total: int):
        if not self.console.is_terminal:
            return lambda n: None
        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self.progress.start()
        task = self.progress.add_task(description, total=total)
        return lambda n: self.progress.advance(task, n)


def counting_progress(console, description: str, total: int | None) -> tuple[Progress, int]:
    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console)
    return progress, progress.add_task(description, total=total)


# -- hpcdl plan ---------------------------------------------------------------------------------


def plan_value(value: Any, unit: str) -> str:
    """A planner input as printed: 1.9e12 FLOP/s -> '1.9 TFLOP/s', True -> 'yes'."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,} {unit}".strip()
    if isinstance(value, float):
        return f"{_si_small(value)}{unit}" if unit else f"{value:g}"
    return str(value)


def _si_small(x: float) -> str:
    if x == 0:
        return "0 "
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"),
                           (1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
        if abs(x) >= factor:
            return f"{x / factor:.4g} {prefix}"
    return f"{x:.3g} "


def plan_assumptions_table(plan) -> Table:
    """Every planner input: value, meaning, source."""
    table = Table(title="inputs", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for column in ("input", "value", "meaning", "source"):
        table.add_column(column, overflow="fold")
    for a in plan.inputs.assumptions():
        table.add_row(a.name, plan_value(a.value, a.unit), a.meaning, escape(a.source))
    return table


def plan_rows(plan) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(headers, rows) of the candidates: one row per group count; ★ marks the pick, an
    infeasible count says why. The compute time, the same for every count, is in the title."""
    unit, prefix = plan.flops_unit()
    headers = ("groups", "nodes/\ngroup", "step\nms", "straggler\nms", "allreduce\nms",
               "exchange\nms", f"sustained\n{prefix}FLOP/s", f"peak\n{prefix}FLOP/s",
               "updates\n/s", "applier\nutil", "exchange\nMB/s", "staleness\nmean/p95",
               "dropped", "H\nmin", "")
    rows = []
    for c in plan.candidates:
        mark = "★" if c.groups == plan.recommended else ("" if c.feasible else c.reason)
        rows.append((
            str(c.groups), str(c.nodes_per_group), f"{c.step_s * 1e3:.1f}",
            f"{c.straggler_s * 1e3:.1f}", f"{c.allreduce_s * 1e3:.2f}",
            f"{c.exchange_s * 1e3:.2f}", f"{c.sustained_flops / unit:.2f}",
            f"{c.peak_flops / unit:.2f}", f"{c.updates_per_s:.1f}",
            f"{c.applier_utilisation:.2f}", f"{c.exchange_bytes_per_s / 1e6:.0f}",
            f"{c.staleness_mean:.1f}/{c.staleness_p95:.0f}", f"{100 * c.dropped_fraction:.0f}%",
            "-" if c.groups == 1 else str(c.min_every), mark,
        ))
    return headers, rows


def plan_candidates_table(plan) -> Table:
    headers, rows = plan_rows(plan)
    x = plan.inputs
    title = (f"per group count — compute {x.compute_seconds * 1e3:.1f} ms per step; exchange "
             f"{x.exchange_kind}, H = {x.exchange_every}, K = {x.max_outstanding}; H min: the "
             f"closed form's smallest H for the H rule")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
                  pad_edge=False)
    for header in headers[:-1]:
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column(headers[-1], justify="left", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def plan_recommendation(plan) -> str:
    """The group count picked, its figures and the rule."""
    if plan.recommended is None:
        return f"no group count meets the rule ({plan.rule})"
    c = plan.candidate(plan.recommended)
    unit, prefix = plan.flops_unit()
    return (f"recommended: {c.groups} groups of {c.nodes_per_group} nodes — "
            f"{c.sustained_flops / unit:.2f} {prefix}FLOP/s sustained, mean staleness "
            f"{c.staleness_mean:.1f}, applier at {100 * c.applier_utilisation:.0f}% "
            f"(rule: {plan.rule})")


def plan_every_text(plan) -> str:
    """H (exchange.every) for the recommended group count, with the figures and the reason."""
    if plan.recommended is None:
        return "exchange.every: no group count to advise H for"
    a = plan.every_advice
    if a is None:
        return "exchange.every: one group has no exchange; H does not apply"
    again = (f" (plan again with --set exchange.every={a.every} to see every count at it)"
             if a.every != plan.inputs.exchange_every else "")
    return (f"exchange.every = {a.every} for {a.groups} groups (kind {a.kind}, "
            f"{a.update_bytes / 1e6:.2f} MB per update): applier {100 * a.applier_utilisation:.0f}% "
            f"busy at {a.updates_per_s:.1f} updates/s, exchange {100 * a.exchange_share:.1f}% of a "
            f"group's time, mean staleness {a.staleness_mean:.1f} — {a.reason}{again}")


def plan_shards_text(plan) -> str:
    """exchange.shards for the recommended group count."""
    a = plan.shard_advice
    if a.met:
        verdict = "the fewest that keep each at most {:.0%} busy".format(plan.max_utilisation)
    elif a.applier_utilisation > plan.max_utilisation:
        verdict = "and still above the bound: the per-file costs dominate; raise exchange.every"
    else:
        verdict = "but the exchange files take too much of each step; raise exchange.every"
    return (f"exchange.shards = {a.shards} for {a.groups} groups at exchange.every = {a.every}: "
            f"{a.shard_bytes / 1e6:.2f} MB per update per shard, each applier "
            f"{100 * a.applier_utilisation:.0f}% busy (one applier: "
            f"{100 * a.one_applier_utilisation:.0f}%), exchange {100 * a.exchange_share:.1f}% of a "
            f"group's step — {verdict}")


def plan_alternative_text(plan) -> str | None:
    """A group count that would do better at its own H, or None."""
    a = plan.alternative
    if a is None:
        return None
    unit, prefix = plan.flops_unit()
    return (f"at its own H: {a.groups} groups of {a.nodes_per_group} nodes with exchange.every = "
            f"{a.every} would sustain {a.sustained_flops / unit:.2f} {prefix}FLOP/s (mean "
            f"staleness {a.staleness_mean:.1f}, applier {100 * a.applier_utilisation:.0f}% busy, "
            f"exchange {100 * a.exchange_share:.1f}% of the time); plan again with "
            f"--set exchange.every={a.every} to compare every group count at that H")


def plan_view(plan):
    """`hpcdl plan`'s screen: the inputs, the candidates, the recommendations."""
    head = (f"Scale plan for {plan.nodes} nodes — inputs: {escape(plan.inputs.label)} "
            f"(seed {plan.seed})")
    parts = [head, plan_assumptions_table(plan), plan_candidates_table(plan),
             plan_recommendation(plan), plan_every_text(plan)]
    if plan.shard_advice is not None:
        parts.append(plan_shards_text(plan))
    alternative = plan_alternative_text(plan)
    if alternative:
        parts.append(alternative)
    return Group(*parts)



def accuracy_view(plan):
    """`hpcdl plan --target`'s screen: time to target per group count, the recommendation and
    what it rests on (plan: a hpcdl.perf.race_worker.AccuracyPlan)."""
    table = Table("groups", "nodes/group", "rate (sweep)", "time to target: median", "range over seeds",
                  "reached", title=f"Time to {escape(str(plan.target))} at {plan.nodes} nodes (emulated race)",
                  box=box.SIMPLE_HEAD)
    for o in plan.outcomes:
        sweep = "" if o.sweep == "interior" else f", at the grid's {o.sweep}"
        lo_hi = f"{o.interval[0]:.3g}–{o.interval[1]:.3g} s" if o.interval else "—"
        table.add_row(str(o.groups), str(plan.nodes // o.groups), f"{o.rate:.3g}{sweep}",
                      f"{o.median:.3g} s" if o.median is not None else "not on every seed", lo_hi,
                      f"{sum(t is not None for t in o.times)}/{len(o.times)}")
    best = plan.recommended
    if best is None:
        verdict = (f"No group count reached {escape(str(plan.target))} on every seed within "
                   f"{plan.horizon_s:.3g} s: race longer (--race-steps) or aim lower.")
    elif best.groups == 1:
        verdict = f"Recommended: one synchronous group (G = 1) at train.learning_rate = {best.rate:.3g}."
    else:
        verdict = (f"Recommended: G = {best.groups} groups of {plan.nodes // best.groups} nodes "
                   f"(run.group_size = {plan.nodes // best.groups}), exchange.learning_rate = {best.rate:.3g}.")
    rests = "\n".join(f"  - {escape(line)}" for line in plan.basis)
    return Group(table, verdict, "It rests on:\n" + rests)


def paper_check_text(result: Mapping[str, Any]) -> str:
    """One paragraph from hpcdl.perf.recommend.paper_check's result."""
    c = result["candidate"]
    return (
        f"Paper check (Kurth et al. SC17, HEP, {result['nodes']} nodes in {result['groups']} "
        f"groups): predicted {result['predicted_sustained_flops'] / 1e15:.2f} PFLOP/s sustained "
        f"vs the paper's {result['paper_sustained_flops'] / 1e15:.2f} "
        f"({100 * (result['sustained_ratio'] - 1):+.1f} %; the test allows ±15 %), "
        f"{result['predicted_peak_flops'] / 1e15:.2f} PFLOP/s peak vs "
        f"{result['paper_peak_flops'] / 1e15:.2f} ({100 * (result['peak_ratio'] - 1):+.1f} %); "
        f"step {c['step_s'] * 1e3:.1f} ms = compute {c['compute_s'] * 1e3:.1f} + stragglers "
        f"{c['straggler_s'] * 1e3:.1f} + allreduce {c['allreduce_s'] * 1e3:.1f} + exchange "
        f"{c['exchange_s'] * 1e3:.1f}."
    )
