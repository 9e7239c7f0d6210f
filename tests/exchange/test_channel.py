"""Tests of the exchange file format and Channel (real files, real processes)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from hpcdl import exchange as ex
from hpcdl.fs import files
from hpcdl.exchange import Channel, CorruptFile, Signer
from tests.conftest import REPO

RUN = "run-test"


def env_with_root() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def ch(tmp_path: Path) -> Channel:
    return Channel(tmp_path / "xch", RUN)


def craft(path: Path, header: dict, payload: bytes, *, signer: Signer | None = None,
          plen: int | None = None, hbytes: bytes | None = None, magic: bytes = ex.MAGIC,
          fmt: int = ex.FORMAT_VERSION) -> Path:
    """Write a file with an arbitrary (possibly lying) header and a *valid* tag."""
    signer = signer or Signer()
    hbytes = json.dumps(header).encode() if hbytes is None else hbytes
    plen = len(payload) if plen is None else plen
    signed = struct.pack("<8sIIQ", magic, fmt, len(hbytes), plen)
    h = signer.mac()
    h.update(signed + hbytes + payload)
    path.write_bytes(signed + h.field() + hbytes + payload)
    return path


def base_header(**kw) -> dict:
    header = {"run_id": RUN, "kind": "update", "tag_alg": "sha256", "created": time.time(),
              "group": 1, "seq": 2, "base_version": 0, "version": None, "meta": {},
              "tensors": []}
    header.update(kw)
    return header


ALL_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
              np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]
SHAPES = [(), (0,), (3,), (2, 0, 4), (2, 3), (1, 1, 1, 5)]


# ----------------------------------------------------------------------------------------------
# format
# ----------------------------------------------------------------------------------------------


def test_round_trip_every_dtype_and_shape(ch: Channel) -> None:
    rng = np.random.default_rng(0)
    tensors = {}
    for dt in ALL_DTYPES:
        for shape in SHAPES:
            a = (rng.standard_normal(shape) * 100).astype(dt)
            tensors[f"{np.dtype(dt).name}/{'x'.join(map(str, shape)) or 'scalar'}"] = a
    tensors["big-endian"] = np.arange(7, dtype=">f8")
    tensors["non-contiguous"] = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
    tensors["numpy-scalar"] = np.float32(2.5)
    tensors["python-float"] = 1.25
    ch.publish_update(3, 7, 5, tensors)
    (ref,) = ch.pending_updates()
    upd = ch.read_update(ref)
    assert (upd.group, upd.seq, upd.base_version) == (3, 7, 5)
    assert list(upd.tensors) == list(tensors)
    for name, want in tensors.items():
        got = upd.tensors[name]
        want = np.asarray(want)
        assert got.shape == want.shape, name
        assert got.dtype == want.dtype.newbyteorder("="), name
        assert got.dtype.isnative
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_empty_tensor_dict_round_trip(ch: Channel) -> None:
    ch.publish_weights(0, {})
    assert ch.read_weights(0) == (0, {})


def test_refuses_non_numeric_dtypes(ch: Channel) -> None:
    for bad in (np.array(["a"]), np.array([object()], dtype=object), np.array([b"x"]),
                np.array([1], dtype="datetime64[s]")):
        with pytest.raises(TypeError):
            ch.publish_update(0, 0, 0, {"x": bad})
    assert ch.pending_updates() == []
    assert not any(ch.updates_dir.iterdir()), "a failed publish must leave no temporary"


def test_flipped_bytes_are_detected(ch: Channel) -> None:
    path = ch.publish_update(1, 1, 0, {"w": np.arange(100, dtype=np.float32)})
    raw = path.read_bytes()
    hlen = struct.unpack_from("<I", raw, 12)[0]
    positions = {"payload": len(raw) - 5, "tag": 30, "header": ex.PREFIX_SIZE + hlen // 2,
                 "magic": 2}
    for where, pos in positions.items():
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptFile) as info:
            ch.read_update(path)
        assert "\n" not in str(info.value)
        if where in ("payload", "tag"):
            assert "checksum" in str(info.value)


def test_truncated_and_extended_files(ch: Channel) -> None:
    path = ch.publish_update(1, 1, 0, {"w": np.arange(100, dtype=np.float64)})
    raw = path.read_bytes()
    for cut in (0, 5, ex.PREFIX_SIZE - 1, ex.PREFIX_SIZE, ex.PREFIX_SIZE + 10, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(CorruptFile, match="truncated|size mismatch"):
            ch.read_update(path)
    path.write_bytes(raw + b"\0")
    with pytest.raises(CorruptFile, match="size mismatch"):
        ch.read_update(path)


def test_wrong_run_id_and_kind(ch: Channel, tmp_path: Path) -> None:
    other = Channel(tmp_path / "xch", "another-run")
    path = other.publish_update(1, 1, 0, {"w": np.ones(3)})
    with pytest.raises(CorruptFile, match="run id"):
        ch.read_update(path)
    wpath = ch.publish_weights(3, {"w": np.ones(3)})
    with pytest.raises(CorruptFile, match="kind"):
        ch.read_update(wpath)


def test_name_must_match_header(ch: Channel) -> None:
    path = ch.publish_update(1, 1, 0, {"w": np.ones(3)})
    moved = path.with_name(ex.update_name(1, 2))
    os.replace(path, moved)
    with pytest.raises(CorruptFile, match="name"):
        ch.read_update(moved)


def test_hmac_signer(tmp_path: Path) -> None:
    plain = Channel(tmp_path / "x", RUN)
    keyed = Channel(tmp_path / "x", RUN, signer=Signer(b"k" * 32))
    wrong = Channel(tmp_path / "x", RUN, signer=Signer(b"j" * 32))
    p1 = plain.publish_update(0, 0, 0, {"a": np.ones(2)})
    with pytest.raises(CorruptFile, match="tag algorithm"):
        keyed.read_update(p1)  # no downgrade to an unkeyed hash
    p2 = keyed.publish_update(0, 1, 0, {"a": np.ones(2)})
    assert keyed.read_update(p2).tensors["a"].tolist() == [1.0, 1.0]
    with pytest.raises(CorruptFile, match="checksum"):
        wrong.read_update(p2)
    with pytest.raises(ValueError):
        Signer(b"short")


def test_keyed_tags_are_poly1305_under_a_key_of_their_own(tmp_path: Path) -> None:
    keyed = Channel(tmp_path / "x", RUN, signer=Signer(b"k" * 32))
    same = {"a": np.arange(8.0)}
    p1, p2 = keyed.publish_update(0, 1, 0, same), keyed.publish_update(0, 2, 0, same)
    header, _ = ex.read_file(p1, run_id=RUN, signer=keyed.signer)
    assert header["tag_alg"] == "poly1305"
    field1, field2 = p1.read_bytes()[24:56], p2.read_bytes()[24:56]
    assert field1[:16] != field2[:16]  # a fresh nonce, so a fresh one-time key, per file
    raw = bytearray(p1.read_bytes())
    raw[24] ^= 1  # the nonce is not covered by the tag, but the key derived from it is
    p1.write_bytes(bytes(raw))
    with pytest.raises(CorruptFile, match="checksum"):
        keyed.read_update(p1)


def test_files_tagged_with_hmac_sha256_stay_readable_under_the_key(tmp_path: Path) -> None:
    """Runs written before the Poly1305 tag resume: their state and weights carry HMAC-SHA256."""
    key = b"k" * 32
    header = base_header(tag_alg="hmac-sha256", tensors=[entry(shape=(4,))])
    payload = np.arange(4.0).tobytes()
    hbytes = json.dumps(header).encode()
    signed = struct.pack("<8sIIQ", ex.MAGIC, ex.FORMAT_VERSION, len(hbytes), len(payload))
    tag = hmac.new(key, signed + hbytes + payload, hashlib.sha256).digest()
    path = tmp_path / ex.update_name(1, 2)
    path.write_bytes(signed + tag + hbytes + payload)
    keyed = Channel(tmp_path / "x", RUN, signer=Signer(key))
    assert keyed.read_update(path).tensors["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(CorruptFile, match="checksum"):
        Channel(tmp_path / "y", RUN, signer=Signer(b"j" * 32)).read_update(path)


# ----------------------------------------------------------------------------------------------
# lying headers, bounded memory
# ----------------------------------------------------------------------------------------------


def entry(name="w", dtype="<f8", shape=(4,), offset=0, nbytes=None) -> dict:
    nb = int(np.prod(shape)) * np.dtype(dtype).itemsize if nbytes is None else nbytes
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nb}


LIES = {
    "huge shape": (base_header(tensors=[entry(shape=(1 << 30, 1 << 30))]), b"\0" * 32,
                   "bad shape|outside"),
    "huge empty shape": (base_header(tensors=[entry(shape=(0, 1 << 31, 1 << 31), nbytes=0)]),
                         b"\0" * 32, "bad shape"),
    "nbytes vs shape": (base_header(tensors=[entry(shape=(4,), nbytes=16)]), b"\0" * 32,
                        "nbytes"),
    "offset out of range": (base_header(tensors=[entry(offset=8)]), b"\0" * 32, "outside"),
    "negative offset": (base_header(tensors=[entry(offset=-8)]), b"\0" * 32, "offset"),
    "overlap": (base_header(tensors=[entry("a", offset=0), entry("b", offset=16)]),
                b"\0" * 64, "overlap"),
    "object dtype": (base_header(tensors=[entry(dtype="|O")]), b"\0" * 32, "not allowed"),
    "unicode dtype": (base_header(tensors=[entry(dtype="<U4", shape=(2,))]), b"\0" * 32,
                      "not allowed"),
    "big-endian dtype": (base_header(tensors=[entry(dtype=">f8")]), b"\0" * 32, "not allowed"),
    "negative dim": (base_header(tensors=[entry(shape=(-4,), nbytes=32)]), b"\0" * 32, "shape"),
    "float dim": (base_header(tensors=[{**entry(), "shape": [4.0]}]), b"\0" * 32, "shape"),
    "bool dim": (base_header(tensors=[{**entry(), "shape": [True]}]), b"\0" * 8, "shape"),
    "duplicate names": (base_header(tensors=[entry("a"), entry("a", offset=32)]), b"\0" * 64,
                        "duplicate"),
    "extra field": (base_header(evil=1), b"", "fields"),
    "missing field": ({k: v for k, v in base_header().items() if k != "meta"}, b"", "fields"),
    "unknown kind": (base_header(kind="code"), b"", "kind"),
    "update without seq": (base_header(seq=None), b"", "seq"),
    "negative group": (base_header(group=-3), b"", "group"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_headers_are_rejected(ch: Channel, lie: str) -> None:
    header, payload, match = LIES[lie]
    path = craft(ch.updates_dir / ex.update_name(1, 2), header, payload)
    with pytest.raises(CorruptFile, match=match):
        ch.read_update(path)


def test_lying_prefix_sizes_do_not_allocate(ch: Channel) -> None:
    header = base_header(tensors=[entry(shape=(1 << 27,))])  # 1 GiB claimed
    cases = {
        "payload length": dict(plen=1 << 30),
        "payload length 2**63": dict(plen=(1 << 63) + 5),
        "header length": dict(hbytes=b"{" * (ex.MAX_HEADER_BYTES + 1)),
        "bad json": dict(hbytes=b"[" * 100000),
        "magic": dict(magic=b"\x80\x04\x95PICK"),
        "format": dict(fmt=99),
    }
    for name, kw in cases.items():
        path = craft(ch.updates_dir / ex.update_name(1, 2), header, b"\0" * 64, **kw)
        tracemalloc.start()
        try:
            with pytest.raises(CorruptFile):
                ch.read_update(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"{name}: peak allocation {peak} bytes"


def test_pickle_under_a_valid_name_is_never_executed(ch: Channel, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps({"w": Evil()})
    path = ch.updates_dir / ex.update_name(1, 1)
    path.write_bytes(payload)
    # also a pickle wrapped to look like our prefix, and an .npy with an object array
    path2 = ch.updates_dir / ex.update_name(1, 2)
    path2.write_bytes(ex.MAGIC + payload)
    [ref1, ref2] = ch.pending_updates()
    for ref in (ref1, ref2):
        with pytest.raises(CorruptFile):
            ch.read_update(ref)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# publishing, temporaries, order
# ----------------------------------------------------------------------------------------------


def test_temporary_of_a_killed_writer_is_ignored_and_cleaned(ch: Channel) -> None:
    # A real writer killed after writing its temporary but before the rename.
    script = textwrap.dedent(f"""
        import os, sys, time, numpy as np
        from hpcdl.exchange import Channel
        def stuck(*args):  # written and closed, not yet renamed
            sys.stdout.write("writing\\n"); sys.stdout.flush(); time.sleep(60)
        os.replace = stuck
        Channel({str(ch.root)!r}, {RUN!r}).publish_update(4, 9, 0, {{"w": np.ones(1 << 16)}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            env=env_with_root(), text=True)
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    temps = [p for p in ch.updates_dir.iterdir() if p.name.startswith(".tmp-")]
    assert len(temps) == 1
    assert temps[0].name.endswith(ex.update_name(4, 9))
    # A hand-made partial temporary too.
    (ch.updates_dir / f".tmp-deadbeef-{ex.update_name(4, 10)}").write_bytes(ex.MAGIC)
    assert ch.pending_updates() == []
    assert ch.backlog() == 0
    assert ch.next_seq(4) == 0
    assert ch.clean_stale_temporaries(3600) == 0  # fresh: could still be in progress
    assert ch.clean_stale_temporaries(0) == 2
    assert list(ch.updates_dir.iterdir()) == []


def test_arrival_order(ch: Channel) -> None:
    p_a = ch.publish_update(2, 0, 0, {"w": np.ones(1)})
    p_b = ch.publish_update(1, 0, 0, {"w": np.ones(1)})
    p_c = ch.publish_update(2, 1, 0, {"w": np.ones(1)})
    p_d = ch.publish_update(1, 1, 0, {"w": np.ones(1)})
    base = time.time_ns() - 10**9
    for i, p in enumerate((p_b, p_a, p_d, p_c)):  # arrival: b, a, d, c
        os.utime(p, ns=(base + i * 1000, base + i * 1000))
    assert [(r.group, r.seq) for r in ch.pending_updates()] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    # A group's own updates stay in seq order even if their mtimes say otherwise.
    os.utime(p_c, ns=(base - 5000, base - 5000))
    assert [(r.group, r.seq) for r in ch.pending_updates()] == [(2, 0), (1, 0), (2, 1), (1, 1)]
    # Equal mtimes: by name.
    for p in (p_a, p_b, p_c, p_d):
        os.utime(p, ns=(base, base))
    assert [(r.group, r.seq) for r in ch.pending_updates()] == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_backlog_bound_without_applier(tmp_path: Path) -> None:
    ch = Channel(tmp_path / "x", RUN, max_pending_per_group=3)
    for seq in range(10):
        for group in (0, 1):
            ch.publish_update(group, seq, -1, {"w": np.full(4, seq)})
            assert ch.backlog(group) <= 3
    assert ch.backlog() == 6
    assert ch.dropped_backlog == 14
    kept = [(r.group, r.seq) for r in ch.pending_updates()]
    assert sorted(kept) == [(g, s) for g in (0, 1) for s in (7, 8, 9)]  # the newest kept
    assert ch.next_seq(0) == 10 and ch.next_seq(5) == 0


def test_backlog_bound_with_concurrent_publisher_processes(tmp_path: Path) -> None:
    root = tmp_path / "x"
    Channel(root, RUN)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from hpcdl.exchange import Channel
        g = int(sys.argv[1])
        ch = Channel({str(root)!r}, {RUN!r}, max_pending_per_group=4)
        for s in range(40):
            ch.publish_update(g, s, -1, {{"w": np.ones(8)}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(g)], env=env_with_root())
             for g in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    ch = Channel(root, RUN)
    assert all(ch.backlog(g) == 4 for g in range(3))
    assert not [p for p in ch.updates_dir.iterdir() if p.name.startswith(".tmp-")]


# ----------------------------------------------------------------------------------------------
# weights, proposals, status
# ----------------------------------------------------------------------------------------------


def test_weights_versions_keep_last_k(ch: Channel) -> None:
    assert ch.latest_weights_version() is None
    assert ch.read_latest_weights() is None
    for v in range(6):
        ch.publish_weights(v, {"w": np.full(3, float(v))})
    assert ch.latest_weights_version() == 5
    assert ch.prune_weights(2) == 4
    assert ch.weight_versions() == [4, 5]
    version, tensors = ch.read_latest_weights()
    assert version == 5 and tensors["w"].tolist() == [5.0] * 3
    with pytest.raises(FileNotFoundError):
        ch.read_weights(1)


def test_read_latest_weights_retries_after_losing_a_race(ch: Channel, monkeypatch) -> None:
    ch.publish_weights(1, {"w": np.ones(2)})
    real = ch.read_weights
    calls = []

    def racing(version):
        calls.append(version)
        if len(calls) == 1:  # the applier publishes 2 and prunes 1 between listing and open
            ch.publish_weights(2, {"w": np.full(2, 2.0)})
            ch.prune_weights(1)
        return real(version)

    monkeypatch.setattr(ch, "read_weights", racing)
    version, tensors = ch.read_latest_weights()
    assert calls == [1, 2] and version == 2 and tensors["w"].tolist() == [2.0, 2.0]


def test_propose_initial(ch: Channel) -> None:
    p = ch.propose_initial(3, {"w": np.ones(2)})
    assert p is not None and ch.pending_proposals() == [p]
    assert ch.read_proposal(p)[0] == 3
    t0 = time.monotonic()
    assert ch.initial_weights(4, {"w": np.ones(2)}, timeout=0.3, poll=0.05) is None
    assert time.monotonic() - t0 < 2
    ch.publish_weights(0, {"w": np.zeros(2)})
    assert ch.propose_initial(5, {"w": np.ones(2)}) is None
    version, tensors = ch.initial_weights(6, {"w": np.ones(2)}, timeout=5)
    assert version == 0 and tensors["w"].tolist() == [0.0, 0.0]


def test_channel_without_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Channel(tmp_path / "nothing", RUN, create=False)
    Channel(tmp_path / "x", RUN)
    Channel(tmp_path / "x", RUN, create=False)
    with pytest.raises(ValueError):
        Channel(tmp_path / "x", "")


def test_read_status_tolerates_garbage(ch: Channel) -> None:
    assert ch.read_status() is None
    ch.status_path.write_text("{not json")
    assert ch.read_status() is None
    ch.status_path.write_text('{"last_seq": {"2": 41}}')
    assert ch.next_seq(2) == 42


def test_the_backlog_bound_neither_deletes_nor_counts_updates_the_applier_processed(tmp_path):
    """Files the applier applied but has not deleted yet (its status says so) are not pending:
    the bound keeps them, and exchange_backlog_dropped counts only real drops."""
    ch = Channel(tmp_path / "x", RUN, max_pending_per_group=2)
    w = {"w": np.ones(3, np.float32)}
    for seq in range(3):
        ch.publish_update(0, seq, 0, w)
    assert ch.dropped_backlog == 1 and sorted(r.seq for r in ch.pending_updates()) == [1, 2]
    # the applier has processed seq 1 and 2 (its commit), and deletes their files only after it
    files.atomic_write_bytes(ch.status_path, json.dumps({"last_seq": {"0": 2}}).encode())
    for seq in (3, 4):
        ch.publish_update(0, seq, 0, w)
    assert ch.dropped_backlog == 1, "processed files were counted as dropped"
    assert sorted(r.seq for r in ch.pending_updates()) == [1, 2, 3, 4]
    ch.publish_update(0, 5, 0, w)  # now three unprocessed: the oldest of them goes
    assert ch.dropped_backlog == 2 and [r.seq for r in ch.last_dropped] == [3]
    assert sorted(r.seq for r in ch.pending_updates()) == [1, 2, 4, 5]
