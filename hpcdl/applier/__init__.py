"""The applier: the parameter-server role of the hybrid scheme (Kurth et al., SC17).

A process of its own (``python -m hpcdl.process.worker RUN --applier``): numpy, its compiled update
kernels (numba, :mod:`hpcdl.applier.kernels`) and the stdlib, no TensorFlow. It keeps
the master weights and its own optimizer, applies each group's update (the group-averaged
gradient published by the group root through :class:`hpcdl.exchange.Channel`) in arrival order,
and publishes new master weight versions. Groups wait for it only as the exchange's
``max_outstanding`` asks, and at most ``reply_timeout_s``.

Versions and staleness
======================
The master version is the number of updates applied since version 0 (the adopted initial
weights). A batch of updates is applied one by one (each increments the version) and then
committed once; the weights of the batch's last version are published, so published versions may
skip numbers. The staleness of an update is ``master version at apply time - base_version``, where
``base_version`` is the master version the group's weights came from (-1: the group trains on its
own weights). It is recorded for every update (events.jsonl, status.json). With
``max_staleness=S``, an update with staleness > S is dropped (``stale_policy="drop"``: counted,
logged, deleted unapplied) or applied with learning rate ``lr / (1 + staleness)``
(``stale_policy="downweight"``). Updates of any staleness are applied when ``max_staleness`` is
None.

Update rules
============
``optimizer`` names one of :data:`hpcdl.applier.rules.UPDATE_RULES` (sgd, momentum, adam,
nesterov; their formulas are in that module). With ``staleness_scaling`` every update is applied
at ``lr / max(1, staleness)`` (Zhang et al., "Staleness-aware Async-SGD"), before and
independently of the ``max_staleness`` policy.

Slots have the master's dtype. An update must carry exactly the master's tensor names and shapes
and finite values, otherwise it is rejected (``rejected_invalid``).

Durable state and exactly-once
==============================
Everything the applier knows lives in ONE file, ``applier/state.hx`` (exchange format, kind
"state"), published atomically (temporary, fsync, rename, fsync dir): master weights, optimizer
slots and step, version, the ledger of processed (group, seq) pairs (per-group intervals), the
counters (applied, dropped_stale, downweighted, rejected_corrupt, rejected_invalid, duplicates,
vanished, rejected_proposals), staleness statistics, the event counter, and ``last_batch``: the
events of the last committed batch and the files it must delete or move aside.

One batch: (1) list pending updates, (2) read/validate/apply up to ``max_batch`` of them in
memory, (3) COMMIT: write state.hx, (4) publish weights of the new version and prune old
versions, (5) append the batch's events to events.jsonl, (6) write status.json, (7) delete the
applied/dropped/duplicate update files, move rejected files to ``applier/rejected/``.

Crash points (kill -9 anywhere; on restart the newest state.hx is loaded first):
* before or during (3): the old state.hx is intact (a half-written temporary is removed on
  restart); no update file was deleted, so the whole batch is applied again from the old state:
  none lost, none applied twice.
* after (3), before or during (4): restart sees the newest published version < state version and
  republishes the weights; stale versions are pruned at the next publish.
* after (4), before or during (5): restart reads the last event id in events.jsonl and appends
  the events of ``last_batch`` that are missing (a torn last line is terminated first and skipped
  by readers), so every event is logged once.
* after (5), before or during (7): restart redoes (6) and (7) from ``last_batch`` (deleting or
  moving a file twice is harmless). Independently, any pending update whose (group, seq) is in the
  ledger is deleted without being applied (counted as ``duplicates``; this also covers a publisher
  that republished a pair).
Damage after a commit (a disk, a careless hand): each commit first renames the committed state
to ``state.hx.1``, so the last two generations are kept, each tagged. A start that finds
``state.hx`` damaged (its tag, its size) or missing takes ``state.hx.1`` and brings it forward by
the events logged after it -- the ledger, the counters and the version follow them, the master
is the weights version they reach (published before the events were logged), the rule's slots
stay the older generation's -- commits that at once, moves the damaged file to
``applier/rejected/`` and says so in its log and in status.json (``recovered``); an update the
lost generation had processed whose file is still pending is a duplicate, never applied twice.
With no usable generation (both damaged, or the events log does not reach back to the older
one) the applier raises ``StateLost``: ``python -m hpcdl.process.worker RUN --applier`` prints it as one
line, writes status.json with ``phase`` "failed" and ``error``, and exits ``EXIT_USER_ERROR``,
which no restart retries and the run's exit status reports.

Only one applier may run per exchange directory: it holds an exclusive ``flock`` on
``applier/lock`` (released by the kernel on kill -9). Where the file system has no flock (Lustre
mounted without ``-o flock``), a warning is logged and single-instance is the operator's job.

Bad input never stops the applier: a corrupt file (CorruptFile: bad checksum, truncated, lying
header, not our format, wrong run id, ...) or an entry it cannot read at all (a directory, no
permission) is counted as ``rejected_corrupt``, logged and moved aside; a well-formed update that does not fit the master is ``rejected_invalid``. An update file
deleted by its publisher before it was read (backlog bound) is counted as ``vanished``. I/O errors
on the exchange directory itself (OSError) make :meth:`Applier.run` reload the durable state and
retry with backoff; it does not process anything until that reload has succeeded.

Authentication: the applier reads and writes with its channel's signer. A run's applier
(``python -m hpcdl.process.worker RUN --applier``) uses the run's key, so an update, proposal or state
written without it (missing tag, plain SHA-256 tag, or a keyed tag under another key) is rejected as
``rejected_corrupt`` with a reason that says so, logged and moved aside like any corrupt file.
An update file larger than the master's tensors can need (every element as 8 bytes, plus the
largest header) is refused before it is read, so a huge file cannot make the applier allocate
its size.

Full disk and quota: a commit that fails (ENOSPC/EDQUOT while writing the state, the weights, the
events or the status) changes nothing durable: the state and the weights are published through
temporaries, a partly appended events line is cut off again, and the update files stay pending.
The applier records the problem in ``applier/storage.json`` (a fixed-size file rewritten in
place; ``hpcdl status`` shows it), reloads its state and retries with backoff; groups keep
training. The next successful commit clears the problem.

Initial weights
===============
Order of precedence at start: state.hx; else the newest published weights (state lost: adopted
with fresh optimizer slots, a warning); else ``initial`` passed to the constructor (version 0);
else the applier waits for proposals in ``init/`` and adopts the first valid one (arrival order)
as version 0, deleting the others.

Status for humans and tools
===========================
``applier/storage.json``: storage problems (see :mod:`hpcdl.fs.storage`).
``applier/events.jsonl``: one JSON object a line (rotated to ``events.jsonl.1`` past
``events_max_bytes``; readers skip a line that does not parse, e.g. one torn by a crash): ``event_id``, ``time``, ``event`` (applied |
dropped | rejected | duplicate | vanished | init | adopted), ``group``, ``seq``, ``base_version``,
``staleness``, ``version``, ``scale``, ``reason``, ``file`` (those that apply).
``applier/status.json`` (replaced atomically at each commit and every ``status_interval`` s when
idle): ``phase``, ``master_version``, ``counts``, ``backlog``, ``staleness`` {count, mean, max}, ``groups`` {group: {updates, staleness_mean, staleness_max}},
``last_apply_time``, ``last_seq`` per group, ``pid``, ``host``, ``error`` (why it failed),
``recovered`` (how it came back from a damaged state), ``updated``.

Signals (``hpcdl.process.worker``'s applier process): SIGTERM and SIGINT make it finish the update in
progress, commit, and exit 0; SIGUSR1 (SLURM's warning before the time limit) the same, then it
asks to be requeued.
"""

from hpcdl.applier.config import ApplierConfig
from hpcdl.applier.ledger import Ledger
from hpcdl.applier.server import AlreadyRunning, Applier
from hpcdl.applier.state import StateLost

__all__ = ["AlreadyRunning", "Applier", "ApplierConfig", "Ledger", "StateLost"]
