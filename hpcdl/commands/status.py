"""A run's status, read only from files: works while the run goes on, after it ends, from any shell.

Sources: run.json and job.toml (what was asked), each group's state.json and metrics.jsonl (what
its root reports), the applier's status.json in the exchange directory, and the backend's own view
(`Scheduler.describe`: local processes, or SLURM's squeue/sacct).

Storage warnings (`storage`): the problems each group root and the applier recorded in their
storage reports (a full disk or quota made a checkpoint, metrics, state or exchange write fail;
see hpcdl.fs.storage), and the free space of the run's file systems, checked here directly -- so a
full disk shows even when nothing could be written about it.

FLOP/s as the paper reports them: *peak* is the best logged interval's rate, *sustained* the
work of the whole run divided by its wall time (data loading, checkpoints and exchange included);
the totals add the groups' rates.

A group's state is hpcdl's own word (its life's record and its root's state file); SLURM's word
is kept beside it where it says something else (``scheduler_state``, e.g. a cancelled group whose
element SLURM calls COMPLETED). The run's state comes from every group's (``run_state``), and a
group that ended without finishing says why (``why``).

Restarts are counted by kind over the run's life, every resume included (hpcdl.process.lifecycle's
RestartTally): ``crash_restarts`` (bounded by run.max_restarts) and ``planned_requeues`` (the
time limit's warning signal, a preemption).

A group's ``published`` counts its updates over the run's life, every restart and resume
included (its exchange sequence numbers run on), so it compares with the applier's counts:
published = applied + dropped + backlog, plus any the channel's backlog bound deleted.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from hpcdl.exchange.channel import applier_status_file, applier_storage_file
from hpcdl.fs.files import read_jsonl, read_regular
from hpcdl.process.lifecycle import RestartTally
from hpcdl.rundir.runs import ENDED, FAILED, RunDir, State
from hpcdl.fs.storage import low_space, read_report

# A group (or run) that is queued or training, or will be again without anyone asking.
UNDERWAY = frozenset({State.PENDING, State.RUNNING, State.REQUEUED, State.SUSPENDED, State.PREEMPTED})


def _read_json(path) -> dict[str, Any] | None:
    """A file the run's processes keep rewriting (state, the applier's status): a torn or garbled
    one reads as missing; the next version will do."""
    try:
        data = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def collect(run: RunDir, backend_view: dict[str, Any] | None = None) -> dict[str, Any]:
    info = run.info()
    job = run.load_job(workload_code=False)  # watching needs no workload's code
    if backend_view is None:
        from hpcdl.schedulers import get_scheduler

        backend_view = get_scheduler(info["backend"]).describe(run)
    now = time.time()
    groups = [_group_entry(run, job, g, backend_view.get("groups", {}).get(str(g), {}), now)
              for g in range(job.run.groups)]
    for entry in groups:
        if entry["state"] in FAILED:
            # Where to look, and the reason when the logs say it (a missing file, a crash).
            from hpcdl.commands.logs import last_error

            logs = run.group_logs(entry["group"])
            entry["logs"] = [str(p) for p in logs]
            entry["last_error"] = last_error(logs) or entry["reason"]
        entry["why"] = why_not_finished(entry)
    applier = None
    if job.exchange.active(job.run.groups):
        applier = _appliers_summary(run, job, backend_view.get("applier"))
        _add_staleness(groups, applier)
    storage = _storage_warnings(run, job, groups, applier is not None)
    totals = {
        # running groups' rates; once none runs, the rates they last reported
        "images_per_s": _sum(g["images_per_s"] for g in groups if g["state"] == State.RUNNING)
        if any(g["state"] == State.RUNNING for g in groups) else _sum(g["images_per_s"] for g in groups),
        "sustained_flops_per_s": _sum(g["sustained_flops_per_s"] for g in groups),
        "peak_flops_per_s": _sum(g["peak_flops_per_s"] for g in groups),
        "nodes": job.run.nodes,
    }
    state = run_state([g["state"] for g in groups])
    if applier is not None and state not in UNDERWAY and any(
            row.get("phase") == "failed" for row in applier.get("shards") or [applier]):
        state = State.FAILED  # the groups ended, but the master did not come through
    elif applier is not None and state not in UNDERWAY and _appliers_up(backend_view.get("applier")):
        state = State.ENDING
    return {
        "run_id": run.run_id,
        "run_dir": str(run.root),
        "workload": job.workload,
        "backend": info["backend"],
        "created": info.get("created"),
        "state": state,
        # whether a group is still queued or training: a failed run may still have groups going
        "underway": any(g["state"] in UNDERWAY for g in groups),
        "note": backend_view.get("note", ""),
        # Emulated stragglers and failures are for experiments: said on every view of the run.
        "emulated": dataclasses.asdict(job.emulate) if job.emulate.enabled else None,
        "exchange": ({"kind": job.exchange.kind, "every": job.exchange.every,
                      "optimizer": job.exchange.optimizer} if applier is not None else None),
        "groups": groups,
        "applier": applier,
        "storage": storage,
        "totals": totals,
    }


def _group_entry(run: RunDir, job, g: int, backend: dict[str, Any], now: float) -> dict[str, Any]:
    """Group g as status shows it: its root's last report, beside what the backend says."""
    metrics = read_jsonl(run.metrics_file(g))
    state = _read_json(run.group_state_file(g)) or {}
    life = _read_json(run.life_file(g)) or {}  # hpcdl.process.lifecycle's record, on either backend
    tally = RestartTally.read(run.restarts_file(g))
    last = metrics[-1] if metrics else {}
    group_state = group_state_of(state.get("state"), life.get("state"), backend.get("state"))
    slurm_word = str(backend.get("slurm_state") or "").split(" ")[0].rstrip("+") or None
    # A group that has ended exchanges nothing more: its exchange age stops at its last report.
    until = last.get("time", now) if group_state in ENDED else now
    return {
        "group": g,
        "state": group_state,
        # SLURM's word where it says something else than hpcdl's (None on the local backend)
        "scheduler_state": slurm_word if slurm_word and not _same(group_state, backend.get("state")) else None,
        # SLURM: the element's nodes, or why it waits in the queue
        "where": (backend.get("nodes") or backend.get("reason") or None) if slurm_word else None,
        # the final state is written until it holds (metrics lines may be lost to a full disk)
        "step": max(last.get("step", 0), _count(state.get("step"))),
        "steps": job.train.steps,
        "loss": last.get("loss"),
        "images_per_s": last.get("images_per_s"),
        # the newest validation (train.validate_every): {"step", "auc", "loss", ...}
        "validation": {k[4:]: v for k, v in last.items() if k.startswith("val_")} or None,
        "flops_per_s": last.get("flops_per_s_group"),
        "peak_flops_per_s": max((m.get("flops_per_s_group", 0.0) for m in metrics), default=None),
        "sustained_flops_per_s": last.get("sustained_flops_per_s_group"),
        "last_report_age_s": now - last["time"] if "time" in last else None,
        "exchange_age_s": max(0.0, until - last["exchange_last_s"]) if last.get("exchange_last_s") else None,
        "exchange_version": last.get("exchange_version"),
        # over the run's life, every restart and resume included (the group's next sequence number)
        "published": (state if _count(state.get("step")) >= _count(last.get("step")) else last).get("exchange_published"),
        "adopted": last.get("exchange_adopted"),
        "unpublished": last.get("exchange_unpublished"),
        # by kind, over the run's life; a run from before the tally has its life's count
        "crash_restarts": max(tally.crash_restarts, _count(life.get("crash_restarts")), _count(life.get("restarts"))),
        "planned_requeues": max(tally.planned_requeues, _count(life.get("planned_requeues"))),
        "reason": life.get("reason") or "",
        "backend": backend,
    }


def _storage_warnings(run: RunDir, job, groups: list[dict[str, Any]], exchange: bool) -> list[dict[str, Any]]:
    """Active storage problems (newest first), then low free space; [] when all is well."""
    now = time.time()
    sources = [(f"group {g['group']}", run.storage_file(g["group"])) for g in groups]
    sources.append(("supervisor", run.supervisor_storage_file))
    if exchange:
        shards = run.shard_dirs(job)
        for k, d in enumerate(shards):
            sources.append(("applier" if len(shards) == 1 else f"applier shard {k}", applier_storage_file(d)))
    out = []
    for where, path in sources:
        report = read_report(path)
        if report is None:
            continue
        if report.get("unreadable"):
            out.append({"where": where, "what": "storage report", "error": f"{path} is unreadable",
                        "count": None, "age_s": None, "detail": ""})
            continue
        problems = report.get("problems")
        for what, p in (problems.items() if isinstance(problems, dict) else []):
            if not isinstance(p, dict):
                continue
            last = p.get("last")
            out.append({"where": where, "what": what, "error": p.get("error", ""), "count": p.get("count"),
                        "age_s": now - last if isinstance(last, (int, float)) else None,
                        "since_s": now - p["first"] if isinstance(p.get("first"), (int, float)) else None,
                        "detail": p.get("detail", ""), "path": p.get("path", "")})
    reported = {(w["where"], w["what"]) for w in out}
    for g in groups:  # a root's metrics say updates wait in its memory, its report may not
        held = g.get("unpublished")
        if held and (f"group {g['group']}", "exchange publish") not in reported:
            out.append({"where": f"group {g['group']}", "what": "exchange publish",
                        "error": f"{held} updates not yet published (held in memory)", "count": None,
                        "age_s": g.get("last_report_age_s"), "detail": ""})
    out.sort(key=lambda w: w["age_s"] if w["age_s"] is not None else float("inf"))
    seen = set()
    for path in [run.root] + ([run.exchange_dir(job)] if exchange else []):
        try:
            dev = path.stat().st_dev
        except OSError:
            continue
        if dev in seen:
            continue
        seen.add(dev)
        warning = low_space(path)
        if warning:
            out.append({"where": "file system", "what": "free space", "error": warning, "count": None,
                        "age_s": 0.0, "detail": ""})
    return out


def _add_staleness(groups: list[dict[str, Any]], applier: dict[str, Any]) -> None:
    """Each group's staleness, measured per shard: the group's worst."""
    for entry in groups:
        per_shard = [row["groups"].get(str(entry["group"]), {}) for row in applier.get("shards") or [applier]]
        means = [p["staleness_mean"] for p in per_shard if p.get("staleness_mean") is not None]
        maxima = [p["staleness_max"] for p in per_shard if p.get("staleness_max") is not None]
        entry["staleness_mean"] = max(means) if means else None
        entry["staleness_max"] = max(maxima) if maxima else None


def _appliers_up(backend: dict[str, Any] | None) -> bool:
    """Whether the backend still runs the run's appliers: the local supervisor's record (checked
    against the system), or SLURM's state of the applier job."""
    if not backend:
        return False
    if "running" in backend:
        return bool(backend["running"])
    return _as_state(backend.get("state", "")) in UNDERWAY


def _appliers_summary(run: RunDir, job, backend: dict[str, Any] | None) -> dict[str, Any]:
    """One applier's summary; with several shards, their totals and one row per shard."""
    rows = [_applier_summary(_read_json(applier_status_file(d)) or {}) for d in run.shard_dirs(job)]
    if len(rows) == 1:
        return {**rows[0], "backend": backend}
    on_backend = (backend or {}).get("shards") or []
    for k, row in enumerate(rows):
        row["shard"] = k
        # local: each shard's process; SLURM: the one job that holds every shard
        row["backend"] = next((b for b in on_backend if b.get("shard") == k), backend)
    total = {key: _sum(r[key] for r in rows) for key in ("applied", "dropped", "downweighted", "rejected", "backlog")}
    versions = [r["version"] for r in rows if r["version"] is not None]
    maxima = [r["staleness_max"] for r in rows if r["staleness_max"] is not None]
    return {**total, "phase": rows[0]["phase"], "version": min(versions) if len(versions) == len(rows) else None,
            "staleness_mean": max((r["staleness_mean"] for r in rows if r["staleness_mean"] is not None), default=None),
            "staleness_max": max(maxima) if maxima else None, "last_apply_age_s": None, "groups": {},
            "backend": backend, "shards": rows}


def _applier_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """The applier's status.json (see hpcdl.applier), flattened for the status screen."""
    counts = raw.get("counts", {})
    staleness = raw.get("staleness", {})
    return {
        "phase": raw.get("phase"),
        "version": raw.get("master_version"),
        "applied": counts.get("applied"),
        "dropped": counts.get("dropped_stale"),
        "downweighted": counts.get("downweighted"),
        "rejected": (counts.get("rejected_corrupt", 0) + counts.get("rejected_invalid", 0)) if counts else None,
        "backlog": raw.get("backlog"),
        "staleness_mean": staleness.get("mean"),
        "staleness_max": staleness.get("max"),
        "last_apply_age_s": time.time() - raw["last_apply_time"] if raw.get("last_apply_time") else None,
        "groups": raw.get("groups", {}),
        "host": raw.get("host"),
        "cpu_per_update_s": raw.get("cpu_per_update_s"),
        "error": raw.get("error"),  # why it ended failed: no usable durable state
        "recovered": raw.get("recovered"),  # how it came back from a damaged state
    }


def group_state_of(reported: str | None, life: str | None, scheduler: str | None) -> State:
    """A group's state in hpcdl's own words: its root's state file (`reported`) says whether the
    training finished -- written only once its final checkpoint is, so it alone makes a group
    finished; its life's record says the rest (cancelled, failed, requeued, ...). A life that saw
    the ranks end well without that word ended "completed", not finished. Where the life's record
    still says pending or running but the backend saw the group end (SLURM ended the element, the
    local supervisor died), the record is stale and the backend's word stands; so it does while
    hpcdl has said nothing yet."""
    if reported == State.FINISHED:
        return State.FINISHED
    backend = _as_state(scheduler) if scheduler else None
    if not (life or reported):  # hpcdl has said nothing yet (its batch step is starting)
        return backend or State.PENDING
    own = _as_state(life or reported)
    if own == State.FINISHED:
        own = State.COMPLETED
    if own in (State.PENDING, State.RUNNING) and backend in ENDED:
        return backend
    return own


def run_state(states: list[State]) -> State:
    """The run's state from every group's, the most telling first:

    1. failed: a group failed (or was lost, or hit the time limit): the run cannot finish as
       submitted, even while other groups still train;
    2. running (pending while no group has started): a group is queued, training, or requeued;
    3. cancelled: a group was stopped at a checkpoint by a cancel, Ctrl-C or a signal;
    4. stopped: a group checkpointed on request and was not requeued;
    5. completed: a group's processes ended well without its training saying finished;
    6. unknown: neither hpcdl nor the backend can say what a group did;
    7. finished: only when every group finished, its final checkpoint written.
    """
    if not states:
        return State.UNKNOWN
    if any(s in FAILED for s in states):
        return State.FAILED
    if any(s in UNDERWAY for s in states):
        return State.PENDING if all(s == State.PENDING for s in states) else State.RUNNING
    for telling in (State.CANCELLED, State.STOPPED, State.COMPLETED):
        if telling in states:
            return telling
    return State.FINISHED if all(s == State.FINISHED for s in states) else State.UNKNOWN


def why_not_finished(group: dict[str, Any]) -> str:
    """Why a group that ended did not finish (its life's reason when it gave one); "" for a
    group that finished or is still underway."""
    state = group["state"]
    if state == State.FINISHED or state in UNDERWAY:
        return ""
    at = f"at step {group['step']} of {group['steps']}"
    if state in FAILED:
        default = {State.LOST: f"its supervisor died {at} (`hpcdl resume` goes on from its checkpoint)",
                   State.TIMEOUT: f"SLURM's time limit ended it {at}"}.get(state, f"failed {at}")
        return group.get("last_error") or group.get("reason") or default
    return group.get("reason") or {
        State.CANCELLED: f"cancelled {at} (`hpcdl cancel`, Ctrl-C or a signal), checkpointed",
        State.STOPPED: f"stopped {at} at a checkpoint, not requeued",
        State.COMPLETED: f"its processes ended {at} without the training saying finished",
    }.get(state, f"{state} {at}: neither hpcdl nor the backend says more")


def with_outcome(started: dict[str, Any]) -> dict[str, Any]:
    """A started run's result (submit's or resume's), with, if it was watched to its end ("ok" in
    it), how it ended: its state, each group that did not finish with why, and "ok" only if the
    run finished -- what a foreground `hpcdl submit` or `resume` reports and exits by."""
    if "ok" not in started:
        return started
    status = collect(RunDir(Path(started["run_dir"])))
    return {**started, "state": status["state"], "ok": started["ok"] and status["state"] == State.FINISHED,
            "not_finished": [{"group": g["group"], "state": g["state"], "why": g["why"]}
                             for g in status["groups"] if g["state"] != State.FINISHED]}


def _as_state(word: str) -> State:
    return State._value2member_map_.get(str(word).lower(), State.UNKNOWN)


def _same(state: State, scheduler: str | None) -> bool:
    """Whether the backend's word says what hpcdl's does (COMPLETED for finished)."""
    backend = _as_state(scheduler) if scheduler else None
    return backend == state or (state == State.FINISHED and backend == State.COMPLETED)


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _sum(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None
