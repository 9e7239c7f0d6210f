"""A run directory's exchange: its channels, keyed by the run's secret and made with its access
policy; the tensor partition the run recorded; a group root's exchange; and the master weights
adopted from it (evaluate). The protocol itself is hpcdl.exchange's, which knows no run."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.exchange import Channel
from hpcdl.exchange.group import ExchangeSync
from hpcdl.exchange.shards import Partition, PartitionMismatch
from hpcdl.fs.files import atomic_write_bytes
from hpcdl.rundir.runs import RunDir
from hpcdl.fs.storage import StorageReport


def run_channel(run: RunDir, job, *, shard: int = 0, create: bool = True, **kwargs: Any) -> Channel:
    """Shard ``shard``'s exchange channel: the run's key, the run's access policy."""
    return Channel(run.shard_dir(job, shard), run.run_id, create=create, signer=run.signer(),
                   access=run.access(job), **kwargs)


def record_partition(run: RunDir, job, partition: Partition, *, check_only: bool = False) -> Partition:
    """The run's partition: ``partition``, written unless ``check_only``, or the one the run
    recorded, if it is what this model and K give in the recorded format (a run keeps the layout
    it started with across versions of hpcdl). Anything else, one line."""
    path = run.partition_file(job)
    try:
        recorded = Partition.from_json(path.read_bytes())
    except FileNotFoundError:
        if not check_only:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Every root computes the same partition from the same model and K: a race writes equal bytes.
            atomic_write_bytes(path, partition.to_json(), access=run.access(job))
        return partition
    except ValueError as exc:
        raise PartitionMismatch(f"{path}: {exc}") from None
    expected = (partition if recorded.format == partition.format
                else Partition.balanced(partition.tensors, partition.count, recorded.format))
    if recorded != expected:
        raise PartitionMismatch(
            f"this run's exchange is partitioned over {recorded.count} shard(s) of another layout "
            f"({path}); exchange.shards = {partition.count} and this model do not match it")
    return recorded


def group_exchange(run: RunDir, job, group: int, report: StorageReport) -> ExchangeSync:
    """Group `group`'s root of `run`; `report` is the group's storage report (shared with the
    engine's writes)."""
    x = job.exchange
    channels = [run_channel(run, job, shard=k, max_pending_per_group=x.max_pending_per_group)
                for k in range(x.shard_count)]
    return ExchangeSync(channels, group, x.every, report=report,
                        kind=x.kind, max_outstanding=x.max_outstanding, warmup_steps=x.warmup_steps,
                        reply_timeout_s=x.reply_timeout_s, delta_dtype=x.delta_dtype,
                        drop_held=x.drop_held_updates,
                        on_partition=(lambda p: record_partition(run, job, p)) if x.shard_count > 1 else None)


def adopt_master_weights(run: RunDir, job, model) -> int | None:
    """Load the run's newest master weights, every shard's part joined, into `model`; returns
    the oldest shard's version, None if some shard has none."""
    variables = dict(model.named_variables())
    partition = Partition.balanced({n: ((tuple(v.shape)), np.dtype(v.dtype.as_numpy_dtype).str)
                                    for n, v in variables.items()}, job.exchange.shard_count)
    if partition.count > 1:
        partition = record_partition(run, job, partition, check_only=True)  # another K: refused, not mixed
    parts, versions = [], []
    for k in range(partition.count):
        try:
            latest = run_channel(run, job, shard=k, create=False).read_latest_weights()
        except FileNotFoundError:
            return None
        if latest is None:
            return None
        versions.append(latest[0])
        parts.append(latest[1])
    try:
        tensors = partition.join(parts)
    except KeyError as exc:
        raise ValueError(f"master weights v{min(versions)} do not fit this model ({exc})") from None
    for name, var in variables.items():
        if name not in tensors or tuple(tensors[name].shape) != tuple(var.shape):
            raise ValueError(f"master weights v{min(versions)} do not fit this model ({name})")
        var.assign(tensors[name])
    return min(versions)
