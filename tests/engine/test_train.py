"""The engine with real Horovod: two ranks in one Gloo group, started the way hpcdl starts them."""

import json
import os
import subprocess
import sys

import numpy as np

from hpcdl.process.launch import local_group, start_rendezvous, worker_environ
from tests.conftest import REPO, tiny_overrides


def train_gloo_pair(out, overrides: list[str]) -> None:
    """Two ranks of tests/helpers/sync_rank.py in one Horovod Gloo group, their files in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    envs = local_group(group=0, ranks=2)
    server, port = start_rendezvous(envs)
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, str(REPO / "tests/helpers/sync_rank.py"), str(out), json.dumps(overrides)],
                env=worker_environ(os.environ, {**e.to_horovod_env("127.0.0.1", port, iface="lo"),
                                                "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
            for e in envs
        ]
        outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    finally:
        server.stop()
    assert [p.returncode for p in procs] == [0, 0], outputs


def test_two_ranks_stay_bit_identical_on_different_data(hep_files, tmp_path):
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=15)
    train_gloo_pair(tmp_path, overrides)
    r0, r1 = np.load(tmp_path / "rank0.npz"), np.load(tmp_path / "rank1.npz")
    # Different shards: the ranks saw different images ...
    assert not np.array_equal(r0["first_x"], r1["first_x"])
    finals = [k for k in r0.files if k.startswith("final/")]
    assert finals
    for key in finals:
        # ... yet after 15 allreduced steps their weights are the same to the bit,
        assert np.array_equal(r0[key], r1[key]), key
    # and they did train: the weights moved away from the (shared) initial ones.
    moved = sum(not np.allclose(r0[k], r0["initial/" + k.split("/", 1)[1]]) for k in finals)
    assert moved == len(finals)
    # rank 0 alone wrote the metrics and the checkpoint
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [5, 10, 15]
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
    assert json.loads(lines[-1])["flops_per_s_group"] > 0
    # the ranks checked it themselves at the end (one allgather of weight digests)
    assert json.loads((tmp_path / "state.json").read_text())["replicas_identical"] is True


def test_an_adoption_keeps_the_inner_optimizers_slots(hep_files, tmp_path):
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=12)
    proc = subprocess.run([sys.executable, str(REPO / "tests/helpers/adopt_rank.py"), str(tmp_path),
                           json.dumps(overrides)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["adoptions"] == 6
    finals = np.load(tmp_path / "finals.npz")
    names = [k.split("/", 1)[1] for k in finals.files if k.startswith("plain/")]
    assert names
    for name in names:
        # Adam's m and v went on across the adoptions: the same trajectory to the bit
        assert np.array_equal(finals[f"plain/{name}"], finals[f"adopting/{name}"]), name


def test_the_weights_digest_sees_a_single_bit():
    import tensorflow as tf

    from hpcdl.engine.train import weights_digest

    a = [tf.Variable(np.zeros((3, 3), np.float32)), tf.Variable(np.ones(2, np.float32))]
    b = [tf.Variable(np.zeros((3, 3), np.float32)), tf.Variable(np.ones(2, np.float32))]
    assert weights_digest(a) == weights_digest(b)
    flipped = np.ones(2, np.float32)
    flipped.view(np.uint32)[1] ^= 1  # the last bit of the mantissa
    b[1].assign(flipped)
    assert weights_digest(a) != weights_digest(b)
