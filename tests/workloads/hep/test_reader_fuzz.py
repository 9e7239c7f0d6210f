"""The HEP HDF5 reader under fuzzing: truncated files, mutated bytes, lying
layouts and absurd sizes must end in a clean DataError (one line, names the file) with bounded
memory -- never a KeyError/RuntimeError from deep inside h5py, never an allocation sized by what
the file claims.

The reader bounds what a file may declare (events, image side, HDF5 chunk size) and turns
h5py's own errors on corrupted content into DataError; these tests are why.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcdl.workloads.hep.data import DataError, HepReader, open_hep
from tests.conftest import REPO

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
AS_LIMIT = 512 << 20  # address-space limit for the absurd-size cases (python+numpy+h5py: ~140 MiB)


def write_small_nersc(path: Path, n: int = 24, h: int = 6, w: int = 5, chunks=None) -> bytes:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        g = f.create_group("all_events")
        for key in ("hist", "histEM", "histtrack"):
            g.create_dataset(key, data=rng.random((n, h, w), dtype=np.float32), chunks=chunks)
        g["y"] = (np.arange(n) % 2).astype(np.float32)
        g["weight"] = np.ones(n, np.float32)
        g["passSR"] = np.arange(n) % 3 == 0
    return path.read_bytes()


def write_small_benchmark(path: Path, n: int = 20, h: int = 4, w: int = 7) -> bytes:
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        f["data"] = rng.random((n, 3, h, w), dtype=np.float32)
        f["label"] = (np.arange(n) % 2).astype(np.int32)
        f["weight"] = np.ones(n, np.float32)
        f["psr"] = np.zeros(n, np.int32)
    return path.read_bytes()


def read_everything(path: Path) -> None:
    """What training and evaluation do: open, then read every event in chunks (all accessors)."""
    hep = open_hep(path)
    h, w, c = hep.image_shape
    with HepReader(hep) as reader:
        for lo in range(0, hep.n_events, 8):
            hi = min(lo + 8, hep.n_events)
            b = reader.read(lo, hi)
            assert b.x.shape == (hi - lo, h, w, 3) and b.x.dtype == np.float32
            assert b.y.shape == (hi - lo,) and set(np.unique(b.y)) <= {0, 1}
            assert b.w.shape == (hi - lo,)


def outcome(path: Path) -> str:
    try:
        read_everything(path)
    except DataError as e:
        msg = str(e)
        assert "\n" not in msg and str(path) in msg, msg
        return "DataError"
    return "ok"


class Files(dict):
    """layout -> bytes of a valid file (a repr that does not print the bytes)."""

    def __repr__(self) -> str:
        return f"Files({sorted(self)})"


@pytest.fixture(scope="module")
def originals():
    with tempfile.TemporaryDirectory(prefix="hpcdl-h5fuzz-") as d:
        d = Path(d)
        yield d, Files(nersc=write_small_nersc(d / "n.h5"), benchmark=write_small_benchmark(d / "b.h5"),
                       nersc_chunked=write_small_nersc(d / "c.h5", chunks=(4, 6, 5)))


# ----------------------------------------------------------------------------------------------
# bytes
# ----------------------------------------------------------------------------------------------


@SETTINGS
@given(layout=st.sampled_from(["nersc", "benchmark", "nersc_chunked"]), cut=st.floats(0, 1, exclude_max=True))
def test_truncated_files_are_clean_data_errors(originals, layout, cut):
    d, files = originals
    data = files[layout]
    path = d / "truncated.h5"
    path.write_bytes(data[: int(len(data) * cut)])
    assert outcome(path) == "DataError"


@SETTINGS
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_are_clean_data_errors(originals, data):
    d, _ = originals
    path = d / "random.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + data if data[:1] == b"\0" else data)
    assert outcome(path) == "DataError"


def mutate(data: bytes, seed: int) -> bytes:
    rng = random.Random(seed)
    d = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        i = rng.randrange(len(d))
        if rng.random() < 0.5:
            d[i] ^= rng.randrange(1, 256)
        else:
            d[i:i + 8] = rng.randbytes(8)
    return bytes(d)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(["nersc", "benchmark", "nersc_chunked"]), seed=st.integers(0, 2 ** 32))
def test_mutated_files_are_clean_data_errors_or_readable(originals, layout, seed):
    d, files = originals
    path = d / "mutated.h5"
    path.write_bytes(mutate(files[layout], seed))
    outcome(path)  # "ok" (a flipped data byte is still a valid file) or DataError; nothing else


def test_mutated_files_never_crash_the_process_or_hang(originals):
    """300 mutated files, read in a process of their own: none crashes it (a segfault in libhdf5)
    or hangs it, and each is read or refused with a DataError."""
    d, files = originals
    script = textwrap.dedent(f"""
        import collections, json, random, sys
        from pathlib import Path
        from tests.workloads.hep.test_reader_fuzz import mutate, read_everything
        from hpcdl.workloads.hep.data import DataError
        files = {{k: Path(p).read_bytes() for k, p in json.loads(sys.argv[1]).items()}}
        seen = collections.Counter()
        for seed in range(300):
            layout = sorted(files)[seed % len(files)]
            path = Path(sys.argv[2])
            path.write_bytes(mutate(files[layout], seed))
            try:
                read_everything(path)
                seen["ok"] += 1
            except DataError:
                seen["DataError"] += 1
            except (ValueError, KeyError, RuntimeError, OSError, TypeError) as e:
                seen[type(e).__name__] += 1
        print(json.dumps(seen))
    """)
    paths = {"nersc": d / "n.h5", "benchmark": d / "b.h5", "nersc_chunked": d / "c.h5"}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps({k: str(v) for k, v in paths.items()}),
                           str(d / "mut-sub.h5")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(seen.values()) == 300 and seen.get("DataError", 0) > 0
    assert set(seen) <= {"ok", "DataError"}, seen


# ----------------------------------------------------------------------------------------------
# valid HDF5, lying layout
# ----------------------------------------------------------------------------------------------

dims = st.integers(0, 6)
ds_spec = st.one_of(
    st.none(),  # absent
    st.tuples(st.sampled_from(["f4", "f8", "i4", "u1", "bool", "str", "compound"]),
              st.lists(dims, min_size=0, max_size=4)),
    st.just(("group", [])),
)


def make_dataset(parent, key, spec):
    if spec is None:
        return
    kind, shape = spec
    if kind == "group":
        parent.create_group(key)
        return
    shape = tuple(shape)
    if kind == "str":
        parent.create_dataset(key, data=np.full(shape, "x", dtype=h5py.string_dtype()) if shape else "x")
    elif kind == "compound":
        parent.create_dataset(key, shape=shape, dtype=np.dtype([("a", "f4"), ("b", "i4")]))
    elif kind == "bool":
        parent.create_dataset(key, data=np.zeros(shape, bool))
    else:
        parent.create_dataset(key, data=np.ones(shape, dtype=kind))


@SETTINGS
@given(layout=st.sampled_from(["nersc", "benchmark"]),
       specs=st.fixed_dictionaries({k: ds_spec for k in ("a", "b", "c", "d", "e", "f")}))
def test_lying_layouts_are_clean_data_errors_or_consistent(originals, layout, specs):
    d, _ = originals
    path = d / "layout.h5"
    with h5py.File(path, "w") as f:
        if layout == "nersc":
            g = f.create_group("all_events")
            for key, spec in zip(("hist", "histEM", "histtrack", "y", "weight", "passSR"), specs.values()):
                make_dataset(g, key, spec)
        else:
            for key, spec in zip(("data", "label", "weight", "normweight", "psr", "other"), specs.values()):
                make_dataset(f, key, spec)
    try:
        read_everything(path)
    except DataError as e:
        assert "\n" not in str(e)
    except ValueError as e:  # labels that are not 0/1 are reported when read, as DataError too
        raise AssertionError(f"not a DataError: {type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------------------------
# absurd sizes (each case in a subprocess with a hard address-space limit)
# ----------------------------------------------------------------------------------------------

RUN_LIMITED = textwrap.dedent("""
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    resource.setrlimit(resource.RLIMIT_CPU, (120, 120))
    from hpcdl.workloads.hep.data import DataError, iter_batches, open_hep
    try:
        hep = open_hep(sys.argv[1])
        if sys.argv[3] == "iter":  # what training does: a prefetching shard iterator
            it = iter_batches(hep, batch_size=4, rank=0, size=1, chunk_events=64, prefetch=1,
                              drop_remainder=True, epochs=1)
            x = next(iter(it))[0]
            it.close()
        else:  # one small read, in this thread
            with HepReader(hep) as reader:
                x = reader.read(0, 4).x
        print(json.dumps({"result": "ok", "n": hep.n_events, "shape": list(x.shape)}))
    except DataError as e:
        print(json.dumps({"result": "DataError", "msg": str(e)}))
    except BaseException as e:
        print(json.dumps({"result": type(e).__name__, "msg": str(e)[:300]}))
    sys.stdout.flush()
    os._exit(0)
""")


def run_limited(path: Path, mode: str = "iter") -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN_LIMITED, str(path), str(AS_LIMIT), mode],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sparse_nersc(path: Path, n: int, h: int, w: int, chunk=(1, 64, 64)) -> Path:
    """A valid NERSC file that declares (n, h, w) images but stores nothing (HDF5 fills zeros)."""
    with h5py.File(path, "w") as f:
        g = f.create_group("all_events")
        for key in ("hist", "histEM", "histtrack"):
            g.create_dataset(key, shape=(n, h, w), dtype="f4", chunks=tuple(min(c, s) for c, s in zip(chunk, (n, h, w))))
        g.create_dataset("y", shape=(n,), dtype="f4", chunks=(min(n, 1 << 16),))
    return path


def test_many_declared_events_stream_in_bounded_memory(tmp_path):
    """A large N is fine: the reader streams chunk by chunk, the first batch comes under the limit."""
    result = run_limited(sparse_nersc(tmp_path / "many.h5", 1 << 24, 8, 8, chunk=(1024, 8, 8)))
    assert result == {"result": "ok", "n": 1 << 24, "shape": [4, 8, 8, 3]}, result


def test_a_trillion_declared_events_is_a_clean_data_error_or_streams(tmp_path):
    result = run_limited(sparse_nersc(tmp_path / "many.h5", 1 << 40, 8, 8, chunk=(1024, 8, 8)))
    assert result["result"] in ("ok", "DataError"), result


def test_absurd_image_size_is_a_clean_data_error(tmp_path):
    result = run_limited(sparse_nersc(tmp_path / "wide.h5", 64, 1 << 16, 1 << 16), mode="read")
    assert result["result"] == "DataError", result


def test_decompression_bomb_is_a_clean_data_error(tmp_path):
    import zlib

    path = tmp_path / "bomb.h5"
    n, h, w = 16384, 128, 128  # small images, one 1 GiB float32 chunk stored as ~5 MiB of deflate
    comp = zlib.compressobj(1)
    zero = bytes(64 << 20)
    blob = b"".join(comp.compress(zero) for _ in range((n * h * w * 4) // len(zero))) + comp.flush()
    with h5py.File(path, "w") as f:
        g = f.create_group("all_events")
        for key in ("hist", "histEM", "histtrack"):
            ds = g.create_dataset(key, shape=(n, h, w), dtype="f4", chunks=(n, h, w), compression="gzip")
            ds.id.write_direct_chunk((0, 0, 0), blob)
        g["y"] = np.zeros(n, np.float32)
    assert path.stat().st_size < 16 << 20
    result = run_limited(path, mode="read")
    assert result["result"] == "DataError", result
