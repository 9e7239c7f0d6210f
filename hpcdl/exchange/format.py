"""The exchange file format: encoding and validation of one file (published by hpcdl.fs.files).

The format and the reader's checks are specified in :mod:`hpcdl.exchange`'s docstring (the
protocol); this module is their one implementation. numpy, the stdlib and
cryptography's Poly1305.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import numpy as np

from cryptography.hazmat.primitives.poly1305 import Poly1305

from hpcdl.errors import HpcdlError
from hpcdl.fs.files import atomic_write
from hpcdl.fs.access import Access

MAGIC = b"HPCDLX\r\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQ32s")  # magic, format version, header length, payload length, tag
PREFIX_SIZE = _PREFIX.size  # 56
_SIGNED_PREFIX = 24  # bytes of the prefix covered by the tag (everything but the tag)
MAX_HEADER_BYTES = 1 << 20
ALIGN = 64
MAX_NAME_CHARS = 1024
MAX_NDIM = 32
MAX_ELEMENTS = 1 << 48  # bound on prod(max(d, 1)) of a shape: numpy can hold any such array
KINDS = ("update", "weights", "init", "state")
ALLOWED_DTYPES = frozenset(
    ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8",
     "<f2", "<f4", "<f8", "<c8", "<c16"]
)
_HEADER_KEYS = frozenset(
    ["run_id", "kind", "tag_alg", "created", "group", "seq", "base_version", "version", "meta",
     "tensors"]
)
_TENSOR_KEYS = frozenset(["name", "dtype", "shape", "offset", "nbytes"])
_REQUIRED = {
    "update": ("group", "seq", "base_version"),
    "weights": ("version",),
    "init": ("group",),
    "state": ("version",),
}
_CHUNK = 16 << 20
# Keyed tags a keyed reader checks: poly1305 is written; hmac-sha256 files (written before
# poly1305) stay readable, so a run started with them resumes. Both are keyed MACs: no downgrade.
_KEYED_TAGS = ("poly1305", "hmac-sha256")
_NONCE_BYTES = 16

Tensors = Mapping[str, np.ndarray]


class CorruptFile(HpcdlError, ValueError):
    """A file that failed validation; the message is a one-line reason."""


# --------------------------------------------------------------------------------------------
# tag
# --------------------------------------------------------------------------------------------


class Signer:
    """The tag of a file: SHA-256 when ``key`` is None, else a keyed MAC (``poly1305``).

    ``mac()`` starts the tag of a file being written; ``verifier(alg, field)`` the check of a
    file read. Both return an object with ``update(bytes)`` and ``field()``, the 32 bytes of the
    prefix's tag field.
    """

    def __init__(self, key: bytes | None = None):
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ValueError("an authentication key must be at least 16 bytes")
        self._key = key

    @property
    def alg(self) -> str:
        """The algorithm this signer writes."""
        return "sha256" if self._key is None else "poly1305"

    def accepts(self, alg: str) -> bool:
        """Whether a file tagged with ``alg`` can be checked: never a keyless tag under a key."""
        return alg == "sha256" if self._key is None else alg in _KEYED_TAGS

    def mac(self) -> "_Digest | _Poly1305":
        return self._tag(self.alg, None)

    def verifier(self, alg: str, field: bytes) -> "_Digest | _Poly1305":
        if not self.accepts(alg):
            raise ValueError(f"tag algorithm {alg!r} is not accepted by this signer")
        return self._tag(alg, field)

    def _tag(self, alg: str, field: bytes | None) -> "_Digest | _Poly1305":
        if alg == "sha256":
            return _Digest(hashlib.sha256())
        if alg == "hmac-sha256":
            return _Digest(hmac.new(self._key, digestmod=hashlib.sha256))
        return _Poly1305(self._key, os.urandom(_NONCE_BYTES) if field is None else field[:_NONCE_BYTES])


class _Digest:
    def __init__(self, h: Any):
        self._h = h

    def update(self, data: Any) -> None:
        self._h.update(data)

    def field(self) -> bytes:
        return self._h.digest()


class _Poly1305:
    """Poly1305 under a one-time key per file (derivation: :mod:`hpcdl.exchange`, "Integrity").

    Chosen over HMAC-SHA256 for speed on the applier's hot path, where it tags megabytes per
    update several times faster than SHA-256, even with SHA-NI (README, "Appliers and shards").
    """

    _LABEL = b"hpcdl exchange poly1305 key\0"

    def __init__(self, key: bytes, nonce: bytes):
        one_time = hmac.new(key, self._LABEL + nonce, hashlib.sha256).digest()
        self._nonce = nonce
        self._p = Poly1305(one_time)

    def update(self, data: Any) -> None:
        self._p.update(data)

    def field(self) -> bytes:
        return self._nonce + self._p.finalize()


# --------------------------------------------------------------------------------------------
# encoding / decoding
# --------------------------------------------------------------------------------------------


def _le_array(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"tensor {name!r}: dtype {arr.dtype} is not numeric")
    dt = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
    if dt.str not in ALLOWED_DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {arr.dtype} is not in the allow-list")
    return np.require(arr, dtype=dt, requirements="C")


def write_file(
    path: Path,
    *,
    run_id: str,
    kind: str,
    tensors: Tensors,
    signer: Signer | None = None,
    group: int | None = None,
    seq: int | None = None,
    base_version: int | None = None,
    version: int | None = None,
    meta: Mapping[str, Any] | None = None,
    fsync: bool = True,
    access: Access | None = None,
) -> Path:
    """Encode ``tensors`` in the exchange format and publish them atomically at ``path``."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    signer = signer or Signer()
    entries, arrays, payload_len = _layout(tensors)
    header = {
        "run_id": run_id, "kind": kind, "tag_alg": signer.alg, "created": time.time(),
        "group": group, "seq": seq, "base_version": base_version, "version": version,
        "meta": dict(meta or {}), "tensors": entries,
    }
    hbytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(hbytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(hbytes)} bytes exceeds {MAX_HEADER_BYTES}")
    signed = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(hbytes), payload_len, b"\0" * 32)
    signed = signed[:_SIGNED_PREFIX]

    def write(f: BinaryIO) -> None:
        h = signer.mac()
        f.write(signed)
        f.write(b"\0" * 32)  # tag placeholder
        h.update(signed)
        f.write(hbytes)
        h.update(hbytes)
        pos = 0
        for entry, arr in zip(entries, arrays):
            pad = entry["offset"] - pos
            if pad:
                f.write(b"\0" * pad)
                h.update(b"\0" * pad)
            data = memoryview(arr.reshape(-1).view(np.uint8))
            f.write(data)
            h.update(data)
            pos = entry["offset"] + entry["nbytes"]
        f.seek(_SIGNED_PREFIX)
        f.write(h.field())

    return atomic_write(path, write, fsync=fsync, access=access)


def _layout(tensors: Tensors) -> tuple[list[dict[str, Any]], list[np.ndarray], int]:
    """Each tensor's header entry (name, dtype, shape, its ALIGN-ed offset in the payload, bytes),
    its little-endian array, and the payload's length."""
    arrays: list[np.ndarray] = []
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"bad tensor name {name!r}")
        arr = _le_array(name, value)
        offset = -(-offset // ALIGN) * ALIGN
        entries.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape),
                        "offset": offset, "nbytes": arr.nbytes})
        arrays.append(arr)
        offset += arr.nbytes
    return entries, arrays, offset


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptFile(f"truncated while reading the {what}: got {len(data)} of {n} bytes")
    return data


def _is_int(x: Any) -> bool:
    return type(x) is int


def _parse_header(hbytes: bytes, payload_len: int) -> dict[str, Any]:
    try:
        header = json.loads(hbytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptFile(f"header is not UTF-8 JSON: {type(e).__name__}") from None
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        raise CorruptFile("header does not have exactly the expected fields")
    kind = header["kind"]
    if kind not in KINDS:
        raise CorruptFile(f"unknown kind {kind!r:.40}")
    if not isinstance(header["run_id"], str) or not isinstance(header["tag_alg"], str):
        raise CorruptFile("run_id / tag_alg must be strings")
    if not isinstance(header["created"], (int, float)) or not isinstance(header["meta"], dict):
        raise CorruptFile("created must be a number and meta an object")
    for key in ("group", "seq", "base_version", "version"):
        value = header[key]
        low = -1 if key == "base_version" else 0
        if value is not None and (not _is_int(value) or value < low):
            raise CorruptFile(f"{key} must be null or an int >= {low}")
    for key in _REQUIRED[kind]:
        if header[key] is None:
            raise CorruptFile(f"{kind} file without {key}")
    tensors = header["tensors"]
    if not isinstance(tensors, list):
        raise CorruptFile("tensors must be a list")
    names: set[str] = set()
    spans: list[tuple[int, int]] = []
    for t in tensors:
        if not isinstance(t, dict) or set(t) != _TENSOR_KEYS:
            raise CorruptFile("a tensor entry does not have exactly the expected fields")
        name, dtype, shape = t["name"], t["dtype"], t["shape"]
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise CorruptFile("bad tensor name")
        if name in names:
            raise CorruptFile(f"duplicate tensor name {name!r:.80}")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise CorruptFile(f"tensor {name!r:.80}: dtype {dtype!r:.20} not allowed")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(_is_int(d) and d >= 0 for d in shape)
                or math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS):
            raise CorruptFile(f"tensor {name!r:.80}: bad shape")
        offset, nbytes = t["offset"], t["nbytes"]
        if not (_is_int(offset) and _is_int(nbytes) and offset >= 0 and nbytes >= 0):
            raise CorruptFile(f"tensor {name!r:.80}: bad offset/nbytes")
        if math.prod(shape) * np.dtype(dtype).itemsize != nbytes:  # python ints: no overflow
            raise CorruptFile(f"tensor {name!r:.80}: nbytes does not match shape and dtype")
        if offset + nbytes > payload_len:
            raise CorruptFile(f"tensor {name!r:.80}: bytes [{offset}, {offset + nbytes}) "
                              f"outside the {payload_len}-byte payload")
        if nbytes:
            spans.append((offset, offset + nbytes))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise CorruptFile("tensor byte ranges overlap")
    return header


def read_file(
    path: Path,
    *,
    run_id: str | None,
    signer: Signer | None = None,
    kinds: tuple[str, ...] = KINDS,
    max_bytes: int | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read and fully validate one exchange file: returns (header, tensors).

    Raises CorruptFile on any validation failure and FileNotFoundError if the file is gone.
    Memory use is bounded by the actual file size (and MAX_HEADER_BYTES for the header).
    """
    signer = signer or Signer()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < PREFIX_SIZE:
            raise CorruptFile(f"truncated: {size} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
        prefix = _read_exact(f, PREFIX_SIZE, "prefix")
        magic, fmt, hlen, plen, tag = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise CorruptFile("bad magic: not an hpcdl exchange file")
        if fmt != FORMAT_VERSION:
            raise CorruptFile(f"unsupported format version {fmt}")
        if hlen > MAX_HEADER_BYTES:
            raise CorruptFile(f"header length {hlen} exceeds {MAX_HEADER_BYTES}")
        if PREFIX_SIZE + hlen + plen != size:
            raise CorruptFile(f"size mismatch: prefix declares {PREFIX_SIZE + hlen + plen} bytes, "
                              f"file has {size}")
        if max_bytes is not None and size > max_bytes:
            raise CorruptFile(f"file of {size} bytes exceeds the {max_bytes}-byte limit")
        hbytes = _read_exact(f, hlen, "header")
        header = _parse_header(hbytes, plen)
        _check_addressed(header, run_id, kinds, signer)
        payload = bytearray(plen)  # plen is checked against the real file size above
        view = memoryview(payload)
        pos = 0
        while pos < plen:
            n = f.readinto(view[pos:pos + _CHUNK])
            if not n:
                raise CorruptFile(f"truncated while reading the payload: got {pos} of {plen} bytes")
            pos += n
    h = signer.verifier(header["tag_alg"], tag)
    h.update(prefix[:_SIGNED_PREFIX])
    h.update(hbytes)
    h.update(payload)
    if not hmac.compare_digest(h.field(), tag):
        raise CorruptFile("checksum mismatch: tag does not match the content"
                          + (" (corrupt, or not written with this run's key)"
                             if signer.alg != "sha256" else ""))
    return header, {t["name"]: _tensor(payload, t) for t in header["tensors"]}


def _check_addressed(header: dict[str, Any], run_id: str | None, kinds: tuple[str, ...], signer: Signer) -> None:
    """The file is of a kind asked for, of this run, and signed the way this reader verifies."""
    if header["kind"] not in kinds:
        raise CorruptFile(f"kind {header['kind']!r}, expected one of {kinds}")
    if run_id is not None and header["run_id"] != run_id:
        raise CorruptFile(f"run id {header['run_id']!r:.80} does not match {run_id!r}")
    if not signer.accepts(header["tag_alg"]):
        raise CorruptFile(f"tag algorithm {header['tag_alg']!r:.20}, expected {signer.alg!r}")


def _tensor(payload: bytearray, t: dict[str, Any]) -> np.ndarray:
    """One validated entry's array over the payload, copied only to native order and alignment."""
    dt = np.dtype(t["dtype"])
    count = t["nbytes"] // dt.itemsize
    try:
        arr = np.frombuffer(payload, dtype=dt, count=count, offset=t["offset"]) if count else (
            np.empty(0, dtype=dt))
        arr = arr.reshape(t["shape"])
    except (ValueError, OverflowError) as e:  # a backstop: validation should prevent it
        raise CorruptFile(f"tensor {t['name']!r:.80}: {type(e).__name__}: {e}") from None
    if not dt.isnative or t["offset"] % dt.alignment:
        arr = arr.astype(dt.newbyteorder("="))  # copies: native order, aligned
    return arr
