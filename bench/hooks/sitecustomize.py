"""Bench-only: slow one rank down, for bench/run.py's hybrid-vs-synchronous section.

bench/run.py puts this directory on PYTHONPATH of the `hpcdl submit` it starts, so every rank of
that run imports this module at interpreter start. Nothing happens unless HPCDL_BENCH_SLOW_SHARD
is set. Then the workload that `hpcdl.workloads.get_workload` returns is wrapped: the rank whose
data shard is that number (group × ranks per group + rank, i.e. the same rank of the 4 whichever
way they are grouped) sleeps before each batch for (HPCDL_BENCH_SLOW_FACTOR − 1) × its own step
time (a moving average of the time between two batches, minus the sleep; the first two steps,
with tracing, are not slowed), so its steps take about FACTOR × as long. hpcdl itself has no such
hook: this is a test rig, not a feature.
"""

import os

if os.environ.get("HPCDL_BENCH_SLOW_SHARD"):
    import time

    import hpcdl.workloads as _workloads

    _SHARD = int(os.environ["HPCDL_BENCH_SLOW_SHARD"])
    _FACTOR = float(os.environ.get("HPCDL_BENCH_SLOW_FACTOR", "2"))
    _original = _workloads.get_workload

    def _slowed(batches, factor):
        estimate, seen, handed = None, 0, None
        for batch in batches:
            now = time.perf_counter()
            if handed is not None:
                seen += 1
                work = now - handed
                if seen > 2:
                    estimate = work if estimate is None else 0.8 * estimate + 0.2 * work
            if estimate is not None:
                time.sleep((factor - 1.0) * estimate)
            handed = time.perf_counter()
            yield batch

    class _SlowWorkload:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def train_batches(self, job, stats, shard, shards, seed):
            batches = self._inner.train_batches(job, stats, shard, shards, seed)
            if shard != _SHARD:
                return batches
            print(f"bench hook: shard {shard} slowed {_FACTOR:g}x", flush=True)
            return _slowed(batches, _FACTOR)

    def get_workload(name):
        return _SlowWorkload(_original(name))

    _workloads.get_workload = get_workload
