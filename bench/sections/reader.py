"""The HDF5 reader's images/s beside what training consumes.

The job's chunking and prefetch, shuffled and normalised, at 224×224; against the best rate a
training figure of this run took (goal ≥ 10×).
"""

from __future__ import annotations

import time

from bench.harness import Bench, best
from bench.local_runs import generated

GOAL = 10.0  # the reader's rate over training's


def run(b: Bench) -> None:
    from hpcdl.workloads.hep import data as hepdata
    from hpcdl.workloads.hep.normalization import Normalization

    files = generated(b, b.args.sustained_events, 224)
    norm = Normalization.from_file(files["train"])
    rates = []
    for _ in range(2):
        it = hepdata.iter_batches(files["train"], b.args.batch, norm=norm, shuffle=True, seed=1,
                                  chunk_events=256, prefetch=2)
        next(it)
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < b.args.reader_seconds:
            n += len(next(it).y)
        rates.append(n / (time.perf_counter() - t))
        it.close()
    consumption = [v for v in (b.data.get("sustained", {}).get("images_per_s_best"),
                               b.data.get("sustained_bfloat16", {}).get("images_per_s_best"),
                               b.data.get("step", {}).get("images_per_s_best")) if v]
    need = max(consumption) if consumption else None
    b.data["reader"] = {"images_per_s": rates, "training_images_per_s": need}
    ratio = f"{best(rates) / need:.0f}x training" if need else ""
    note = (f"goal ≥ {GOAL:.0f}x{' met' if need and best(rates) / need >= GOAL else ' NOT met'}; "
            f"training takes {need:.2f} img/s (its best)" if need else "no training figure in this run")
    b.row("reader", "reader", "HDF5 reader 224² (chunk 256, prefetch 2, shuffled, normalised)",
          f"{best(rates):.0f} img/s", ratio, note, number=best(rates))

