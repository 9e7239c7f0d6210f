"""hpcdl's SLURM backend against the real local cluster (munge, slurmctld, slurmdbd, 4 slurmd)."""

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import hpcdl, set_args, tiny_overrides

pytestmark = pytest.mark.slurm

LOCAL_CLUSTER = ["run.backend=slurm", "slurm.rendezvous_host=127.0.0.1", "slurm.gloo_iface=lo",
                 "slurm.cpus_per_task=1", "slurm.time=00:10:00"]


@pytest.fixture(autouse=True)
def no_jobs_left(slurm_cluster):
    """Each test starts and ends with an empty queue, whatever the previous one left."""
    yield
    slurm("scancel", "--user", "root")
    deadline = time.monotonic() + 60
    while slurm("squeue", "-h", "-o", "%i").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)




def submit(hep_files, tmp_path, steps, *extra, nodes=4, group_size=2):
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=steps) + LOCAL_CLUSTER + list(extra)
    out = hpcdl("submit", "hep", "--nodes", str(nodes), "--group-size", str(group_size), "--json",
                *set_args(overrides), cwd=tmp_path)
    return json.loads(out.stdout)


def status(run_dir, cwd):
    return json.loads(hpcdl("status", str(run_dir), "--json", cwd=cwd).stdout)


def wait_status(run_dir, cwd, predicate, timeout=300, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = status(run_dir, cwd)
        if predicate(last):
            return last
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(last)[:2000]}")


def slurm(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60)


def queue_empty(ids):
    out = slurm("squeue", "-h", "-j", ",".join(i for i in ids if i)).stdout
    return out.strip() == ""


def test_two_array_elements_and_the_applier_train_to_the_end(slurm_cluster, hep_files, tmp_path):
    sub = submit(hep_files, tmp_path, steps=40)
    run_dir = Path(sub["run_dir"])
    assert sub["slurm_array_job_id"] and sub["slurm_applier_job_id"]
    seen_running = wait_status(run_dir, tmp_path, lambda s: any(g["step"] > 0 for g in s["groups"]), what="training")
    assert all(g["backend"].get("nodes") for g in seen_running["groups"])
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished" and all(
        g["backend"].get("state") == "completed" for g in s["groups"]), what="the end")
    assert [g["step"] for g in done["groups"]] == [40, 40]
    assert done["applier"]["applied"] > 0 and done["applier"]["backend"]["state"] in ("completed", "running")
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert result["model"].startswith("master weights") and result["auc_weighted"] > 0.9
    shown = hpcdl("status", str(run_dir), cwd=tmp_path).stdout
    assert "n[" in shown or "n1" in shown  # node lists from SLURM


def test_scancel_one_element_the_rest_goes_on(slurm_cluster, hep_files, tmp_path):
    sub = submit(hep_files, tmp_path, steps=150)
    run_dir, array = Path(sub["run_dir"]), sub["slurm_array_job_id"]
    wait_status(run_dir, tmp_path, lambda s: s["groups"][1]["step"] >= 10, what="group 1 training")
    assert slurm("scancel", f"{array}_1").returncode == 0
    cancelled_at = time.monotonic()
    done = wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["state"] == "finished"
                       and s["groups"][1]["state"] == "cancelled", what="group 0 to finish, group 1 cancelled")
    assert done["groups"][0]["step"] == 150 and done["groups"][1]["step"] < 150
    assert done["applier"]["applied"] > 0
    assert time.monotonic() - cancelled_at > 1  # group 0 trained on after the cancel
    # A cancelled group never reports "finished": the applier ends once SLURM holds no element
    # of the array (two squeue polls 30 s apart), without the user cancelling the run.
    deadline = time.monotonic() + 240
    while not queue_empty([array, sub["slurm_applier_job_id"]]) and time.monotonic() < deadline:
        time.sleep(2)
    assert queue_empty([array, sub["slurm_applier_job_id"]])
    applier_log = "\n".join(p.read_text() for p in run_dir.glob("applier-*.out"))
    assert "no element of the group array is queued or running" in applier_log
    # Cancelling a run that has ended is harmless, and says there was nothing to cancel.
    said = hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
    assert "nothing to cancel" in said and "have ended" in said
    said = hpcdl("cancel", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout
    assert "nothing to cancel" in said and run_dir.name not in said


def element_log(run_dir: Path, group: int) -> str:
    return "\n".join(p.read_text() for p in (run_dir / "groups" / str(group)).glob("slurm-*.out"))


def test_a_warning_signal_to_one_element_requeues_that_element_only(slurm_cluster, hep_files, tmp_path):
    """The array's first element and its second: requeueing `$SLURM_JOB_ID` of element 0 would
    requeue the whole array. Each element requeues exactly itself; the other trains on."""
    sub = submit(hep_files, tmp_path, 1_000_000, "exchange.enabled=off", nodes=2, group_size=1)
    run_dir, array = Path(sub["run_dir"]), sub["slurm_array_job_id"]
    for signalled, other in ((1, 0), (0, 1)):
        before = wait_status(run_dir, tmp_path, lambda s: all(g["step"] > 0 and g["state"] == "running"
                                                              for g in s["groups"]), what="both groups training")
        requeues = before["groups"][signalled]["planned_requeues"]
        assert slurm("scancel", "--batch", "--signal=USR1", f"{array}_{signalled}").returncode == 0
        again = wait_status(run_dir, tmp_path, lambda s: s["groups"][signalled]["planned_requeues"] > requeues
                            and s["groups"][signalled]["state"] == "running", timeout=300,
                            what=f"group {signalled} requeued and training again")
        assert f"checkpointed; requeueing {array}_{signalled}" in element_log(run_dir, signalled)
        # a planned requeue, not a crash restart; the other group never stopped, its steps went on
        assert again["groups"][signalled]["crash_restarts"] == 0
        assert again["groups"][other]["planned_requeues"] == before["groups"][other]["planned_requeues"]
        assert again["groups"][other]["state"] == "running"
        assert again["groups"][other]["step"] > before["groups"][other]["step"]
        if signalled == 1:  # group 0 has not been signalled yet: it never stopped or started again
            assert "requeueing" not in element_log(run_dir, other)
            metrics = [json.loads(l) for l in (run_dir / f"groups/{other}/metrics.jsonl").read_text().splitlines()]
            assert all(m.get("restart_count", 0) == 0 for m in metrics)
    hpcdl("cancel", str(run_dir), cwd=tmp_path)


def test_a_crashing_element_is_requeued_up_to_max_restarts_then_fails(slurm_cluster, hep_files, tmp_path):
    """As the local backend restarts a crashed group, SLURM runs a crashed element again while
    run.max_restarts allows; then it ends failed with the reason in status, and status counts
    SLURM's restarts. Group 1's rank kills itself a few seconds into every start (the emulator's
    planned kill, its once-per-run mark taken away); group 0 trains to the end."""
    sub = submit(hep_files, tmp_path, 300, "exchange.enabled=off", "run.max_restarts=1", "emulate.enabled=true",
                 "emulate.kill_shard=1", "emulate.kill_after_s=3", nodes=2, group_size=1)
    run_dir = Path(sub["run_dir"])
    mark = run_dir / "groups/1/emulated-kill"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        mark.unlink(missing_ok=True)  # every start of group 1 crashes
        shown = status(run_dir, tmp_path)
        if shown["groups"][1]["state"] == "failed" and shown["groups"][0]["state"] == "finished":
            break
        time.sleep(0.5)
    crashed, finished = shown["groups"][1], shown["groups"][0]
    assert crashed["state"] == "failed" and finished["state"] == "finished", shown["groups"]
    assert crashed["crash_restarts"] == 1 and finished["crash_restarts"] == 0
    assert "run.max_restarts = 1 allows no more" in crashed["reason"], crashed
    assert "restart 1 of 1" in element_log(run_dir, 1)
    assert "run.max_restarts = 1 allows no more" in hpcdl("status", str(run_dir), cwd=tmp_path).stdout


def test_requeue_resumes_from_the_checkpoint(slurm_cluster, hep_files, tmp_path):
    sub = submit(hep_files, tmp_path, steps=400)
    run_dir, array = Path(sub["run_dir"]), sub["slurm_array_job_id"]
    wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["step"] >= 30, what="group 0 past a checkpoint")
    assert slurm("scontrol", "requeue", f"{array}_0").returncode == 0
    # SLURM signals the element before it requeues it: a planned requeue, as after a preemption
    # (a crash restart, had the batch step been killed before it could record the signal)
    starts = lambda g: g["crash_restarts"] + g["planned_requeues"]  # noqa: E731
    wait_status(run_dir, tmp_path, lambda s: starts(s["groups"][0]) == 1, timeout=300, what="the restart")
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished", timeout=400, what="the end")
    assert starts(done["groups"][0]) == 1 and starts(done["groups"][1]) == 0
    steps = [json.loads(l) for l in (run_dir / "groups/0/metrics.jsonl").read_text().splitlines()]
    restarted = [m for m in steps if m.get("restart_count") == 1]
    assert restarted and restarted[0]["step"] > 10  # resumed from a checkpoint, not from step 0


def test_time_limit_signal_checkpoints_and_requeues(slurm_cluster, hep_files, tmp_path):
    # A 1-minute limit with USR1 58 s before it: the signal comes soon after the start (SLURM
    # checks limits about every 30 s); the group checkpoints, leaves a requeue mark and requeues itself.
    # Steps enough that no machine finishes before the signal (400 tiny steps take ~4 s on a fast
    # core); the test cancels the run.
    sub = submit(hep_files, tmp_path, 1_000_000, "slurm.time=1", "slurm.signal_seconds=58", "exchange.enabled=off",
                 nodes=2, group_size=2)
    run_dir = Path(sub["run_dir"])
    done = wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["planned_requeues"] >= 1 and s["groups"][0]["step"] > 0,
                       timeout=300, what="a requeue after the signal")
    log = "\n".join(p.read_text() for p in (run_dir / "groups/0").glob("slurm-*.out"))
    assert "checkpointed; requeueing" in log
    hpcdl("cancel", str(run_dir), cwd=tmp_path)
    assert done["groups"][0]["planned_requeues"] >= 1 and done["groups"][0]["crash_restarts"] == 0


def test_failed_sbatch_leaves_nothing_submitted(slurm_cluster, hep_files, tmp_path):
    before = set(slurm("squeue", "-h", "-o", "%i").stdout.split())
    # The applier's partition exists, the groups' does not: the first sbatch succeeds, the
    # second fails, and the first must be cancelled.
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=5) + LOCAL_CLUSTER + [
        "slurm.partition=nosuch", "slurm.applier_partition=debug"]
    proc = hpcdl("submit", "hep", "--nodes", "4", "--group-size", "2", *set_args(overrides), cwd=tmp_path,
                 check=False)
    assert proc.returncode == 1
    assert "sbatch for the array failed" in proc.stderr
    time.sleep(1)
    assert set(slurm("squeue", "-h", "-o", "%i").stdout.split()) <= before
    runs = tmp_path / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []


def test_dry_run_for_9600_nodes(slurm_cluster, hep_files, tmp_path):
    start = time.monotonic()
    out = hpcdl("submit", "hep", "--backend", "slurm", "--nodes", "9600", "--group-size", "96", "--dry-run",
                "--no-check-data", cwd=tmp_path).stdout
    assert time.monotonic() - start < 5  # well under a second of work; the rest is Python start-up
    assert "--array=0-99" in out and "#SBATCH --nodes=96" in out
    assert not (tmp_path / "runs").exists()
    proc = hpcdl("submit", "hep", "--backend", "slurm", "--nodes", "9600", "--group-size", "4", "--dry-run",
                 "--no-check-data", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "MaxArraySize is 1001" in proc.stderr


def test_missing_data_is_refused_at_submit(slurm_cluster, hep_files, tmp_path):
    before = set(slurm("squeue", "-h", "-o", "%i").stdout.split())
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=5) + LOCAL_CLUSTER + [
        f'data.train="{tmp_path}/none.h5"']
    proc = hpcdl("submit", "hep", "--nodes", "4", "--group-size", "2", *set_args(overrides), cwd=tmp_path,
                 check=False)
    assert proc.returncode == 2 and "none.h5" in proc.stderr, proc.stderr
    assert set(slurm("squeue", "-h", "-o", "%i").stdout.split()) <= before
    assert not (tmp_path / "runs").exists()


def test_a_failed_group_shows_its_log_and_the_reason(slurm_cluster, hep_files, tmp_path):
    """The data were said to exist only on the compute nodes (--no-check-data) and do not: the
    element fails; status names SLURM's output file and the rank's error line."""
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=5) + LOCAL_CLUSTER + [
        f'data.train="{tmp_path}/none.h5"', "exchange.enabled=off"]
    out = hpcdl("submit", "hep", "--nodes", "2", "--group-size", "2", "--no-check-data", "--json",
                *set_args(overrides), cwd=tmp_path)
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    done = wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["state"] == "failed", what="the failure")
    (group,) = done["groups"]
    assert any(Path(p).name.startswith("slurm-") for p in group["logs"]), group
    assert "none.h5" in group["last_error"], group["last_error"]
    assert "Traceback" not in element_log(run_dir, 0)  # one line, as at submit; and no retry
    assert group["crash_restarts"] == 0 and "no restart can mend" in group["reason"]
    assert "none.h5" in hpcdl("status", str(run_dir), cwd=tmp_path).stdout
    assert "none.h5" in hpcdl("logs", str(run_dir), "--group", "0", cwd=tmp_path).stdout


def test_the_groups_own_requeues_are_not_bounded_by_run_max_restarts(slurm_cluster, hep_files, tmp_path):
    """A 1-minute limit, the signal 58 s before it: the element checkpoints and requeues itself. A
    long run does that at every limit, so with run.max_restarts = 0 it still goes on (only
    restarts after failures count; tests/schedulers/test_slurm_batch_steps.py has those)."""
    sub = submit(hep_files, tmp_path, 1_000_000, "slurm.time=1", "slurm.signal_seconds=58", "exchange.enabled=off",
                 "run.max_restarts=0", nodes=2, group_size=2)
    run_dir = Path(sub["run_dir"])
    first = wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["step"] > 0, what="training")
    again = wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["planned_requeues"] >= 1
                        and s["groups"][0]["state"] == "running" and s["groups"][0]["step"] > first["groups"][0]["step"],
                        timeout=300, what="the group training again after its own requeue")
    assert again["groups"][0]["state"] == "running" and again["groups"][0]["crash_restarts"] == 0
    hpcdl("cancel", str(run_dir), cwd=tmp_path)


def test_signal_seconds_beyond_the_time_limit_is_refused(slurm_cluster, hep_files, tmp_path):
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=5) + LOCAL_CLUSTER + [
        "slurm.time=1", "slurm.signal_seconds=120"]
    proc = hpcdl("submit", "hep", "--nodes", "2", "--group-size", "2", *set_args(overrides), cwd=tmp_path,
                 check=False)
    assert proc.returncode == 2 and "slurm.signal_seconds = 120 is not less than slurm.time" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_slurm_signal_term_checkpoints_and_requeues(slurm_cluster, hep_files, tmp_path):
    """slurm.signal = "TERM": the site's warning is a SIGTERM; the group checkpoints and requeues
    as with USR1, and hpcdl cancel then stops it without a requeue."""
    sub = submit(hep_files, tmp_path, 1_000_000, "slurm.time=1", "slurm.signal_seconds=58", "slurm.signal=TERM",
                 "exchange.enabled=off", nodes=2, group_size=2)
    run_dir = Path(sub["run_dir"])
    assert "#SBATCH --signal=B:TERM@58" in (run_dir / "scheduler/group.sbatch").read_text()
    wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["planned_requeues"] >= 1 and s["groups"][0]["step"] > 0,
                timeout=300, what="a requeue after the TERM signal")
    assert "checkpointed; requeueing" in "\n".join(p.read_text() for p in (run_dir / "groups/0").glob("slurm-*.out"))
    said = hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
    assert "cancelled SLURM jobs" in said and (run_dir / "scheduler/cancelled").exists()
    deadline = time.monotonic() + 120
    while not queue_empty([sub["slurm_array_job_id"]]) and time.monotonic() < deadline:
        time.sleep(1)
    assert queue_empty([sub["slurm_array_job_id"]])  # not requeued by the cancel's SIGTERM


def test_bare_cancel_after_evaluating_an_older_run_stops_the_live_run(slurm_cluster, hep_files, tmp_path):
    """Evaluating the old run writes eval/ into it; a bare cancel must still pick the live run."""
    old = submit(hep_files, tmp_path, 5, "exchange.enabled=off", nodes=2, group_size=2)
    old_dir = Path(old["run_dir"])
    wait_status(old_dir, tmp_path, lambda s: s["state"] == "finished", what="the old run to finish")
    live = submit(hep_files, tmp_path, 1_000_000, "exchange.enabled=off", nodes=2, group_size=2)
    live_dir = Path(live["run_dir"])
    wait_status(live_dir, tmp_path, lambda s: s["groups"][0]["step"] > 0, what="the live run to train")
    hpcdl("evaluate", old_dir.name, "--runs-dir", str(tmp_path / "runs"), "--json", cwd=tmp_path)
    assert (old_dir / "eval" / "roc.png").is_file()
    said = hpcdl("cancel", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout
    assert live_dir.name in said and "cancelled SLURM jobs" in said and old_dir.name not in said
    deadline = time.monotonic() + 120
    while not queue_empty([live["slurm_array_job_id"]]) and time.monotonic() < deadline:
        time.sleep(1)
    assert queue_empty([live["slurm_array_job_id"]])
    assert status(old_dir, tmp_path)["state"] == "finished"
    said = hpcdl("cancel", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout
    assert "nothing to cancel" in said


def test_a_cancelled_run_resumes_on_slurm_and_finishes_with_an_exact_ledger(slurm_cluster, hep_files, tmp_path):
    """What a user reads at submit (no --json: the run and its SLURM job ids) and in status (the
    applier's node); then cancel, resume in place, finish: no update applied twice or lost."""
    from tests.test_hybrid import applied_exactly_once

    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=300) + LOCAL_CLUSTER + [
        "exchange.max_staleness=1000"]
    said = hpcdl("submit", "hep", "--nodes", "4", "--group-size", "2", *set_args(overrides), cwd=tmp_path).stdout
    run_dir = Path(said.split("run: ", 1)[1].split()[0])
    ids = json.loads((run_dir / "scheduler" / "slurm.json").read_text())
    assert f"group array {ids['slurm_array_job_id']}" in said and f"applier {ids['slurm_applier_job_id']}" in said
    seen = wait_status(run_dir, tmp_path, lambda s: min(g["step"] for g in s["groups"]) >= 20
                       and (s["applier"] or {}).get("applied"), what="training through the applier")
    node = seen["applier"]["backend"].get("nodes")
    assert node and node in hpcdl("status", str(run_dir), cwd=tmp_path).stdout

    assert "cancelled" in hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
    wait_status(run_dir, tmp_path, lambda s: s["state"] != "running", what="the cancel to take effect")
    deadline = time.monotonic() + 120
    while not queue_empty([ids["slurm_array_job_id"], ids["slurm_applier_job_id"]]) and time.monotonic() < deadline:
        time.sleep(1)
    stopped_at = [g["step"] for g in status(run_dir, tmp_path)["groups"]]
    assert min(stopped_at) < 300, stopped_at  # the cancel caught a group before the end

    resumed_at = time.time()
    resumed = json.loads(hpcdl("resume", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert resumed["run_dir"] == str(run_dir) and resumed["slurm_array_job_id"] != ids["slurm_array_job_id"]
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished", timeout=400, what="the resumed run")
    assert [g["step"] for g in done["groups"]] == [300, 300]
    first_logged = [min((m["step"] for m in _metrics(run_dir, g) if m["time"] > resumed_at), default=None)
                    for g in (0, 1)]
    # each unfinished group went on from its checkpoint, not from step 0
    assert all(first is None or first > 5 for first in first_logged), first_logged
    deadline = time.monotonic() + 120
    while not queue_empty([resumed["slurm_applier_job_id"]]) and time.monotonic() < deadline:
        time.sleep(1)
    applied_exactly_once(run_dir)


def _metrics(run_dir: Path, group: int) -> list[dict]:
    from hpcdl.fs.files import read_jsonl

    return read_jsonl(run_dir / "groups" / str(group) / "metrics.jsonl")


def _node_of(job_id: str) -> str:
    return slurm("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip()


def test_a_preempted_element_resumes_and_the_run_finishes_with_an_exact_ledger(slurm_cluster, hep_files, tmp_path):
    """cluster.sh's partition "urgent" preempts "debug" (PreemptMode=REQUEUE, GraceTime=30). A job
    there takes the node of group 1's element: SLURM signals the element's ranks (SIGTERM), which
    checkpoint; the element sees SLURM's PreemptTime and requeues itself (SLURM would not requeue a
    job that ends within GraceTime), resumes from the checkpoint and the newest master weights,
    and counts a planned requeue. Group 0 never stops; every update is applied exactly once."""
    from tests.test_hybrid import applied_exactly_once

    # --exclusive: each element and the applier on a node of its own, so that the urgent job
    # preempts group 1's element alone; the fourth node is free for its restart.
    sub = submit(hep_files, tmp_path, 300, "exchange.max_staleness=1000", 'slurm.extra_sbatch=["--exclusive"]',
                 "emulate.enabled=true", "emulate.step_seconds=0.15", nodes=2, group_size=1)
    run_dir, array = Path(sub["run_dir"]), sub["slurm_array_job_id"]
    before = wait_status(run_dir, tmp_path, lambda s: s["groups"][1]["step"] >= 25
                         and (s["applier"] or {}).get("applied"), what="group 1 past a checkpoint")
    node = _node_of(f"{array}_1")
    assert node and node not in (_node_of(f"{array}_0"), _node_of(sub["slurm_applier_job_id"]))
    urgent = slurm("sbatch", "--parsable", "-p", "urgent", "-w", node, f"--output={tmp_path}/urgent.out",
                   "--wrap", "sleep 20")
    assert urgent.returncode == 0, urgent.stderr
    again = wait_status(run_dir, tmp_path, lambda s: s["groups"][1]["planned_requeues"] == 1
                        and s["groups"][1]["state"] == "running", timeout=200, what="group 1 preempted and running again")
    assert again["groups"][1]["crash_restarts"] == 0
    assert again["groups"][0]["planned_requeues"] == again["groups"][0]["crash_restarts"] == 0
    assert "was preempted (SLURM), checkpointed; requeueing" in element_log(run_dir, 1)
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished", timeout=300, what="the end")
    assert [g["step"] for g in done["groups"]] == [300, 300]
    assert [(g["planned_requeues"], g["crash_restarts"]) for g in done["groups"]] == [(0, 0), (1, 0)]
    # group 0 never stopped; group 1 went on from its checkpoint with the master weights of then
    assert all(m.get("restart_count", 0) == 0 for m in _metrics(run_dir, 0))
    assert "requeueing" not in element_log(run_dir, 0)
    restarted = [m for m in _metrics(run_dir, 1) if m.get("restart_count") == 1]
    assert restarted and restarted[0]["step"] > 20
    assert (restarted[0].get("exchange_version") or 0) >= (before["applier"]["version"] or 0)
    deadline = time.monotonic() + 120
    while not queue_empty([array, sub["slurm_applier_job_id"]]) and time.monotonic() < deadline:
        time.sleep(1)
    assert queue_empty([array, sub["slurm_applier_job_id"]])
    applied_exactly_once(run_dir)
    assert status(run_dir, tmp_path)["state"] == "finished"


def test_scancel_signal_term_of_one_element_leaves_the_run_cancelled(slurm_cluster, hep_files, tmp_path):
    """`scancel --signal=TERM` signals the element's ranks (not its batch step), as a preemption
    does; without SLURM's PreemptTime it is a user's stop: the group checkpoints and stays
    stopped, and the run ends cancelled (not finished) with that group's reason."""
    sub = submit(hep_files, tmp_path, 200, "exchange.enabled=off", "emulate.enabled=true", "emulate.step_seconds=0.1",
                 nodes=2, group_size=1)
    run_dir, array = Path(sub["run_dir"]), sub["slurm_array_job_id"]
    wait_status(run_dir, tmp_path, lambda s: s["groups"][1]["step"] >= 10, what="group 1 training")
    assert slurm("scancel", "--signal=TERM", f"{array}_1").returncode == 0
    done = wait_status(run_dir, tmp_path, lambda s: not s["underway"], timeout=200, what="the run to end")
    assert done["state"] == "cancelled", done["state"]
    stopped = done["groups"][1]
    assert stopped["state"] == "cancelled" and stopped["step"] < 200 and stopped["planned_requeues"] == 0
    assert "signalled to stop" in stopped["reason"] and "scancel --signal=TERM" in stopped["why"], stopped
    assert done["groups"][0]["state"] == "finished"
    assert "requeueing" not in element_log(run_dir, 1)


def test_a_preempted_applier_job_is_requeued_and_the_ledger_stays_exact(slurm_cluster, hep_files, tmp_path):
    """The urgent job takes the applier's node: the appliers' job has no steps, so SLURM signals
    its batch step only at the end of GraceTime (SIGTERM); the appliers commit, SLURM kills and
    requeues the job, and they go on from their durable state. The groups never stop."""
    from tests.test_hybrid import applied_exactly_once

    sub = submit(hep_files, tmp_path, 300, "exchange.max_staleness=1000", 'slurm.extra_sbatch=["--exclusive"]',
                 "emulate.enabled=true", "emulate.step_seconds=0.15", nodes=2, group_size=1)
    run_dir, array, applier = Path(sub["run_dir"]), sub["slurm_array_job_id"], sub["slurm_applier_job_id"]
    wait_status(run_dir, tmp_path, lambda s: (s["applier"] or {}).get("applied"), what="the applier applying")
    node = _node_of(applier)
    assert node and node not in (_node_of(f"{array}_0"), _node_of(f"{array}_1"))
    urgent = slurm("sbatch", "--parsable", "-p", "urgent", "-w", node, f"--output={tmp_path}/urgent.out",
                   "--wrap", "sleep 5")
    assert urgent.returncode == 0, urgent.stderr
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished", timeout=300, what="the end")
    deadline = time.monotonic() + 120
    while not queue_empty([array, applier]) and time.monotonic() < deadline:
        time.sleep(1)
    assert queue_empty([array, applier])
    log = "\n".join(p.read_text() for p in run_dir.glob("applier-*.out"))
    assert "DUE TO PREEMPTION" in log and "SIGTERM: the appliers commit and stop" in log, log[-3000:]
    assert [(g["planned_requeues"], g["crash_restarts"]) for g in done["groups"]] == [(0, 0), (0, 0)]
    status_ = applied_exactly_once(run_dir)
    assert set(status_["last_seq"]) == {"0", "1"}
