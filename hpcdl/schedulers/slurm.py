"""The SLURM backend: one job array element per synchronous group, plus the applier's job.

Rendering is a pure function of the request (`render_group_script`, `render_applier_script`,
`sbatch_commands`): cluster facts such as MaxArraySize and srun's MPI plugins are fetched
beforehand by `cluster_facts()` and passed in. Values that reach `#SBATCH` lines are validated against strict patterns (sbatch
parses those lines itself, so shell quoting would not protect them); values in the script body are
shell-quoted; paths travel as sbatch arguments. `schedule` is all or nothing: if any sbatch fails,
what was submitted is cancelled. Watching is one batched `squeue` and one `sacct` call for all of
a run's jobs, parsed by pure functions; without slurmdbd `sacct` fails and the status says so.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcdl.config import Job
from hpcdl.errors import JobError
from hpcdl.engine.tuning import plan_threads
from hpcdl.resources import shipped_dir
from hpcdl.rundir.runs import RunDir, RunError, State, read_json_file
from hpcdl.fs.files import atomic_write_bytes, atomic_write_json
from hpcdl.schedulers.base import (
    DryRun, Scheduler, SchedulerError, SubmitRequest, check_controller, controller_facts,
)

TEMPLATES_DIR = shipped_dir("slurm_templates")
GROUP_SCRIPT = "group.sbatch"  # template names; RunDir.script_file places the rendered ones
APPLIER_SCRIPT = "applier.sbatch"

# SLURM's many states, mapped once into the few a user needs; anything else is "unknown".
STATES = {
    "PENDING": State.PENDING, "CONFIGURING": State.PENDING, "REQUEUED": State.REQUEUED, "REQUEUE_HOLD": State.REQUEUED,
    "REQUEUE_FED": State.REQUEUED, "RESIZING": State.RUNNING, "RUNNING": State.RUNNING, "COMPLETING": State.RUNNING,
    "SIGNALING": State.RUNNING, "STAGE_OUT": State.RUNNING, "SUSPENDED": State.SUSPENDED, "STOPPED": State.SUSPENDED,
    "PREEMPTED": State.PREEMPTED, "COMPLETED": State.COMPLETED, "CANCELLED": State.CANCELLED, "FAILED": State.FAILED,
    "BOOT_FAIL": State.FAILED, "DEADLINE": State.TIMEOUT, "NODE_FAIL": State.FAILED, "OUT_OF_MEMORY": State.FAILED,
    "TIMEOUT": State.TIMEOUT, "SPECIAL_EXIT": State.FAILED, "REVOKED": State.CANCELLED,
}

_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9._:+@%/=,-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9._:+@%,&|\[\]*()-]+$")
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")
_EXTRA = re.compile(r"^--[A-Za-z][A-Za-z0-9-]*(=[^\n'\"`$\\;]*)?$")
_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")


def time_limit_seconds(text: str) -> int:
    """SLURM's --time as seconds: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (`_TIME` has checked it)."""
    days, _, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_signal_time(job: Job) -> None:
    """The warning signal must come after the start: a signal_seconds at or beyond the time limit
    would have each element checkpoint and requeue at once, in a loop."""
    s = job.slurm
    limit = time_limit_seconds(_checked("time", s.time, _TIME))
    if s.signal_seconds and s.signal_seconds >= limit:
        raise JobError(
            f"slurm.signal_seconds = {s.signal_seconds} is not less than slurm.time = {s.time!r} ({limit} s): "
            "every element would be signalled as it starts and requeue in a loop; use a smaller "
            "slurm.signal_seconds or a longer slurm.time"
        )


def map_state(raw: str) -> State:
    """`CANCELLED by 0` -> cancelled; unknown words -> unknown."""
    word = raw.split()[0].rstrip("+") if raw.strip() else ""
    return STATES.get(word, State.UNKNOWN)


def job_name(job: Job) -> str:
    return "hpcdl-" + re.sub(r"[^A-Za-z0-9._-]", "_", job.name)[:40]


def _checked(field: str, value: str, pattern: re.Pattern[str]) -> str:
    if not pattern.match(value):
        raise JobError(f"slurm.{field} {value!r} has characters SLURM directives cannot carry safely")
    return value


def sbatch_directives(job: Job, name: str, partition: str, nodes: int, tasks_per_node: int,
                      cpus_per_task: int) -> list[str]:
    """`#SBATCH` lines from the job's [slurm] section, every value validated."""
    s = job.slurm
    lines = [f"--job-name={name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if cpus_per_task:
        lines.append(f"--cpus-per-task={cpus_per_task}")
    lines.append(f"--time={_checked('time', s.time, _TIME)}")
    if partition:
        lines.append(f"--partition={_checked('partition', partition, _DIRECTIVE_VALUE)}")
    for field in ("account", "qos"):
        value = getattr(s, field)
        if value:
            lines.append(f"--{field}={_checked(field, value, _DIRECTIVE_VALUE)}")
    if s.constraint:
        lines.append(f"--constraint={_checked('constraint', s.constraint, _CONSTRAINT)}")
    for extra in s.extra_sbatch:
        lines.append(_checked("extra_sbatch", extra.strip(), _EXTRA))
    return [f"#SBATCH {line}" for line in lines]


def load_template(job: Job, name: str) -> str:
    directory = Path(job.slurm.template_dir) if job.slurm.template_dir else TEMPLATES_DIR
    path = directory / name
    try:
        return path.read_text()
    except OSError as exc:
        raise JobError(f"slurm template {path}: {exc.strerror}") from None


def fill(template: str, values: dict[str, str], source: str) -> str:
    """Replace `{{ name }}`; an unknown placeholder is an error, not a silent blank."""
    def repl(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            raise JobError(f"template {source}: unknown placeholder {{{{ {key} }}}}")
        return values[key]

    return _PLACEHOLDER.sub(repl, template)


def _setup_lines(job: Job) -> str:
    for line in job.slurm.setup:
        if "\n" in line:
            raise JobError("slurm.setup: one shell line per list item (no newlines)")
    return "\n".join(job.slurm.setup)


def check_srun_mpi(job: Job, cluster: dict[str, Any]) -> None:
    """slurm.mpi must be a plugin this cluster's srun has (`srun --mpi=list`, read beforehand when
    SLURM is reachable), and not "none", which starts the ranks as separate MPI worlds of one."""
    plugin = job.slurm.mpi
    if plugin == "none":
        raise JobError('slurm.mpi = "none" starts each rank as an MPI world of its own; run.controller = '
                       '"mpi" needs srun\'s MPI wire-up (pmix for Open MPI; srun --mpi=list)')
    plugins = cluster.get("mpi_plugins")
    if plugins and plugin not in plugins:
        raise JobError(f"slurm.mpi = {plugin!r} is not an MPI plugin of this cluster's srun "
                       f"(srun --mpi=list: {', '.join(plugins)})")


def parse_mpi_list(text: str) -> list[str]:
    """`srun --mpi=list` -> plugin names. Slurm 22.05 prints `MPI plugin types are...`, one
    name a line, then `specific pmix plugin versions available: pmix_v4`."""
    names: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        head, sep, tail = line.partition(":")
        if sep and "versions available" in head:
            names.extend(v.strip() for v in tail.split(",") if v.strip())
        elif re.fullmatch(r"[a-z][a-z0-9_]*", line):
            names.append(line)
    return list(dict.fromkeys(names))


def srun_command(job: Job, python: str, run: RunDir) -> list[str]:
    """How a group's batch step starts its ranks: one srun over the element's nodes; with
    run.controller = "mpi" srun's MPI plugin wires them up (slurm.mpi), else a Gloo rendezvous
    on the batch host does."""
    s = job.slurm
    options = ["--kill-on-bad-exit=1"]
    if job.run.mpi_launched:
        options.append(f"--mpi={s.mpi}")
    options.append(f"--ntasks-per-node={job.run.ranks_per_node}")
    if s.cpus_per_task:
        options.append(f"--cpus-per-task={s.cpus_per_task}")
    return ["srun", *options, python, "-m", "hpcdl.process.worker", str(run.root), "--slurm"]


def ranks_environment(job: Job) -> dict[str, str]:
    """What the ranks' OpenMP runtime reads at load, before any worker code runs; the worker's
    own plan (from the same rule) then sets TensorFlow's pools."""
    threads = job.slurm.cpus_per_task or 0
    if not threads:
        return {}
    env = plan_threads(job.tuning, threads, "slurm.cpus_per_task").environment()
    return {k: env[k] for k in ("OMP_NUM_THREADS", "KMP_BLOCKTIME", "KMP_AFFINITY")}


def batch_step_command(python: str, run: RunDir, role: str) -> list[str]:
    """The launch line of a batch script: hpcdl.schedulers.slurm_batch, as the job's batch step."""
    return [python, "-u", "-m", "hpcdl.schedulers.slurm_batch", role, str(run.root)]


def _render(request: SubmitRequest, template_name: str, role: str, directives: list[str]) -> str:
    job = request.job
    template = load_template(job, template_name)
    directives += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    if job.slurm.signal_seconds:
        directives.append(f"#SBATCH --signal=B:{job.slurm.signal}@{job.slurm.signal_seconds}")
    run = RunDir(request.run.root.resolve())
    text = fill(template, {
        "sbatch_directives": "\n".join(directives),
        "setup": _setup_lines(job),
        "launch": shlex.join(batch_step_command(request.python, run, role)),
        # for a site's own template: both shell-quoted
        "run_dir": shlex.quote(str(run.root)),
        "python": shlex.quote(request.python),
    }, template_name)
    if "launch" not in _PLACEHOLDER.findall(template):
        raise JobError(f"slurm template {job.slurm.template_dir}/{template_name} has no {{{{ launch }}}}: "
                       "the run's life is started there (copy the shipped template again)")
    return text


def render_group_script(request: SubmitRequest) -> str:
    job = request.job
    s = job.slurm
    return _render(request, GROUP_SCRIPT, "group", sbatch_directives(
        job, job_name(job), s.partition, job.run.nodes_per_group, job.run.ranks_per_node, s.cpus_per_task))


def render_applier_script(request: SubmitRequest) -> str:
    job = request.job
    s = job.slurm
    # one node, a core per shard's applier (each is one single-threaded numpy process)
    shards = job.exchange.shard_count
    return _render(request, APPLIER_SCRIPT, "applier", sbatch_directives(
        job, job_name(job) + "-applier", s.applier_partition or s.partition, 1, shards, 1))


def sbatch_commands(request: SubmitRequest) -> dict[str, list[str]]:
    """The exact sbatch calls; paths go as arguments, never through a shell."""
    run = RunDir(request.run.root.resolve())
    groups = request.job.run.groups
    commands = {}
    if request.job.exchange.active(groups):
        commands["applier"] = ["sbatch", "--parsable", f"--output={run.slurm_applier_output}",
                               str(run.script_file(APPLIER_SCRIPT))]
    commands["array"] = ["sbatch", "--parsable", f"--array=0-{groups - 1}",
                         f"--output={run.slurm_group_output}", str(run.script_file(GROUP_SCRIPT))]
    return commands


def parse_scontrol_config(text: str) -> dict[str, Any]:
    """Facts from `scontrol show config`: MaxArraySize and the SLURM version."""
    facts: dict[str, Any] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            continue
        if key == "MaxArraySize" and value.isdigit():
            facts["max_array_size"] = int(value)
        elif key == "SLURM_VERSION":
            facts["slurm_version"] = value
    return facts


def parse_preempt_time(text: str) -> str | None:
    """`scontrol show job -o ID` -> its PreemptTime, set once SLURM chose the job for preemption
    (it still runs for the partition's GraceTime); None before (SLURM prints "None")."""
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key == "PreemptTime":
            return None if value in ("None", "Unknown", "") else value
    return None


SQUEUE_FORMAT = "%i|%T|%N|%M|%r"


def parse_squeue(text: str) -> dict[str, dict[str, str]]:
    """`squeue -h -r -o %i|%T|%N|%M|%r` -> {"123_0": {"state", "nodes", "elapsed", "reason"}};
    the reason (SLURM's pending reason, e.g. Resources, Priority) only for a pending job."""
    jobs = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 4)
        if len(parts) not in (4, 5):
            continue
        job_id, state, nodes, elapsed = parts[:4]
        jobs[job_id] = {"state": map_state(state), "slurm_state": state, "nodes": nodes, "elapsed": elapsed}
        reason = parts[4].strip() if len(parts) == 5 else ""
        if reason and reason != "None" and map_state(state) == State.PENDING:
            jobs[job_id]["reason"] = reason
    return jobs


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """`sacct -P -o JobID,State,NodeList,Elapsed` (with header) -> as parse_squeue.

    The parsing of job ids (arrays, pending ranges such as `123_[0-3]`) is submitit's.
    """
    from submitit.slurm.slurm import SlurmInfoWatcher

    out = {}
    for job_id, row in SlurmInfoWatcher().read_info(text).items():
        out[job_id] = {"state": map_state(row.get("State", "")), "slurm_state": row.get("State", ""),
                       "nodes": row.get("NodeList", ""), "elapsed": row.get("Elapsed", "")}
    return out


def _run(cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SchedulerError(f"{cmd[0]} not found: is this a SLURM login node?") from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"{' '.join(cmd[:2])} did not answer in {timeout:.0f} s") from None


class SlurmScheduler(Scheduler):
    name = "slurm"

    def cluster_facts(self, job: Job | None = None) -> dict[str, Any]:
        """Read before rendering; an unreachable controller leaves the facts empty. For
        run.controller = "mpi" also srun's MPI plugins and whether Horovod has MPI."""
        facts = controller_facts(job)
        if job is not None and job.run.mpi_launched:
            try:
                proc = _run(["srun", "--mpi=list"], timeout=15)
                if proc.returncode == 0:
                    facts["mpi_plugins"] = parse_mpi_list(proc.stdout + proc.stderr)
            except SchedulerError:
                pass
        try:
            proc = _run(["scontrol", "show", "config"], timeout=15)
        except SchedulerError:
            return facts
        return {**facts, **parse_scontrol_config(proc.stdout)} if proc.returncode == 0 else facts

    def controller_answers(self) -> tuple[bool, str]:
        """Whether `scontrol ping` finds the controller up, and what it said otherwise."""
        try:
            proc = _run(["scontrol", "ping"], timeout=10)
        except SchedulerError as exc:
            return False, str(exc)
        said = " ".join((proc.stdout + proc.stderr).split())
        return proc.returncode == 0 and " UP" in f" {said}", said or f"exit {proc.returncode}"

    def submit_dryrun(self, request: SubmitRequest) -> DryRun:
        job = request.job
        check_signal_time(job)
        check_controller(request)
        if job.run.mpi_launched:
            check_srun_mpi(job, request.cluster)
        limit = request.cluster.get("max_array_size")
        if limit is not None and job.run.groups > limit:
            raise JobError(
                f"{job.run.groups} groups need array indices 0-{job.run.groups - 1}, but this cluster's "
                f"MaxArraySize is {limit}: use a larger run.group_size"
            )
        def rel(name: str) -> str:  # DryRun.files are relative to the run directory
            return str(request.run.script_file(name).relative_to(request.run.root))

        files = {rel(GROUP_SCRIPT): render_group_script(request)}
        if job.exchange.active(job.run.groups):
            files[rel(APPLIER_SCRIPT)] = render_applier_script(request)
        commands = sbatch_commands(request)
        return DryRun(self.name, files, list(commands.values()), request, roles=list(commands))

    def schedule(self, dryrun: DryRun, *, detach: bool = False, watch: Any = None) -> dict[str, Any]:
        """sbatch, and return: the run lives in SLURM's queue (`detach` and `watch` are moot)."""
        submitted: dict[str, str] = {}
        try:
            for role, cmd in zip(dryrun.roles, dryrun.commands):  # exactly what the dry run showed
                proc = _run(cmd)
                if proc.returncode != 0:
                    raise SchedulerError(f"sbatch for the {role} failed: {proc.stderr.strip() or proc.stdout.strip()}")
                submitted[role] = proc.stdout.strip().split(";")[0]
        except BaseException:
            if submitted:
                _run(["scancel", *submitted.values()])
            raise
        ids = {"slurm_array_job_id": submitted["array"], "slurm_applier_job_id": submitted.get("applier")}
        atomic_write_json(dryrun.request.run.slurm_jobs_file, ids)
        return ids

    def _ids(self, run: RunDir) -> dict[str, str | None]:
        path = run.slurm_jobs_file
        if not path.is_file():
            raise SchedulerError(f"{run.root} has no SLURM job ids: was it submitted?")
        ids = read_json_file(path)
        if not isinstance(ids, dict) or not isinstance(ids.get("slurm_array_job_id"), str):
            raise RunError(f"{path} is corrupt: no slurm_array_job_id")
        return ids

    def _job_ids(self, run: RunDir) -> list[str]:
        ids = self._ids(run)
        return [i for i in (ids["slurm_array_job_id"], ids.get("slurm_applier_job_id")) if i]

    def is_active(self, run: RunDir) -> bool | None:
        """Whether SLURM still holds a job of the run (the group array or the applier); None
        when it cannot tell (not submitted, controller unreachable)."""
        try:
            proc = _run(["squeue", "-h", "-r", "-j", ",".join(self._job_ids(run)), "-o", "%i"])
        except SchedulerError:
            return None
        if proc.returncode == 0:
            return bool(proc.stdout.strip())
        return False if "Invalid job id" in proc.stderr else None

    def groups_active(self, run: RunDir) -> bool | None:
        """Whether SLURM still holds an element of the run's group array (queued, running or
        requeued); None when it cannot tell (not submitted yet, controller unreachable)."""
        try:
            array = self._ids(run)["slurm_array_job_id"]
            proc = _run(["squeue", "-h", "-r", "-j", array, "-o", "%i"])
        except SchedulerError:
            return None
        if proc.returncode == 0:
            return bool(proc.stdout.strip())
        # Past MinJobAge an ended job is forgotten: squeue then calls its id invalid.
        return False if "Invalid job id" in proc.stderr else None

    def describe(self, run: RunDir) -> dict[str, Any]:
        ids = self._ids(run)
        job_ids = [i for i in (ids["slurm_array_job_id"], ids.get("slurm_applier_job_id")) if i]
        queue = _run(["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", SQUEUE_FORMAT])
        jobs = parse_squeue(queue.stdout) if queue.returncode == 0 else {}
        note = ""
        acct = _run(["sacct", "-X", "-P", "-j", ",".join(job_ids), "-o", "JobID,State,NodeList,Elapsed"])
        if acct.returncode == 0:
            for job_id, info in parse_sacct(acct.stdout).items():
                jobs.setdefault(job_id, info)  # squeue knows better while a job is queued or running
        else:
            note = f"sacct unavailable ({acct.stderr.strip() or 'no accounting'}): states of ended jobs unknown"
        array = ids["slurm_array_job_id"]
        groups_total = run.load_job(workload_code=False).run.groups
        groups = {}
        for g in range(groups_total):
            info = jobs.get(f"{array}_{g}") or jobs.get(f"{array}_[{g}]")
            groups[str(g)] = info or {"state": "unknown"}
        applier = jobs.get(ids.get("slurm_applier_job_id") or "", None)
        return {"groups": groups, "applier": applier, "note": note, "job_ids": ids}

    def cancel(self, run: RunDir) -> str:
        targets = self._job_ids(run)
        if self.is_active(run) is False:
            return f"nothing to cancel: SLURM jobs {', '.join(targets)} have ended"
        try:
            atomic_write_bytes(run.cancel_mark, b"")  # no requeue after the cancel's signal
        except OSError:
            pass  # a full disk must not stop the cancel (an element signalled by it may requeue)
        try:
            proc = _run(["scancel", *targets])
        except BaseException:
            run.cancel_mark.unlink(missing_ok=True)  # not cancelled: later requeues must go on
            raise
        if proc.returncode != 0 and "already completed" not in proc.stderr and "Invalid job id" not in proc.stderr:
            run.cancel_mark.unlink(missing_ok=True)
            raise SchedulerError(f"scancel failed: {proc.stderr.strip()}")
        return f"cancelled SLURM jobs {', '.join(targets)}"


class SlurmArrayGone:
    """True once SLURM has held no element of the run's group array at two polls in a row.

    Polled at most every `poll_s`; two sightings, so an element between its end and its requeue
    is not taken for the end of the run. An unreachable controller counts as "still there".
    """

    def __init__(self, run: RunDir, poll_s: float = 30.0, sightings: int = 2):
        self.run, self.poll_s, self.sightings = run, poll_s, sightings
        self.scheduler = SlurmScheduler()
        self.next_poll, self.seen = 0.0, 0

    def __call__(self) -> bool:
        if time.monotonic() >= self.next_poll:
            self.next_poll = time.monotonic() + self.poll_s
            self.seen = self.seen + 1 if self.scheduler.groups_active(self.run) is False else 0
            if self.seen == self.sightings:
                print("hpcdl applier: no element of the group array is queued or running any more; "
                      "stopping once the backlog is applied", file=sys.stderr, flush=True)
        return self.seen >= self.sightings
