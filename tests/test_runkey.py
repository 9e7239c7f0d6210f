"""Nobody else gets in: owner-only (or group-only) modes whatever the umask, and a per-run key
that every exchange file of a run is authenticated with."""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from hpcdl import exchange as ex
from tests.helpers import APPLIER_PROCESS, applier_for
from hpcdl.jobfile import load_job
from hpcdl.exchange import Channel, CorruptFile, Signer
from hpcdl.fs.storage import StorageReport
from hpcdl.rundir.run_exchange import adopt_master_weights, group_exchange, run_channel
from hpcdl.fs.access import Access
from hpcdl.rundir.runkey import RunKeyError, create_key, load_key, load_key_file, run_signer
from hpcdl.rundir.runs import RunError, create_run
from hpcdl.fs.files import atomic_write_json
from hpcdl.fs.files import append_jsonl
from tests.conftest import HPCDL, set_args, tiny_overrides

W = {"w": np.arange(8, dtype=np.float32), "b": np.zeros(2, np.float32)}


@pytest.fixture
def umask000():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes_under(root: Path) -> dict[str, int]:
    out = {".": mode(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = mode(p)
    return out


def job_for(tmp_path: Path, *extra: str):
    return load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"', "run.nodes=2", "run.group_size=1",
                            *extra])


# ----------------------------------------------------------------------------------------------
# modes
# ----------------------------------------------------------------------------------------------


def test_run_directory_is_owner_only_under_umask_000(tmp_path, umask000):
    job = job_for(tmp_path)
    with create_run(job, "local") as (staged, final):
        script = staged.scheduler_dir / "run.sh"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)  # as submit does for scripts
        (staged.root / "later.txt").write_text("umask 000 file")
    modes = modes_under(final.root)
    for rel, m in modes.items():
        path = final.root / rel
        if path.is_dir():
            assert m == 0o700, (rel, oct(m))
        elif rel == "run.key":
            assert m == 0o400
        elif rel == "scheduler/run.sh":
            assert m == 0o700  # the owner may still execute it
        else:
            assert m == 0o600, (rel, oct(m))
    assert {"groups/0", "groups/1", "scheduler", "run.key", "job.toml", "run.json",
            "groups/0/storage.json"} <= set(modes)
    # Written later through hpcdl.rundir.runs, still under umask 000:
    atomic_write_json(final.root / "groups/0/state.json", {"state": "running"})
    append_jsonl(final.root / "groups/0/metrics.jsonl", {"step": 1})
    atomic_write_json(final.root / "eval/new/deep.json", {})
    assert mode(final.root / "groups/0/state.json") == 0o600
    assert mode(final.root / "groups/0/metrics.jsonl") == 0o600
    assert mode(final.root / "eval") == 0o700 and mode(final.root / "eval/new") == 0o700
    # and a new runs/ directory is owner-only too
    assert mode(tmp_path / "runs") == 0o700


def test_group_only_run_under_umask_077(tmp_path):
    group = grp.getgrgid(os.getegid()).gr_name
    job = job_for(tmp_path, f'run.unix_group="{group}"')
    old = os.umask(0o077)
    try:
        with create_run(job, "local") as (staged, final):
            (staged.root / "later.txt").write_text("x")
        atomic_write_json(final.root / "groups/0/state.json", {"state": "running"})
        append_jsonl(final.root / "groups/0/metrics.jsonl", {"step": 1})
        ch = run_channel(final, job)
        ch.publish_update(0, 0, -1, W)
        from hpcdl.schedulers.local import _open_log  # the local backend's rank and applier logs

        _open_log(final.rank_log(0, 0), final.access(job)).close()
    finally:
        os.umask(old)
    gid = os.getegid()
    for rel, m in modes_under(final.root).items():
        path = final.root / rel
        assert os.lstat(path).st_gid == gid, rel
        if path.is_dir():
            assert m == 0o2770, (rel, oct(m))
        elif rel == "run.key":
            assert m == 0o440
        else:
            assert m == 0o660, (rel, oct(m))
    assert final.access(job) == Access(gid)


def test_unknown_unix_group_is_refused_cleanly(tmp_path):
    job = job_for(tmp_path, 'run.unix_group="no-such-group-hpcdl"')
    with pytest.raises(RunError, match="no unix group"):
        with create_run(job, "local"):
            pass
    assert not any(p for p in (tmp_path / "runs").iterdir()) if (tmp_path / "runs").exists() else True
    from hpcdl.errors import JobError

    with pytest.raises(JobError, match="unix group name"):
        job_for(tmp_path, 'run.unix_group="bad name; rm -rf"')


def test_exchange_directory_and_files_under_umask_000(tmp_path, umask000):
    ch = Channel(tmp_path / "lustre" / "xch", "run", signer=Signer(b"k" * 32))
    with applier_for(ch, "sgd", 1.0, initial=W) as app:
        ch.publish_update(0, 0, 0, W)
        ch.propose_initial(1, W)  # ignored (a master exists) but written
        app.step()
        app._write_status()
    for rel, m in modes_under(tmp_path / "lustre").items():
        path = tmp_path / "lustre" / rel
        if rel == ".":
            continue  # tmp_path's own child created by us: below
        if path.is_dir():
            assert m == 0o700, (rel, oct(m))
        else:
            assert m == 0o600, (rel, oct(m))
    assert {"xch/weights", "xch/applier/state.hx", "xch/applier/events.jsonl", "xch/applier/lock",
            "xch/applier/status.json", "xch/applier/storage.json"} <= set(modes_under(tmp_path / "lustre"))


def test_existing_loose_subdirectories_are_tightened_but_not_the_root(tmp_path, umask000):
    root = tmp_path / "shared"
    (root / "updates").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "updates", 0o777)
    Channel(root, "run")
    assert mode(root / "updates") == 0o700
    assert mode(root) == 0o755  # the user's own directory: warned about, not changed


# ----------------------------------------------------------------------------------------------
# the key
# ----------------------------------------------------------------------------------------------


def test_key_file_is_created_once_and_checked(tmp_path):
    path = create_key(tmp_path)
    assert mode(path) == 0o400 and len(load_key(tmp_path)) == 32
    with pytest.raises(FileExistsError):
        create_key(tmp_path)  # never replaced
    other = tmp_path / "other"
    other.mkdir()
    os.chmod(path, 0o644)
    with pytest.raises(RunKeyError, match="lets others read"):
        load_key(tmp_path)
    os.chmod(path, 0o400)
    (other / "run.key").symlink_to(path)
    with pytest.raises(RunKeyError, match="symbolic link"):
        load_key(other)
    (other / "run.key").unlink()
    with pytest.raises(RunKeyError, match="no run key"):
        load_key(other)
    short = other / "short.key"
    short.write_text("abcd\n")
    os.chmod(short, 0o600)
    with pytest.raises(RunKeyError, match="too short"):
        load_key_file(short)
    short.write_text("not hex at all\n")
    with pytest.raises(RunKeyError, match="not a hex key"):
        load_key_file(short)


def test_each_run_has_its_own_key(tmp_path):
    job = job_for(tmp_path)
    with create_run(job, "local") as (_, a):
        pass
    with create_run(job, "local") as (_, b):
        pass
    assert load_key(a.root) != load_key(b.root)
    assert a.signer().alg == "poly1305"


def test_run_channels_reject_files_written_with_another_key(tmp_path):
    job = job_for(tmp_path)
    with create_run(job, "local") as (_, run):
        pass
    ch = run_channel(run, job)
    stranger = Channel(ch.root, run.run_id, signer=Signer(os.urandom(32)))
    unkeyed = Channel(ch.root, run.run_id)  # plain SHA-256: a downgrade attempt
    with applier_for(ch, "sgd", 1.0, initial=W) as app:
        ch.publish_update(0, 0, 0, W)
        stranger.publish_update(5, 0, 0, W)
        unkeyed.publish_update(6, 0, 0, W)
        while app.step():
            pass
        assert app.counts["applied"] == 1 and app.counts["rejected_corrupt"] == 2
        assert app.ledger.pairs() == [(0, 0)]
    rejected = [json.loads(l) for l in ch.events_path.read_text().splitlines()]
    reasons = {e["file"]: e["reason"] for e in rejected if e["event"] == "rejected"}
    assert "not written with this run's key" in reasons[ex.update_name(5, 0)]
    assert "tag algorithm 'sha256'" in reasons[ex.update_name(6, 0)]
    assert len(list(ch.rejected_dir.iterdir())) == 2
    # the groups refuse forged master weights the same way
    stranger.publish_weights(99, {k: v + 1 for k, v in W.items()})
    with pytest.raises(CorruptFile, match="this run's key"):
        ch.read_latest_weights()


def test_adopt_master_weights_needs_the_run_key(tmp_path):
    job = job_for(tmp_path)
    with create_run(job, "local") as (_, run):
        pass
    ch = run_channel(run, job)
    ch.publish_weights(3, W)

    class Var:
        def __init__(self, a):
            self.shape, self.value = a.shape, None
            self.dtype = type("DType", (), {"as_numpy_dtype": a.dtype.type})  # like tf.DType

        def assign(self, v):
            self.value = v

    class Model:
        vars = {k: Var(v) for k, v in W.items()}

        def named_variables(self):
            return list(self.vars.items())

    model = Model()
    assert adopt_master_weights(run, job, model) == 3
    np.testing.assert_array_equal(model.vars["w"].value, W["w"])
    os.chmod(run.key_file, 0o600)
    run.key_file.unlink()
    with pytest.raises(RunError, match="no run key"):
        adopt_master_weights(run, job, model)
    with pytest.raises(RunError, match="no run key"):
        group_exchange(run, job, 0, StorageReport(run.storage_file(0)))


def test_applier_cli_key_file(tmp_path):
    key_dir = tmp_path / "k"
    key_dir.mkdir()
    key = create_key(key_dir)
    ch = Channel(tmp_path / "x", "r", signer=run_signer(key_dir))
    ch.publish_weights(0, W)
    ch.publish_update(0, 0, 0, W)
    Channel(ch.root, "r").publish_update(1, 0, 0, W)
    import sys

    from tests.applier.test_server import env_with_root

    out = subprocess.run([sys.executable, APPLIER_PROCESS, "--exchange", str(ch.root), "--run-id",
                          "r", "--key-file", str(key), "--optimizer", "sgd", "--idle-exit-after", "0.5",
                          "--no-fsync"], env=env_with_root(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(ch.status_path.read_text())
    assert status["counts"]["applied"] == 1 and status["counts"]["rejected_corrupt"] == 1
    os.chmod(key, 0o644)
    out = subprocess.run([sys.executable, APPLIER_PROCESS, "--exchange", str(ch.root), "--run-id",
                          "r", "--key-file", str(key)], env=env_with_root(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "lets others read" in out.stderr


# ----------------------------------------------------------------------------------------------
# a real run: two groups and the applier as processes, under umask 000
# ----------------------------------------------------------------------------------------------


def test_real_run_under_umask_000_rejects_another_key(hep_files, tmp_path, umask000):
    runs = tmp_path / "runs"
    overrides = tiny_overrides(hep_files, runs, steps=30) + [
        "exchange.max_pending_per_group=1000", "exchange.max_staleness=1000"]
    proc = subprocess.Popen([HPCDL, "submit", "hep", "--nodes", "2", "--group-size", "1", "--json",
                             *set_args(overrides)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    run_dir = None
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("*") if not p.name.startswith(".")] if runs.exists() else []
        if found and (found[0] / "exchange" / "weights").is_dir():
            run_dir = found[0]
            break
        time.sleep(0.2)
    assert run_dir is not None, "the run's exchange did not appear"
    # Someone without the run's key (another user's process, another run) feeds gradients in.
    forged = Channel(run_dir / "exchange", run_dir.name, signer=Signer(os.urandom(32)))
    forged.publish_update(50, 0, 0, {"x": np.ones(4, np.float32)})
    Channel(run_dir / "exchange", run_dir.name).publish_update(51, 0, 0, {"x": np.ones(4, np.float32)})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    status = json.loads((run_dir / "exchange/applier/status.json").read_text())
    assert status["counts"]["rejected_corrupt"] == 2
    assert set(status["last_seq"]) == {"0", "1"} and status["counts"]["applied"] >= 50
    events = [json.loads(l) for l in (run_dir / "exchange/applier/events.jsonl").read_text().splitlines()]
    assert all(e.get("group") not in (50, 51) for e in events if e["event"] == "applied")

    # Everything hpcdl and its processes made is owner-only, although the umask was 000.
    produced = modes_under(run_dir)
    loose = {}
    for rel, m in produced.items():
        path = run_dir / rel
        if path.is_symlink():
            continue
        if rel.endswith(".log"):
            continue  # opened by the local supervisor (hpcdl.schedulers.local); inside 0700 dirs
        if m & 0o077:
            loose[rel] = oct(m)
    assert not loose, loose
    assert produced["."] == 0o700
    for rel in ("exchange", "exchange/updates", "checkpoints", "checkpoints/0", "tensorboard/0"):
        assert produced[rel] == 0o700, rel
    ckpts = [r for r in produced if r.startswith("checkpoints/0/ckpt-")]
    assert ckpts and all(produced[r] == 0o600 for r in ckpts)
