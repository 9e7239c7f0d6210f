"""The asynchronous exchange channel between group roots and the applier (parameter server).

numpy, the stdlib and cryptography (Poly1305). Tensors are ``dict[str, np.ndarray]``. Nothing
here imports TensorFlow.
The file format and its checks are :mod:`.format`, the directory protocol :mod:`.channel` (the
:class:`Channel`), the partition of the tensors over sharded appliers :mod:`.shards`, and the
group root's side (publish, adopt, wait) :mod:`.group`. This docstring is the protocol.

Roles
=====
* A **group root** (rank 0 of a synchronous Horovod group) publishes an *update* file every
  H = ``exchange.every`` steps (see the algorithms below) and adopts the newest *weights* file
  when one newer than its own copy exists. Publishing is a local write and a rename, reading the
  newest version a directory listing plus one file read; a root waits for the applier only when
  ``exchange.max_outstanding`` asks it to (:mod:`hpcdl.exchange.group`).
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
    root/applier/state.hx.1                     the state committed before it (recovery)
    root/applier/status.json                    small status summary, replaced atomically
    root/applier/events.jsonl                   append-only event log, one JSON object a line
    root/applier/rejected/                      files the applier refused, kept for inspection
    root/applier/lock                           flock()ed by the running applier

Every other name is ignored by readers; in particular temporaries ``.tmp-<uuid>-<final name>``.

Shards (``exchange.shards = K``)
================================
With K > 1 the run's exchange directory holds ``partition.json`` and K channels ``shard-<k>/``,
each laid out as above and served by its own applier with its own state, ledger, lock and
versions. :class:`hpcdl.exchange.shards.Partition` cuts the model's tensors, laid end to end in
model order, into K runs of about equal bytes, splitting a tensor between rows (the elements of
its leading axes; a row is its last axis) where a cut falls inside it (a piece is named
``<tensor>@<start>:<stop>`` in the files). A group root sends each shard its pieces of every
update under the same ``(group, seq)``, each tagged with the version of *that* shard its weights
came from, so staleness is measured per shard; it adopts each shard's newest version as it
appears and trains on the pieces joined. Every group root computes the partition from its
model and K and writes it to ``partition.json`` or checks it against the recorded one, so a
restart, a resume or an evaluation with another K or another model is refused rather than mixed;
the record is a check, never an instruction (JSON, no code). A record of format 1 (rows along the
first axis, before format 2) is checked against format 1's cut of the same model and K, and kept.
Each shard's exactly-once ledger, staleness bound and backlog bound act on its own: under
overload an update may be applied in some shards and dropped in others, as the paper's
per-layer servers took each layer's gradient on its own. With K = 1 the exchange directory is
the one channel and no partition is recorded.

Publishing (all writers, all file kinds; implemented once, in :mod:`hpcdl.fs.files`)
==================================================================================
1. write the complete file under ``.tmp-<uuid hex>-<final name>`` in the destination directory,
2. flush and ``fsync`` it,
3. ``os.replace`` it onto the final name (atomic on POSIX file systems, Lustre included),
4. ``fsync`` the directory.

Steps 2 and 4 (durability against a crash of the node, not of the process) are taken for the
files a restart depends on -- the applier's state (its ledger is the exactly-once record), the
weights versions and the initial proposals -- and skipped for update files and ``status.json``:
an update file torn by a node crash fails its tag and is rejected, which costs what a dropped
update costs, and the status is rewritten with every batch. Without an fsync each update costs
the group root and the applier no disk round trip.

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
    24      32    tag field over bytes [0, 24) + header + payload: a SHA-256 digest, or with a per-run
                  key a 16-byte nonce then a 16-byte Poly1305 tag (below)
    56      H     header: UTF-8 JSON object
    56+H    P     payload: raw little-endian tensor bytes (writers align each tensor to 64 bytes)

Header fields: ``run_id`` (str), ``kind`` ("update" | "weights" | "init" | "state"), ``tag_alg``
("sha256" | "poly1305" | "hmac-sha256"), ``created`` (unix time, float), ``group``, ``seq``,
``base_version``, ``version`` (int or null; which are required depends on the kind: update needs
group, seq, base_version; weights and state need version; init needs group), ``meta`` (a JSON
object for the writer's own use; the applier's state keeps its counters there), and ``tensors``: a list of
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
a keyed tag: Poly1305 (RFC 8439) under a one-time key HMAC-SHA256(key, label + nonce), where the
nonce is 16 random bytes drawn per file and kept in the tag field (a one-time authenticator must
never tag two messages under one key; 128-bit random nonces do not repeat). A keyed reader also
accepts ``hmac-sha256`` tags (HMAC-SHA256 under the key, the 32-byte field; what earlier versions
wrote), and refuses a file whose ``tag_alg`` is neither, in particular a keyless one (no
downgrade). A run's channels use the run's key (:func:`hpcdl.rundir.runkey.run_signer`),
so a file written without it -- by another user, another run, a stale process -- is rejected like
a corrupt one (the applier counts it under ``rejected_corrupt`` and moves it aside).

Permissions
===========
Directories and files get their modes from the Channel's :class:`hpcdl.fs.access.Access`, never from
the process umask: owner only by default (directories 0700, files 0600), group only when the job
names a unix group (2770 / 0660). A directory the channel creates gets the policy; an existing
subdirectory of ours that is looser is tightened; an existing root is left as it is (it may be
a directory the user chose) but a warning is logged when others can enter it.

Full disks and quotas
=====================
A publish that fails (ENOSPC, EDQUOT, any OSError) raises, and removes its temporary: no partial
file is ever visible under a final name and the previous files are untouched. What to do about it
is the caller's decision: the group root keeps the update in memory and retries at its next
exchange (:mod:`hpcdl.exchange.group`); the applier keeps its last committed state and retries.

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

from hpcdl.exchange.channel import (
    MAX_REJECTED, Channel, Update, UpdateRef, init_name, parse_update_name, update_name, weights_name,
)
from hpcdl.exchange.format import (
    ALIGN, ALLOWED_DTYPES, FORMAT_VERSION, KINDS, MAGIC, MAX_ELEMENTS, MAX_HEADER_BYTES, MAX_NAME_CHARS,
    MAX_NDIM, PREFIX_SIZE, CorruptFile, Signer, Tensors, read_file, write_file,
)

__all__ = [
    "ALIGN", "ALLOWED_DTYPES", "FORMAT_VERSION", "KINDS", "MAGIC", "MAX_ELEMENTS", "MAX_HEADER_BYTES",
    "MAX_NAME_CHARS", "MAX_NDIM", "MAX_REJECTED", "PREFIX_SIZE", "Channel", "CorruptFile",
    "Signer", "Tensors", "Update", "UpdateRef",
    "init_name", "parse_update_name", "read_file", "update_name", "weights_name", "write_file",
]
