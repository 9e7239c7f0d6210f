"""The asynchronous exchange channel between group roots and the applier (parameter server).

Pure numpy + stdlib. Tensors are ``dict[str, np.ndarray]``. Nothing here imports TensorFlow.

Roles
=====
* A **group root** (rank 0 of a synchronous Horovod group) publishes an *update* file every
  H = ``exchange.every`` steps (see the algorithms below) and adopts the newest *weights* file
  when one newer than its own copy exists. Publishing is a local write and a rename, reading the
  newest version a directory listing plus one file read; a root waits for the applier only when
  ``exchange.max_outstanding`` asks it to (:mod:`hpcdl.hybrid`).
* The **applier** (:mod:`hpcdl.applier`) keeps the master weights, applies updates in arrival
  order with its update rule (:mod:`hpcdl.applier.rules`) and publishes new weight versions. It
  alone deletes applied updates and old versions.

Algorithms (``exchange.kind``)
==============================
Both use the same files; they differ in what an update holds and in the applier's rule.

* ``gradient`` -- the paper's (Kurth et al. 2017, after Dean et al.'s Downpour SGD): an update is
  the mean of the group-averaged gradients of the last H steps; the applier takes one optimizer
  step per update (``exchange.optimizer``, Adam by default). With ``staleness_scaling`` the step
  is taken at ``lr / max(1, staleness)`` (Zhang et al. 2016, "Staleness-aware Async-SGD"). With
  ``max_outstanding = 1`` each root waits for its update's answer before training on, as the
  paper's Intel Caffe parameter server made each group root block on its reply: staleness is then
  about G − 1 for G groups.
* ``delta`` -- local SGD with an outer optimizer (DiLoCo, Douillard et al. 2023; its asynchronous
  form, Liu et al. 2024): a group runs H local steps with its inner optimizer, publishes the
  pseudo-gradient ``θ_base − θ_local`` (float32, or float16 with ``delta_dtype``, which OpenDiLoCo
  reports costs nothing in accuracy), and continues from the newest master weights with its
  inner optimizer's slots untouched; ``θ_base`` becomes the weights it continues from. The
  applier treats each delta as a gradient for its outer rule: ``nesterov`` with momentum delayed
  over N = G arrivals (Liu et al.'s remedy for the momentum that stale arrivals amplify;
  Mitliagkas et al. 2016) is the asynchronous counterpart of synchronous DiLoCo's outer Nesterov
  step over G workers; ``sgd`` at lr 1/G is asynchronous model averaging.

In both, the staleness of an update is the number of master versions applied between the
version its group's weights came from (``base_version``) and its own application.

Directory layout (owned by :class:`Channel`; ``root`` is one run's exchange directory)
=======================================================================================
::

    root/updates/u-g<group:06>-s<seq:012>.hx   one update of one group (kind "update")
    root/weights/w-v<version:012>.hx            master weights version N (kind "weights")
    root/init/i-g<group:06>.hx                  a group's proposal of initial weights ("init")
    root/applier/state.hx                       the applier's durable state (kind "state")
    root/applier/status.json                    small status summary, replaced atomically
    root/applier/events.jsonl                   append-only event log, one JSON object a line
    root/applier/rejected/                      files the applier refused, kept for inspection
    root/applier/lock                           flock()ed by the running applier

Every other name is ignored by readers; in particular temporaries ``.tmp-<uuid>-<final name>``.

Publishing (all writers, all file kinds)
========================================
1. write the complete file under ``.tmp-<uuid hex>-<final name>`` in the destination directory,
2. flush and ``fsync`` it,
3. ``os.replace`` it onto the final name (atomic on POSIX file systems, Lustre included),
4. ``fsync`` the directory.

Readers therefore see either no file or a complete one. Published files are never modified,
only deleted (applied updates by the applier; old weight versions beyond the newest K). A writer
killed between 1 and 3 leaves a temporary that no reader lists; :meth:`Channel.clean_stale_temporaries`
removes temporaries older than a bound (the applier calls it periodically).

File format (version 1), all integers little-endian
====================================================
::

    offset  size  field
    0       8     magic  b"HPCDLX\\r\\n"
    8       4     u32 format version (1)
    12      4     u32 header length H   (H <= MAX_HEADER_BYTES = 1 MiB)
    16      8     u64 payload length P  (56 + H + P must equal the file size)
    24      32    tag: SHA-256, or HMAC-SHA256 with a per-run key, over bytes [0, 24) + header + payload
    56      H     header: UTF-8 JSON object
    56+H    P     payload: raw little-endian tensor bytes (writers align each tensor to 64 bytes)

Header fields: ``run_id`` (str), ``kind`` ("update" | "weights" | "init" | "state"), ``tag_alg``
("sha256" | "hmac-sha256"), ``created`` (unix time, float), ``group``, ``seq``, ``base_version``,
``version`` (int or null; which are required depends on the kind: update needs group, seq,
base_version; weights and state need version; init needs group), ``meta`` (a JSON object for the
writer's own use; the applier's state keeps its counters there), and ``tensors``: a list of
``{"name", "dtype", "shape", "offset", "nbytes"}`` with offsets relative to the payload start.

Only numeric dtypes are allowed, written as little-endian numpy dtype strings: ``|b1``, ``|i1``,
``|u1``, ``<i2`` ``<u2`` ``<i4`` ``<u4`` ``<i8`` ``<u8``, ``<f2`` ``<f4`` ``<f8``, ``<c8`` ``<c16``.
Nothing in a file is ever executed: no pickle anywhere (a pickle placed under a valid name fails
the magic check).

Validation by the reader, in this order, each failure raising :class:`CorruptFile` (a
``ValueError``) with a one-line reason: file size at least the 56-byte prefix; magic; format
version; header length bound; 56 + H + P equals the actual file size (so no allocation is ever
sized from a lying header: the payload buffer is the real file's remaining size); header is UTF-8
JSON with exactly the expected fields and types; names unique; dtypes in the allow-list; shapes are
lists of at most 32 non-negative ints whose product (zeros counted as ones) is at most 2**48, so
that numpy can hold them; ``nbytes`` equals prod(shape) * itemsize; every ``[offset, offset +
nbytes)`` lies inside the payload and no two overlap; run id matches; the tag matches (constant-time
comparison). For updates, weights and proposals the header's group / seq / version must also match
the file name. A caller that knows how large a file can legitimately be passes ``max_bytes``
(the applier does, for updates: see :mod:`hpcdl.applier`), checked before anything is read.

Integrity versus authenticity: with ``Signer(key=None)`` the tag is a plain SHA-256 (it detects
corruption, not forgery). ``Signer(key=b"...")`` switches every writer and reader of a Channel to
HMAC-SHA256 with that key; a reader refuses a file whose ``tag_alg`` differs from its own
signer's (no downgrade). A run's channels use the run's key (:func:`hpcdl.runkey.run_signer`),
so a file written without it -- by another user, another run, a stale process -- is rejected like
a corrupt one (the applier counts it under ``rejected_corrupt`` and moves it aside).

Permissions
===========
Directories and files get their modes from the Channel's :class:`hpcdl.runkey.Access`, never from
the process umask: owner only by default (directories 0700, files 0600), group only when the job
names a unix group (2770 / 0660). A directory the channel creates gets the policy; an existing
subdirectory of ours that is looser is tightened; an existing root is left as it is (it may be
a directory the user chose) but a warning is logged when others can enter it.

Full disks and quotas
=====================
A publish that fails (ENOSPC, EDQUOT, any OSError) raises, and removes its temporary: no partial
file is ever visible under a final name and the previous files are untouched. What to do about it
is the caller's decision: the group root keeps the update in memory and retries at its next
exchange (:mod:`hpcdl.hybrid`); the applier keeps its last committed state and retries.

Arrival order
=============
:meth:`Channel.pending_updates` orders update files by (mtime_ns, name): the mtime of a published
file is the time its writer finished writing it. Different nodes' clocks may differ; that only
perturbs the order *between* groups. A group's own updates are always listed in ``seq`` order.

Backlog bound (the applier may be slow or down; groups never stall)
===================================================================
With ``max_pending_per_group=N``, :meth:`Channel.publish_update` publishes the new update and then
deletes this group's *oldest* pending updates until at most N remain; updates the applier reports
processed (``status.json``'s ``last_seq``) are not pending, even while their files remain. The newest gradients are the
most useful when the applier catches up, and the directory stays bounded at N files a group with
no applier at all. Deleting a file the applier is reading is harmless: an open file stays readable,
and a file that vanished before it was opened is skipped (counted as ``vanished``).

Sequence numbers
================
``(group, seq)`` identifies an update for the whole run: the applier's ledger treats a repeated
pair as a duplicate and deletes it unapplied. A group root that restarts (e.g. a requeued job
restored from a checkpoint) must not reuse numbers: :meth:`Channel.next_seq` returns one past the
highest seq that the applier reports as processed or that is still pending.

Initial weights
===============
Each group root calls :meth:`Channel.propose_initial` (or :meth:`Channel.initial_weights`, which
also waits a bounded time). If no master version exists, the proposal is published; the applier
adopts the first proposal it sees as version 0 and deletes the others, so every group that then
reads version 0 starts from identical weights. A group whose wait times out trains on its own
weights (its updates then carry ``base_version = -1``).

Disk use
========
Applied update files are deleted by the applier; weight versions beyond the newest K are deleted
(:meth:`Channel.prune_weights`); the rejected directory keeps at most ``MAX_REJECTED`` files. A
reader that loses a race with deletion (``FileNotFoundError``) retries with the newest version
(:meth:`Channel.read_latest_weights`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import re
import shutil
import struct
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

import numpy as np

from hpcdl.runkey import Access

log = logging.getLogger("hpcdl.exchange")

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
MAX_REJECTED = 100
TMP_PREFIX = ".tmp-"
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
_UPDATE_RE = re.compile(r"^u-g(\d{1,9})-s(\d{1,18})\.hx$")
_WEIGHTS_RE = re.compile(r"^w-v(\d{1,18})\.hx$")
_INIT_RE = re.compile(r"^i-g(\d{1,9})\.hx$")
_CHUNK = 16 << 20

Tensors = Mapping[str, np.ndarray]


class CorruptFile(ValueError):
    """A file that failed validation; the message is a one-line reason."""


# --------------------------------------------------------------------------------------------
# tag
# --------------------------------------------------------------------------------------------


class Signer:
    """Computes the 32-byte tag of a file: SHA-256 when ``key`` is None, else HMAC-SHA256(key)."""

    def __init__(self, key: bytes | None = None):
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ValueError("an HMAC key must be at least 16 bytes")
        self._key = key

    @property
    def alg(self) -> str:
        return "sha256" if self._key is None else "hmac-sha256"

    def new(self) -> Any:
        """A fresh hashing object with ``update(bytes)`` and ``digest()``."""
        if self._key is None:
            return hashlib.sha256()
        return hmac.new(self._key, digestmod=hashlib.sha256)


# --------------------------------------------------------------------------------------------
# atomic publishing
# --------------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it is durable (ignored where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, fsync: bool = True,
                 access: Access | None = None) -> Path:
    """Publish ``path`` atomically: temporary in the same directory, fsync, rename, fsync dir.

    The file gets ``access``'s mode (owner-only 0600 by default) whatever the umask. On any error
    (ENOSPC, EDQUOT, ...) the temporary is removed and the error raised: ``path`` keeps its
    previous content, if any.
    """
    path = Path(path)
    access = access or Access()
    tmp = path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.name}"
    try:
        with os.fdopen(access.open_new(tmp), "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True,
                       access: Access | None = None) -> Path:
    return atomic_write(path, lambda f: f.write(data), fsync=fsync, access=access)


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
    payload_len = offset
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
        h = signer.new()
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
        f.write(h.digest())

    return atomic_write(path, write, fsync=fsync, access=access)


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
        if header["kind"] not in kinds:
            raise CorruptFile(f"kind {header['kind']!r}, expected one of {kinds}")
        if run_id is not None and header["run_id"] != run_id:
            raise CorruptFile(f"run id {header['run_id']!r:.80} does not match {run_id!r}")
        if header["tag_alg"] != signer.alg:
            raise CorruptFile(f"tag algorithm {header['tag_alg']!r:.20}, expected {signer.alg!r}")
        payload = bytearray(plen)  # plen is checked against the real file size above
        view = memoryview(payload)
        pos = 0
        while pos < plen:
            n = f.readinto(view[pos:pos + _CHUNK])
            if not n:
                raise CorruptFile(f"truncated while reading the payload: got {pos} of {plen} bytes")
            pos += n
    h = signer.new()
    h.update(prefix[:_SIGNED_PREFIX])
    h.update(hbytes)
    h.update(payload)
    if not hmac.compare_digest(h.digest(), tag):
        raise CorruptFile("checksum mismatch: tag does not match the content"
                          + (" (corrupt, or not written with this run's key)"
                             if signer.alg != "sha256" else ""))
    tensors: dict[str, np.ndarray] = {}
    for t in header["tensors"]:
        dt = np.dtype(t["dtype"])
        count = t["nbytes"] // dt.itemsize
        try:
            arr = np.frombuffer(payload, dtype=dt, count=count, offset=t["offset"]) if count else (
                np.empty(0, dtype=dt))
            arr = arr.reshape(t["shape"])
        except (ValueError, OverflowError) as e:  # a backstop: validation should prevent it
            raise CorruptFile(f"tensor {t['name']!r:.80}: {type(e).__name__}: {e}") from None
        native = dt.newbyteorder("=")
        if not dt.isnative or t["offset"] % dt.alignment:
            arr = arr.astype(native)  # copies: native order, aligned
        tensors[t["name"]] = arr
    return header, tensors


# --------------------------------------------------------------------------------------------
# channel
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UpdateRef:
    """A pending update file, as listed (nothing read yet)."""

    group: int
    seq: int
    path: Path
    mtime_ns: int

    @property
    def name(self) -> str:
        return self.path.name


@dataclasses.dataclass
class Update:
    group: int
    seq: int
    base_version: int
    tensors: dict[str, np.ndarray]
    path: Path
    created: float = 0.0


def update_name(group: int, seq: int) -> str:
    return f"u-g{group:06d}-s{seq:012d}.hx"


def weights_name(version: int) -> str:
    return f"w-v{version:012d}.hx"


def init_name(group: int) -> str:
    return f"i-g{group:06d}.hx"


def parse_update_name(name: str) -> tuple[int, int] | None:
    m = _UPDATE_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_nonneg(**kw: int) -> None:
    for k, v in kw.items():
        if not _is_int(v) or v < 0:
            raise ValueError(f"{k} must be an int >= 0, got {v!r}")


class Channel:
    """One run's exchange directory: layout, publishing and reading (see the module docstring).

    ``max_pending_per_group``: when set, publish_update keeps at most this many pending updates of
    the publishing group, deleting that group's oldest ones. ``signer``: the tag (plain SHA-256 by
    default; a run's channels pass :func:`hpcdl.runkey.run_signer`). ``access``: modes of the
    directories and files (owner only by default). ``fsync=False`` skips fsyncs (tests, local
    scratch); publishing stays atomic.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str,
        create: bool = True,
        *,
        max_pending_per_group: int | None = None,
        signer: Signer | None = None,
        fsync: bool = True,
        stripe: bool = True,
        access: Access | None = None,
    ):
        if not isinstance(run_id, str) or not run_id or len(run_id) > 256:
            raise ValueError("run_id must be a non-empty string of at most 256 characters")
        if max_pending_per_group is not None and max_pending_per_group < 1:
            raise ValueError("max_pending_per_group must be >= 1 or None")
        self.root = Path(root)
        self.run_id = run_id
        self.signer = signer or Signer()
        self.access = access or Access()
        self.fsync = fsync
        self.max_pending_per_group = max_pending_per_group
        self.dropped_backlog = 0  # updates this process deleted to keep the backlog bound
        self.last_dropped: list[UpdateRef] = []  # those the last publish_update deleted
        self.updates_dir = self.root / "updates"
        self.weights_dir = self.root / "weights"
        self.init_dir = self.root / "init"
        self.applier_dir = self.root / "applier"
        self.rejected_dir = self.applier_dir / "rejected"
        self.state_path = self.applier_dir / "state.hx"
        self.status_path = self.applier_dir / "status.json"
        self.events_path = self.applier_dir / "events.jsonl"
        self.lock_path = self.applier_dir / "lock"
        dirs = (self.updates_dir, self.weights_dir, self.init_dir, self.applier_dir,
                self.rejected_dir)
        if create:
            new_updates = not self.updates_dir.exists()
            if not self.access.make_dir(self.root, tighten=False):
                _warn_if_open(self.root)
            for d in dirs:
                self.access.make_dir(d)
            if new_updates and stripe:
                _stripe_small_files(self.updates_dir)
        elif not all(d.is_dir() for d in dirs):
            raise FileNotFoundError(f"{self.root} is not an exchange directory")

    # -- internal ------------------------------------------------------------------------------

    def _write(self, path: Path, kind: str, tensors: Tensors, **fields: Any) -> Path:
        return write_file(path, run_id=self.run_id, kind=kind, tensors=tensors,
                          signer=self.signer, fsync=self.fsync, access=self.access, **fields)

    def _read(self, path: Path, kind: str, max_bytes: int | None = None
              ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return read_file(path, run_id=self.run_id, signer=self.signer, kinds=(kind,),
                         max_bytes=max_bytes)

    @staticmethod
    def _listing(directory: Path, pattern: re.Pattern[str]) -> list[tuple[os.DirEntry, re.Match]]:
        out = []
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    m = pattern.match(entry.name)
                    if m:
                        out.append((entry, m))
        except FileNotFoundError:
            pass
        return out

    # -- updates -------------------------------------------------------------------------------

    def publish_update(self, group: int, seq: int, base_version: int, tensors: Tensors) -> Path:
        """Publish one update; then enforce ``max_pending_per_group`` for this group."""
        _check_nonneg(group=group, seq=seq)
        if not _is_int(base_version) or base_version < -1:
            raise ValueError("base_version must be an int >= -1 (-1: not from a master version)")
        path = self._write(self.updates_dir / update_name(group, seq), "update", tensors,
                           group=group, seq=seq, base_version=base_version)
        self.last_dropped = []
        if self.max_pending_per_group is not None:
            # Files the applier has processed are still listed until it deletes them after its
            # commit: they are neither pending nor ours to delete (nor to count as dropped).
            answered = self.answered_seq(group)
            mine = sorted((r for r in self.pending_updates() if r.group == group and r.seq > answered),
                          key=lambda r: r.seq)
            for ref in mine[:max(0, len(mine) - self.max_pending_per_group)]:
                try:
                    os.unlink(ref.path)
                except FileNotFoundError:
                    continue  # the applier got it first
                self.dropped_backlog += 1
                self.last_dropped.append(ref)
                log.info("backlog bound %d: dropped pending update group %d seq %d",
                         self.max_pending_per_group, ref.group, ref.seq)
        return path

    def pending_updates(self) -> list[UpdateRef]:
        """Update files in arrival order ((mtime_ns, name)); each group's own in seq order."""
        refs = []
        for entry, m in self._listing(self.updates_dir, _UPDATE_RE):
            try:
                mtime = entry.stat().st_mtime_ns
            except FileNotFoundError:
                continue
            refs.append(UpdateRef(int(m.group(1)), int(m.group(2)), Path(entry.path), mtime))
        refs.sort(key=lambda r: (r.mtime_ns, r.name))
        # Keep the arrival slots, but give each group's slots to its updates in seq order.
        by_group: dict[int, list[UpdateRef]] = {}
        for r in refs:
            by_group.setdefault(r.group, []).append(r)
        queues = {g: iter(sorted(rs, key=lambda r: r.seq)) for g, rs in by_group.items()}
        return [next(queues[r.group]) for r in refs]

    def backlog(self, group: int | None = None) -> int:
        """Number of pending (unapplied) updates, of all groups or of one."""
        if group is None:
            return len(self._listing(self.updates_dir, _UPDATE_RE))
        return sum(1 for _, m in self._listing(self.updates_dir, _UPDATE_RE)
                   if int(m.group(1)) == group)

    def read_update(self, ref: UpdateRef | Path, max_bytes: int | None = None) -> Update:
        """Read and validate one update; ``max_bytes`` refuses larger files before reading."""
        path = ref.path if isinstance(ref, UpdateRef) else Path(ref)
        header, tensors = self._read(path, "update", max_bytes)
        if parse_update_name(path.name) != (header["group"], header["seq"]):
            raise CorruptFile("file name does not match the header's group/seq")
        return Update(header["group"], header["seq"], header["base_version"], tensors, path,
                      header["created"])

    def answered_seq(self, group: int) -> int:
        """The newest seq of ``group`` that the applier reports processed (-1: none)."""
        last = (self.read_status() or {}).get("last_seq", {})
        seq = last.get(str(group), -1) if isinstance(last, dict) else -1
        return seq if _is_int(seq) else -1

    def next_seq(self, group: int) -> int:
        """One past the highest seq of ``group`` that is pending or reported processed."""
        best = -1
        for _, m in self._listing(self.updates_dir, _UPDATE_RE):
            if int(m.group(1)) == group:
                best = max(best, int(m.group(2)))
        return max(best, self.answered_seq(group)) + 1

    # -- weights -------------------------------------------------------------------------------

    def publish_weights(self, version: int, tensors: Tensors) -> Path:
        _check_nonneg(version=version)
        return self._write(self.weights_dir / weights_name(version), "weights", tensors,
                           version=version)

    def weight_versions(self) -> list[int]:
        return sorted(int(m.group(1)) for _, m in self._listing(self.weights_dir, _WEIGHTS_RE))

    def latest_weights_version(self) -> int | None:
        """Newest published master version, from a directory listing only (no file read)."""
        versions = self.weight_versions()
        return versions[-1] if versions else None

    def read_weights(self, version: int) -> tuple[int, dict[str, np.ndarray]]:
        """Read one version; FileNotFoundError if it was pruned meanwhile."""
        header, tensors = self._read(self.weights_dir / weights_name(version), "weights")
        if header["version"] != version:
            raise CorruptFile("file name does not match the header's version")
        return version, tensors

    def read_latest_weights(self, retries: int = 5) -> tuple[int, dict[str, np.ndarray]] | None:
        """Newest master weights, or None if none exist; retries when a prune wins the race."""
        for _ in range(retries + 1):
            version = self.latest_weights_version()
            if version is None:
                return None
            try:
                return self.read_weights(version)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"weights kept vanishing while reading {self.weights_dir}")

    def prune_weights(self, keep: int) -> int:
        """Delete all but the newest ``keep`` weight versions; returns how many were deleted."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        removed = 0
        for version in self.weight_versions()[:-keep]:
            try:
                os.unlink(self.weights_dir / weights_name(version))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    # -- initial weights -----------------------------------------------------------------------

    def propose_initial(self, group: int, tensors: Tensors) -> Path | None:
        """Propose initial weights unless a master version exists; returns the proposal path."""
        _check_nonneg(group=group)
        if self.latest_weights_version() is not None:
            return None
        return self._write(self.init_dir / init_name(group), "init", tensors, group=group)

    def initial_weights(
        self, group: int, tensors: Tensors, timeout: float = 60.0, poll: float = 0.2
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """Propose ``tensors`` and wait up to ``timeout`` s for the master's first version.

        Returns (version, master tensors), or None on timeout: the caller keeps its own tensors
        (the applier may be down; groups never stall on it for longer than ``timeout``).
        """
        self.propose_initial(group, tensors)
        deadline = time.monotonic() + timeout
        while True:
            latest = self.read_latest_weights()
            if latest is not None:
                return latest
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll)

    def pending_proposals(self) -> list[Path]:
        """Initial-weight proposals in arrival order."""
        found = []
        for entry, _ in self._listing(self.init_dir, _INIT_RE):
            try:
                found.append((entry.stat().st_mtime_ns, entry.name, Path(entry.path)))
            except FileNotFoundError:
                continue
        return [p for _, _, p in sorted(found)]

    def read_proposal(self, path: Path) -> tuple[int, dict[str, np.ndarray]]:
        header, tensors = self._read(path, "init")
        m = _INIT_RE.match(path.name)
        if not m or int(m.group(1)) != header["group"]:
            raise CorruptFile("file name does not match the header's group")
        return header["group"], tensors

    # -- housekeeping --------------------------------------------------------------------------

    def clean_stale_temporaries(self, older_than_s: float, *, dirs: list[Path] | None = None
                                ) -> int:
        """Delete temporaries (``.tmp-*``) whose mtime is older than ``older_than_s`` seconds."""
        cutoff = time.time() - older_than_s
        removed = 0
        for d in dirs or [self.updates_dir, self.weights_dir, self.init_dir, self.applier_dir]:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not entry.name.startswith(TMP_PREFIX):
                    continue
                try:
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                        log.info("removed stale temporary %s", entry.path)
                except FileNotFoundError:
                    pass
        return removed

    def quarantine(self, path: Path) -> Path | None:
        """Move a refused file into ``applier/rejected/`` (keeping at most MAX_REJECTED)."""
        dest = self.rejected_dir / f"{time.time_ns()}-{path.name}"
        try:
            os.replace(path, dest)
        except FileNotFoundError:
            return None
        kept = sorted(os.listdir(self.rejected_dir))
        for name in kept[:max(0, len(kept) - MAX_REJECTED)]:
            try:
                os.unlink(self.rejected_dir / name)
            except OSError:
                pass
        return dest

    def read_status(self) -> dict[str, Any] | None:
        """The applier's status.json, or None if absent or unreadable."""
        try:
            with open(self.status_path, "rb") as f:
                data = f.read(MAX_HEADER_BYTES + 1)
            status = json.loads(data.decode("utf-8"))
        except (OSError, ValueError):
            return None
        return status if isinstance(status, dict) else None


def _warn_if_open(root: Path) -> None:
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return
    if mode & 0o007:
        log.warning("exchange directory %s has mode %04o: other users can enter it (the files "
                    "in it are owner-only and authenticated, but consider chmod o-rwx)",
                    root, mode & 0o7777)


def _stripe_small_files(directory: Path) -> None:
    """On Lustre, give the updates directory a stripe count of 1 (many small files)."""
    lfs = shutil.which("lfs")
    if lfs is None:
        return
    try:
        subprocess.run([lfs, "setstripe", "-c", "1", str(directory)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        log.info("lfs setstripe -c 1 %s failed (ignored): %s", directory, e)
