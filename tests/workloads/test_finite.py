"""The NaN/Inf scan of data files: streamed, naming the first bad example, remembered when clean."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from hpcdl.commands.submit import prepare
from hpcdl.workloads import finite
from tests.conftest import HPCDL


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def write(path, x, y, **extra):
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
        for name, value in extra.items():
            f[name] = value
    return path


def test_a_nan_past_many_chunks_is_found_at_its_example(tmp_path):
    x = np.ones((5000, 4, 4), np.float32)
    x[4321, 2, 1] = np.nan
    path = write(tmp_path / "d.h5", x, np.zeros(5000, np.float32))
    chunk = 100 * 4 * 4 * 4  # a hundred examples a slice: the file is fifty slices
    assert x.nbytes > 10 * chunk
    with pytest.raises(finite.NonFiniteData) as caught:
        finite.check_file(path, ["y", "x"], chunk_bytes=chunk)
    message = str(caught.value)
    assert str(path) in message and "'x'" in message and "example 4321" in message and "nan" in message
    assert "\n" not in message


def test_an_inf_label_and_the_default_scans_every_floating_dataset(tmp_path):
    y = np.zeros((300, 2), np.float64)
    y[7, 1] = -np.inf
    path = write(tmp_path / "d.h5", np.ones((300, 3), np.float32), y, index=np.arange(300))
    with pytest.raises(finite.NonFiniteData, match=r"'y' holds -inf at example 7"):
        finite.check_file(path, None)


def test_integer_datasets_and_named_datasets_absent_are_not_scanned(tmp_path):
    path = write(tmp_path / "d.h5", np.ones((10, 3), np.float32), np.arange(10))
    finite.check_file(path, ["x", "y", "not_there"])


def test_a_clean_file_is_remembered_until_it_changes(tmp_path, monkeypatch):
    path = write(tmp_path / "d.h5", np.ones((100, 3), np.float32), np.zeros(100, np.float32))
    finite.check_file(path, ["x", "y"])
    remembered = list(finite.cache_dir().glob("*.json"))
    assert len(remembered) == 1 and json.loads(remembered[0].read_text())["finite"] is True
    scans = []
    real = finite.first_non_finite
    monkeypatch.setattr(finite, "first_non_finite", lambda *a, **k: scans.append(1) or real(*a, **k))
    finite.check_file(path, ["x", "y"])
    assert scans == []  # the second submit of the same data reads nothing
    with h5py.File(path, "a") as f:
        f["x"][3, 0] = np.nan
    os.utime(path, ns=(1, 1))  # a changed file, whatever the clock's resolution
    with pytest.raises(finite.NonFiniteData, match="example 3"):
        finite.check_file(path, ["x", "y"])
    assert scans


def test_progress_hears_every_byte(tmp_path):
    path = write(tmp_path / "d.h5", np.ones((1000, 8), np.float32), np.zeros(1000, np.float32))
    heard = []

    def progress(description, total):
        heard.append(total)
        return heard.append

    finite.check_file(path, ["x", "y"], chunk_bytes=1024, progress=progress)
    assert heard[0] == 1000 * 8 * 4 + 1000 * 4 and sum(heard[1:]) == heard[0]


@pytest.mark.parametrize("where, dry", [("labels", ["--dry-run"]), ("inputs", [])])
def test_submit_and_its_dry_run_refuse_non_finite_data_in_one_line_and_write_nothing(keras_job, tmp_path, where, dry):
    import subprocess

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 6)).astype(np.float32)
    y = rng.normal(size=(1024, 2)).astype(np.float32)
    (y if where == "labels" else x)[700, 1] = np.nan
    bad = write(tmp_path / "bad.h5", x, y)
    val = write(tmp_path / "val.h5", x[:100] * 0, y[:100] * 0)
    args = ['data.task="regression"', f'data.train="{bad}"', f'data.val="{val}"', f'data.test="{val}"',
            "model.args={units = 8, classes = 2}"]
    with pytest.raises(finite.NonFiniteData, match=r"data\.train: .*bad\.h5: '[xy]' holds nan at example 700"):
        prepare(str(keras_job), args)
    proc = subprocess.run([HPCDL, "submit", str(keras_job), *dry, *sum((["--set", a] for a in args), [])],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
                               "MPLCONFIGDIR": os.path.expanduser("~/.cache/matplotlib")})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds nan at example 700" in lines[0]
    assert not (tmp_path / "runs").exists()
    prepare(str(keras_job), args + ["run.check_finite=false"])  # skipped knowingly
