"""The exchange sharded by tensor over several appliers (exchange.shards)."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcdl.jobfile import load_job
from hpcdl.exchange import Channel
from hpcdl.exchange.shards import Partition, PartitionMismatch, Piece
from hpcdl.exchange.group import ExchangeSync
from hpcdl.rundir.run_exchange import record_partition
from hpcdl.rundir.runs import create_run
from hpcdl.fs.files import read_jsonl
from tests.conftest import HPCDL, REPO, set_args, tiny_overrides, wait_for

F4 = "<f4"


def shapes(**named):
    return {n: (s, F4) for n, s in named.items()}


# -- the partition -------------------------------------------------------------------------------
def test_one_shard_holds_every_tensor_whole():
    p = Partition.balanced(shapes(a=(3, 4), b=(5,)), 1)
    assert p.shards == ((Piece("a"), Piece("b")),)


def test_shards_are_balanced_by_bytes_and_a_big_tensor_is_split_by_rows():
    # 4 KB + 400 B + 40 KB: an even share is ~14.8 KB, so only the big tensor is cut
    p = Partition.balanced(shapes(conv=(1000,), bias=(100,), fc=(100, 100)), 3)
    sizes = p.shard_bytes()
    assert sum(sizes) == 4000 + 400 + 40000
    assert max(sizes) - min(sizes) <= 400  # within one row of the big tensor
    assert [pc for pcs in p.shards for pc in pcs if pc.tensor == "conv"] == [Piece("conv")]
    assert all(pc.stop is not None for pcs in p.shards for pc in pcs if pc.tensor == "fc")


def test_a_kernels_rows_are_its_leading_axes_so_shards_balance_within_a_row():
    # a 3x3x64x16 kernel: the first axis would cut in thirds; its 576 rows of 16 values do not
    kernel = np.arange(3 * 3 * 64 * 16, dtype=np.float32).reshape(3, 3, 64, 16)
    tensors = {"w": kernel, "b": np.ones(16, np.float32)}
    for count in (2, 4, 5, 8):
        p = Partition.balanced(tensors, count)
        sizes = p.shard_bytes()
        assert max(sizes) - min(sizes) <= 2 * 16 * 4 + 64, (count, sizes)  # within ~a row of the share
        parts = p.split(tensors)
        assert all(np.shares_memory(v, kernel) for part in parts for k, v in part.items() if k.startswith("w@"))
        np.testing.assert_array_equal(p.join(parts)["w"], kernel)


def test_a_run_keeps_the_first_axis_layout_it_recorded_in_format_1(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "exchange.shards=2"])
    with create_run(job, "local") as (_, run):
        pass
    kernel = np.arange(4 * 3 * 2 * 2, dtype=np.float32).reshape(4, 3, 2, 2)
    old = {"format": 1, "tensors": {"w": {"shape": [4, 3, 2, 2], "dtype": F4}},
           "shards": [[["w", 0, 2]], [["w", 2, 4]]]}
    run.partition_file(job).parent.mkdir(parents=True, exist_ok=True)
    run.partition_file(job).write_text(json.dumps(old))
    kept = record_partition(run, job, Partition.balanced({"w": kernel}, 2))
    assert kept.format == 1 and kept.shards == ((Piece("w", 0, 2),), (Piece("w", 2, 4),))
    parts = kept.split({"w": kernel})
    assert [part["w@0:2"].shape for part in parts[:1]] == [(2, 3, 2, 2)]
    np.testing.assert_array_equal(kept.join(parts)["w"], kernel)
    assert json.loads(run.partition_file(job).read_text()) == old  # the record is left as it was
    # a valid layout of the same tensors that neither format cuts: refused, not followed
    run.partition_file(job).write_text(json.dumps({**old, "shards": [[["w", 0, 1]], [["w", 1, 4]]]}))
    with pytest.raises(PartitionMismatch, match="another layout"):
        record_partition(run, job, Partition.balanced({"w": kernel}, 2))


def test_a_cut_near_a_tensor_edge_keeps_the_tensor_whole():
    # two tensors of 1000 and 1040 bytes over 2 shards: the share (1020) falls 2 % inside the second
    p = Partition.balanced(shapes(a=(250,), b=(260,)), 2)
    assert p.shards == ((Piece("a"),), (Piece("b"),))


def test_split_and_join_are_inverse_and_split_makes_views():
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((7, 3, 2)).astype(np.float32),
               "b": rng.standard_normal(5).astype(np.float32),
               "s": np.float32(2.5) * np.ones((), np.float32)}
    for count in (1, 2, 3, 4):
        p = Partition.balanced(tensors, count)
        parts = p.split(tensors)
        assert len(parts) == count and all(parts)
        joined = p.join(parts)
        assert set(joined) == set(tensors)
        for name in tensors:
            np.testing.assert_array_equal(joined[name], tensors[name])
        for pieces, part in zip(p.shards, parts):
            for piece in pieces:
                if piece.tensor != "s":  # a numpy scalar (TensorFlow's for a scalar variable) is a value
                    assert np.shares_memory(part[piece.key], tensors[piece.tensor])


def test_more_shards_than_the_model_has_rows_is_refused():
    with pytest.raises(ValueError, match="cannot give every shard"):
        Partition.balanced(shapes(a=(2,), b=()), 4)


def test_a_recorded_partition_round_trips_and_a_tampered_one_is_refused():
    p = Partition.balanced(shapes(w=(10, 4), b=(4,)), 2)
    assert Partition.from_json(p.to_json()) == p
    doc = json.loads(p.to_json())
    doc["shards"][0][0][2] -= 1  # a row of w in no shard
    with pytest.raises(ValueError, match="covered exactly once"):
        Partition.from_json(json.dumps(doc).encode())
    for bad in (b"", b"\x80\x04pickle", b"[]", b'{"format": 2}', b'{"format": 3, "tensors": {}, "shards": []}',
                b'{"format": true, "tensors": {"w": {"shape": [2], "dtype": "<f4"}}, "shards": [[["w", 0, null]]]}'):
        with pytest.raises(ValueError, match="not an hpcdl partition"):
            Partition.from_json(bad)


def test_the_run_keeps_its_partition_and_refuses_another(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "exchange.shards=2"])
    with create_run(job, "local") as (_, run):
        pass
    two = Partition.balanced(shapes(w=(10, 4), b=(4,)), 2)
    record_partition(run, job, two)
    record_partition(run, job, two)  # the same one again: fine (every group root records it)
    with pytest.raises(PartitionMismatch, match="partitioned over 2 shard"):
        record_partition(run, job, Partition.balanced(shapes(w=(10, 4), b=(4,)), 3))
    with pytest.raises(PartitionMismatch, match="partitioned over 2 shard"):
        record_partition(run, job, Partition.balanced(shapes(w=(12, 4), b=(4,)), 2))


# -- a group root against two shards --------------------------------------------------------------
def test_a_group_root_publishes_each_shard_its_part_and_adopts_each_shards_newest(tmp_path):
    channels = [Channel(tmp_path / f"shard-{k}", "run") for k in range(2)]
    sync = ExchangeSync(channels, group=3, every=1, initial_wait_s=0.1)
    mine = {"w": np.zeros((4, 2), np.float32), "b": np.zeros(4, np.float32)}
    sync.initial_weights(mine)
    split = sync.partition.split(mine)
    assert [set(p) for p in split] == [{"w@0:3"}, {"w@3:4", "b"}]  # 32 B + 16 B, cut inside w
    channels[0].publish_weights(7, {"w@0:3": np.ones((3, 2), np.float32)})

    grads = {"w": np.full((4, 2), 2.0, np.float32), "b": np.full(4, 3.0, np.float32)}
    adopted = sync.after_step(1, lambda: grads, lambda: mine)
    # shard 0's part is the master's; shard 1 has no version yet, so that part stays ours
    np.testing.assert_array_equal(adopted["w"][:3], 1.0)
    np.testing.assert_array_equal(adopted["w"][3:], 0.0)
    assert sync.versions == [7, -1] and sync.version == -1

    for k, ch in enumerate(channels):
        (ref,) = ch.pending_updates()
        update = ch.read_update(ref)
        assert (update.group, update.seq) == (3, 0)
        assert update.base_version == -1  # the update was computed before the adoption
        assert set(update.tensors) == set(split[k])
    channels[1].publish_weights(2, {"w@3:4": np.full((1, 2), 5.0, np.float32), "b": np.full(4, 6.0, np.float32)})
    adopted = sync.after_step(2, lambda: grads, lambda: mine)
    np.testing.assert_array_equal(adopted["w"], [[1, 1]] * 3 + [[5, 5]])
    np.testing.assert_array_equal(adopted["b"], 6.0)
    assert sync.versions == [7, 2] and sync.stats()["exchange_shard_versions"] == [7, 2]
    assert [ch.read_update(ch.pending_updates()[-1]).base_version for ch in channels] == [7, -1]


# -- a run with two shards on the local backend ---------------------------------------------------
def applied_exactly_once(shard: Path) -> dict:
    events = [e for e in read_jsonl(shard / "applier/events.jsonl") if e["event"] in ("applied", "dropped")]
    pairs = [(e["group"], e["seq"]) for e in events]
    assert len(pairs) == len(set(pairs)), f"{shard.name}: an update was applied twice"
    status = json.loads((shard / "applier/status.json").read_text())
    for group, last in status["last_seq"].items():
        assert {s for g, s in pairs if g == int(group)} == set(range(last + 1)), f"{shard.name}: group {group} lost updates"
    assert status["backlog"] == 0
    return status


def local_view(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "scheduler/local.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def group_step(run_dir: Path, group: int) -> int:
    try:
        return json.loads((run_dir / f"groups/{group}/state.json").read_text()).get("step", 0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_two_shards_train_through_a_kill_9_of_one_and_evaluate_the_joined_master(hep_files, tmp_path):
    runs = tmp_path / "runs"
    overrides = tiny_overrides(hep_files, runs, steps=120) + [
        "exchange.shards=2", "exchange.max_pending_per_group=1000", "exchange.max_staleness=1000"]
    proc = subprocess.Popen([HPCDL, "submit", "hep", "--nodes", "2", "--group-size", "1", "--json",
                             *set_args(overrides)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: next((p for p in runs.glob("hep-*")), None) if runs.exists() else None,
                           60, "the run directory")
        wait_for(lambda: group_step(run_dir, 0) >= 30, 300, "step 30")
        shard1 = local_view(run_dir)["applier"]["shards"][1]["pid"]
        os.kill(shard1, signal.SIGKILL)
        at_kill = [group_step(run_dir, g) for g in (0, 1)]
        wait_for(lambda: local_view(run_dir)["applier"]["shards"][1]["restarts"] >= 1, 60, "shard 1 restarted")
        wait_for(lambda: all(group_step(run_dir, g) > s for g, s in enumerate(at_kill)), 120, "both groups going on")
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    exchange = run_dir / "exchange"
    recorded = Partition.from_json((exchange / "partition.json").read_bytes())
    assert recorded.count == 2 and all(recorded.shards)
    statuses = [applied_exactly_once(exchange / f"shard-{k}") for k in range(2)]
    for status in statuses:
        assert set(status["last_seq"]) == {"0", "1"} and status["counts"]["applied"] > 0
    assert local_view(run_dir)["applier"]["shards"][0]["restarts"] == 0

    shown = json.loads(subprocess.run([HPCDL, "status", str(run_dir), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert [s["shard"] for s in shown["applier"]["shards"]] == [0, 1]
    assert [s["applied"] for s in shown["applier"]["shards"]] == [s["counts"]["applied"] for s in statuses]
    text = subprocess.run([HPCDL, "status", str(run_dir)], capture_output=True, text=True, check=True).stdout
    assert "shard 1" in text

    result = json.loads(subprocess.run([HPCDL, "evaluate", str(run_dir), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    versions = [s["master_version"] for s in statuses]
    assert result["model"].startswith(f"master weights v{min(versions)}")
    assert result["auc_weighted"] > 0.9

    resumed = subprocess.run([HPCDL, "resume", str(run_dir), "--set", "exchange.shards=3",
                              "--set", "train.steps=200"], capture_output=True, text=True)
    assert resumed.returncode != 0
    assert "Error: resume cannot change exchange.shards" in resumed.stderr.strip().splitlines()[-1]


# -- submit ---------------------------------------------------------------------------------------
def test_submit_resolves_auto_and_the_local_dry_run_lists_one_applier_per_shard(tmp_path):
    from hpcdl.commands.submit import prepare

    base = [f'run.runs_dir="{tmp_path}"', "run.backend=local", "run.check_data=false"]
    notes = []
    auto = prepare("hep", base + ["run.nodes=4", "run.group_size=1", 'exchange.shards="auto"'],
                   cluster={"cores": 64}, on_note=notes.append)
    assert isinstance(auto.job.exchange.shards, int) and auto.job.exchange.shards >= 1
    assert any(n.startswith(f"exchange.shards: {auto.job.exchange.shards} (") for n in notes)
    three = prepare("hep", base + ["run.nodes=2", "run.group_size=1", "exchange.shards=3"], cluster={"cores": 64})
    appliers = [c for c in three.dryrun.commands if "--applier" in c]
    assert [c[c.index("--shard") + 1] if "--shard" in c else "0" for c in appliers] == ["0", "1", "2"]


def test_auto_sizes_the_appliers_by_the_jobs_own_network(hep_files, tmp_path):
    """The planner's bytes and FLOPs are the job's network at its data's size (climate too); where
    the data cannot be read at submit, at its workload's default input shape, said, or, with none
    (climate's shape is its data's), one applier and why."""
    from hpcdl.commands.submit import prepare
    from hpcdl.workloads import get_workload
    from hpcdl.workloads.climate.generate import generate

    base = [f'run.runs_dir="{tmp_path}"', "run.backend=local", "run.nodes=4", "run.group_size=1",
            'exchange.shards="auto"']
    climate = generate(tmp_path / "climate", 20, height=32, width=48, labelled_fraction=0.5, seed=1)
    cases = {"hep": [f'data.train="{hep_files["train"]}"', f'data.test="{hep_files["test"]}"',
                     f'data.val="{hep_files["test"]}"', "model.filters=8", "model.conv_layers=2"],
             "climate": [f'data.train="{climate["train"]}"', f'data.val="{climate["val"]}"',
                         f'data.test="{climate["test"]}"', "model.filters=[8, 16]", "model.grid_convs=1"]}
    for workload, data in cases.items():
        notes = []
        prepared = prepare(workload, base + data, cluster={"cores": 64}, on_note=notes.append)
        _, params = get_workload(workload).network_cost(prepared.job)
        assert any(f"the {workload} network at " in n and f", {params:,} parameters" in n for n in notes), notes
        (note,) = [n for n in notes if n.startswith("exchange.shards:")]
        busy = int(re.search(r"each applier (\d+)% busy", note).group(1))
        assert ("above the 50% bound" in note) == (busy > 50), note  # tiny nets: steps too short to shard
    unreadable = ["run.check_data=false", 'data.train="/nonexistent/train.h5"']
    notes = []
    prepare("hep", base + unreadable, cluster={"cores": 64}, on_note=notes.append)
    (note,) = [n for n in notes if n.startswith("exchange.shards:")]
    assert "the hep network at 224x224x3" in note and "data.train is not readable here" in note, note
    notes = []
    prepared = prepare("climate", base + unreadable, cluster={"cores": 64}, on_note=notes.append)
    (note,) = [n for n in notes if n.startswith("exchange.shards:")]
    assert prepared.job.exchange.shards == 1, note
    assert note.startswith("exchange.shards: 1 (the climate network's input shape comes from its data, not readable"), note
    assert "give exchange.shards a number" in note, note


def test_auto_shards_at_submit_does_not_load_tensorflow(tmp_path):
    from hpcdl.workloads.climate.generate import generate

    climate = generate(tmp_path / "climate", 12, height=32, width=48, labelled_fraction=0.5, seed=1)
    code = (
        "import sys\n"
        "from hpcdl.commands.submit import prepare\n"
        f"job = prepare('climate', ['run.runs_dir=\"{tmp_path}\"', 'run.backend=local', 'run.nodes=4',"
        f" 'run.group_size=1', 'exchange.shards=\"auto\"', 'data.train=\"{climate['train']}\"',"
        f" 'data.val=\"{climate['val']}\"'], "
        "cluster={'cores': 64}).job\n"
        "assert isinstance(job.exchange.shards, int), job.exchange.shards\n"
        "assert 'tensorflow' not in sys.modules, 'submit imported TensorFlow'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("value", ["0", "-1", "257", "1.5", "true", '"many"'])
def test_a_bad_shard_count_is_one_line(tmp_path, value):
    done = subprocess.run([HPCDL, "submit", "hep", "--dry-run", "--set", f"exchange.shards={value}",
                           "--set", f'run.runs_dir="{tmp_path}"'], capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("Error: exchange.shards must be")
    assert not any(tmp_path.iterdir())
