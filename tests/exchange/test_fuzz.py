"""The exchange-file reader under fuzzing: arbitrary bytes, mutated valid files,
and validly tagged files with lying headers are rejected with a clean CorruptFile -- never another
exception -- and memory stays bounded by the file's real size, whatever the header claims."""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hpcdl import exchange as ex
from tests.helpers import applier_for
from hpcdl.exchange import Channel, CorruptFile, Signer

RUN = "fuzz-run"
KEY = b"fuzz-key-0123456789abcdef"
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SIGNERS = {"sha256": Signer(), "hmac": Signer(KEY)}


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="hpcdl-fuzz-") as d:
        yield Path(d)


def read(path: Path, signer: Signer, **kw):
    return ex.read_file(path, run_id=RUN, signer=signer, **kw)


def read_bounded(path: Path, signer: Signer, **kw):
    """read_file under tracemalloc: returns (result or the CorruptFile, peak bytes)."""
    tracemalloc.start()
    try:
        try:
            result = read(path, signer, **kw)
        except CorruptFile as e:
            result = e
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def memory_bound(path: Path) -> int:
    """What the reader may use: the payload once, the tensors' native copies once more, and the
    parsed header (Python objects: generously 64 bytes per header byte), plus a constant."""
    size = path.stat().st_size
    hlen = min(ex.MAX_HEADER_BYTES, max(0, size - ex.PREFIX_SIZE))
    return 3 * size + 64 * hlen + (256 << 10)


# ----------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------

dtypes = st.sampled_from(sorted(ex.ALLOWED_DTYPES))
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@st.composite
def tensor_dicts(draw):
    n = draw(st.integers(0, 4))
    out = {}
    for i in range(n):
        dt = np.dtype(draw(dtypes))
        shape = tuple(draw(shapes))
        count = math.prod(shape)
        raw = draw(st.binary(min_size=count * dt.itemsize, max_size=count * dt.itemsize))
        out[f"t{i}/{draw(st.text(min_size=0, max_size=4))}"] = np.frombuffer(raw, dtype=dt).reshape(shape)
    return out


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                      st.floats(allow_nan=False), st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), c, max_size=4)),
                          max_leaves=12)
lying_int = st.one_of(st.integers(-3, 70), st.integers(-(2 ** 64), 2 ** 64), st.sampled_from([2 ** 31, 2 ** 62, 2 ** 63 - 1]),
                      st.floats(allow_nan=False), st.none(), st.text(max_size=3), st.booleans())


@st.composite
def lying_entries(draw):
    entry = {
        "name": draw(st.one_of(st.text(max_size=5), json_value)),
        "dtype": draw(st.one_of(dtypes, st.sampled_from(["|O", "<U4", "V8", ">f4", "<f16", "float32"]), json_value)),
        "shape": draw(st.one_of(st.lists(lying_int, max_size=4),
                                st.lists(st.integers(0, 2 ** 40), max_size=40), json_value)),
        "offset": draw(lying_int),
        "nbytes": draw(lying_int),
    }
    if draw(st.booleans()):  # sometimes a consistent entry, so validation gets past nbytes
        dt = entry["dtype"] if isinstance(entry["dtype"], str) and entry["dtype"] in ex.ALLOWED_DTYPES else "<f4"
        shape = draw(st.lists(st.integers(0, 2 ** 33), max_size=4))
        entry.update(dtype=dt, shape=shape, nbytes=math.prod(shape) * np.dtype(dt).itemsize,
                     offset=draw(st.integers(0, 256)))
    if draw(st.integers(0, 9)) == 0:
        entry[draw(st.sampled_from(["extra", "name"]))] = 1
        if draw(st.booleans()):
            del entry["name"]
    return entry


@st.composite
def lying_headers(draw):
    header = {
        "run_id": draw(st.one_of(st.just(RUN), json_value)),
        "kind": draw(st.one_of(st.sampled_from(ex.KINDS), json_value)),
        "tag_alg": draw(st.sampled_from(["sha256", "poly1305", "hmac-sha256", "md5", ""])),
        "created": draw(st.one_of(st.floats(allow_nan=False, allow_infinity=False), json_value)),
        "group": draw(lying_int), "seq": draw(lying_int), "base_version": draw(lying_int),
        "version": draw(lying_int),
        "meta": draw(st.one_of(st.dictionaries(st.text(max_size=4), json_value, max_size=3), json_value)),
        "tensors": draw(st.one_of(st.lists(lying_entries(), max_size=4), json_value)),
    }
    for key in draw(st.lists(st.sampled_from(sorted(header)), max_size=1)):
        del header[key]
    return header


def craft(path: Path, hbytes: bytes, payload: bytes, signer: Signer, *, hlen=None, plen=None,
          magic=ex.MAGIC, fmt=ex.FORMAT_VERSION) -> Path:
    """A file with any header and payload and a *valid* tag: only validation can refuse it."""
    signed = struct.pack("<8sIIQ", magic, fmt, len(hbytes) if hlen is None else hlen,
                         len(payload) if plen is None else plen)
    h = signer.mac()
    h.update(signed + hbytes + payload)
    path.write_bytes(signed + h.field() + hbytes + payload)
    return path


def check_result(result, path: Path) -> None:
    """Either a clean CorruptFile, or tensors that really are what the header says."""
    if isinstance(result, CorruptFile):
        msg = str(result)
        assert msg and "\n" not in msg and len(msg) < 1000
        return
    header, tensors = result
    assert isinstance(header, dict) and set(tensors) == {t["name"] for t in header["tensors"]}
    for t in header["tensors"]:
        arr = tensors[t["name"]]
        assert arr.dtype == np.dtype(t["dtype"]).newbyteorder("=")
        assert list(arr.shape) == t["shape"] and arr.nbytes == t["nbytes"]


# ----------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signer_name", sorted(SIGNERS))
@SETTINGS
@given(data=st.one_of(st.binary(max_size=2048),
                      st.binary(max_size=512).map(lambda b: ex.MAGIC + b)))
def test_arbitrary_bytes(scratch, signer_name, data):
    path = scratch / "u-g000001-s000000000002.hx"
    path.write_bytes(data)
    result, peak = read_bounded(path, SIGNERS[signer_name])
    assert isinstance(result, CorruptFile)
    assert peak <= memory_bound(path)


@pytest.mark.parametrize("signer_name", sorted(SIGNERS))
@SETTINGS
@given(tensors=tensor_dicts(), mutations=st.lists(st.tuples(
    st.sampled_from(["flip", "truncate", "append", "overwrite", "hlen", "plen"]),
    st.integers(0, 1 << 16), st.integers(0, 255), st.binary(min_size=1, max_size=16)),
    min_size=1, max_size=3))
def test_mutated_valid_files(scratch, signer_name, tensors, mutations):
    signer = SIGNERS[signer_name]
    path = scratch / "w-v000000000003.hx"
    ex.write_file(path, run_id=RUN, kind="weights", tensors=tensors, signer=signer, version=3,
                  fsync=False)
    original = path.read_bytes()
    data = bytearray(original)
    for op, pos, byte, blob in mutations:
        if op == "flip" and data:
            data[pos % len(data)] ^= (byte or 1)
        elif op == "truncate":
            del data[pos % (len(data) + 1):]
        elif op == "append":
            data += blob
        elif op == "overwrite" and data:
            at = pos % len(data)
            data[at:at + len(blob)] = blob
        elif op == "hlen" and len(data) >= 16:
            data[12:16] = struct.pack("<I", (pos * 977 + byte) & 0xFFFFFFFF)
        elif op == "plen" and len(data) >= 24:
            data[16:24] = struct.pack("<Q", (pos << 40 | byte) & 0xFFFFFFFFFFFFFFFF)
    path.write_bytes(bytes(data))
    result, peak = read_bounded(path, signer)
    assert peak <= memory_bound(path)
    if bytes(data) != original:
        # every change to a signed byte breaks the tag, so nothing mutated is ever accepted
        assert isinstance(result, CorruptFile), mutations
    else:
        check_result(result, path)
        for k, v in tensors.items():
            assert result[1][k].tobytes() == np.ascontiguousarray(v).tobytes()


@pytest.mark.parametrize("signer_name", sorted(SIGNERS))
@SETTINGS
@given(header=lying_headers(), payload=st.binary(max_size=300),
       raw=st.one_of(st.none(), st.binary(max_size=64),
                     st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
                     st.integers(1, 2000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)))
def test_validly_tagged_lying_headers(scratch, signer_name, header, payload, raw):
    signer = SIGNERS[signer_name]
    hbytes = raw if raw is not None else json.dumps(header).encode()
    path = craft(scratch / "u-g000001-s000000000002.hx", hbytes, payload, signer)
    result, peak = read_bounded(path, signer)
    check_result(result, path)
    assert peak <= memory_bound(path)
    # through the channel as well (name/header cross-checks)
    ch = Channel(scratch / "xch", RUN, signer=signer, stripe=False)
    target = ch.updates_dir / path.name
    os.replace(path, target)
    try:
        ch.read_update(target)
    except CorruptFile:
        pass


@SETTINGS
@given(hlen=st.integers(0, 2 ** 32 - 1), plen=st.integers(0, 2 ** 64 - 1), tail=st.binary(max_size=128))
def test_lying_lengths_never_size_an_allocation(scratch, hlen, plen, tail):
    """The prefix may claim a 4 GiB header and a 16 EiB payload: the reader allocates nothing
    from those numbers (they must add up to the real file size first)."""
    assume(ex.PREFIX_SIZE + hlen + plen != ex.PREFIX_SIZE + len(tail))
    path = craft(scratch / "w-v000000000001.hx", tail, b"", Signer(), hlen=hlen, plen=plen)
    result, peak = read_bounded(path, Signer())
    assert isinstance(result, CorruptFile)
    assert peak < 64 << 10


def test_every_truncation_of_a_valid_file(scratch):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype="<i8"),
               "c": np.zeros((0, 4), np.float64)}
    path = scratch / "w-v000000000009.hx"
    ex.write_file(path, run_id=RUN, kind="weights", tensors=tensors, signer=Signer(KEY), version=9, fsync=False)
    data = path.read_bytes()
    for n in range(len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(CorruptFile):
            read(path, Signer(KEY))
    path.write_bytes(data)
    assert set(read(path, Signer(KEY))[1]) == {"a", "b", "c"}


def test_update_larger_than_the_master_can_need_is_refused_before_reading(tmp_path, monkeypatch):
    ch = Channel(tmp_path / "x", RUN, signer=Signer(KEY))
    w = {"w": np.zeros(16, np.float32)}
    with applier_for(ch, "sgd", 1.0, initial=w) as app:
        big = {"w": np.zeros(16, np.float32), "pad": np.zeros(4 << 20, np.uint8)}
        ch.publish_update(0, 0, 0, big)
        opened = []
        real = ex.read_file

        def spy(path, **kw):
            opened.append(kw.get("max_bytes"))
            return real(path, **kw)

        monkeypatch.setattr(ex.channel, "read_file", spy)  # where the Channel looks it up
        tracemalloc.start()
        app.step()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert app.counts["rejected_corrupt"] == 1 and "exceeds" in json.loads(
            ch.events_path.read_text().splitlines()[-1])["reason"]
        assert opened and opened[0] < 2 << 20
        assert peak < 2 << 20  # the 4 MiB payload was never read


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(blobs=st.lists(st.one_of(st.binary(max_size=256), st.binary(max_size=64).map(lambda b: ex.MAGIC + b)),
                      min_size=1, max_size=8),
       headers=st.lists(lying_headers(), max_size=4))
def test_the_applier_survives_whatever_is_in_updates(blobs, headers):
    with tempfile.TemporaryDirectory(prefix="hpcdl-fuzz-app-") as d:
        ch = Channel(Path(d) / "x", RUN, signer=Signer(KEY), fsync=False, stripe=False)
        w = {"w": np.ones(4, np.float32)}
        with applier_for(ch, "sgd", 1.0, initial=w) as app:
            for i, blob in enumerate(blobs):
                (ch.updates_dir / ex.update_name(100 + i, 0)).write_bytes(blob)
            for i, header in enumerate(headers):
                header = dict(header)
                craft(ch.updates_dir / ex.update_name(200 + i, 0), json.dumps(header).encode(), b"\0" * 64,
                      Signer(KEY))
            ch.publish_update(0, 0, 0, {"w": np.ones(4, np.float32)})
            while app.step():
                pass
            assert ch.backlog() == 0
            c = app.counts
            assert c["applied"] + c["rejected_corrupt"] + c["rejected_invalid"] == len(blobs) + len(headers) + 1
            assert (0, 0) in app.ledger
