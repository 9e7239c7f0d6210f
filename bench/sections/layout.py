"""Ranks per node × threads per rank on this node's CPUs, as images/s of the node.

One rank on all of them, two on halves, one per NUMA domain (where there are several); each rank a
process pinned to its CPUs and planned by hpcdl's tuning for them, the node's batch shared by its
ranks, their steps run at once; images/s of the node, rounds alternating, as a ratio to one rank
(the allreduce between them is left out: milliseconds against seconds of step).
"""

from __future__ import annotations

import os
import time

from bench.harness import Bench, Probe, best, log, median, mem_available_gb


def run(b: Bench) -> None:
    from hpcdl.engine.tuning import numa_domains, rank_layouts

    cpus = sorted(os.sched_getaffinity(0))
    layouts = rank_layouts(cpus, numa_domains())
    node_batch, rounds = b.args.batch, b.args.rounds
    res = b.data.setdefault("layout", {"node_batch": node_batch, "cpus": cpus, "layouts": {}})
    running: dict[str, list[Probe]] = {}
    try:
        for name, cpu_sets in layouts.items():
            if mem_available_gb() < 3.0 * len(cpu_sets):
                b.row(f"layout.{name}", "layout", f"{name} ranks × threads", "skipped", "",
                      f"only {mem_available_gb():.1f} GB free")
                continue
            log(f"layout: {name}: starting {len(cpu_sets)} rank process(es)")
            batch = max(1, node_batch // len(cpu_sets))
            ranks = [Probe(f"tf-layout-{len(cpu_sets)}r{i}", ["--role", "tf", "--image", "224",
                                                                 "--cpus", ",".join(map(str, c))], b.logdir)
                     for i, c in enumerate(cpu_sets)]
            running[name] = ranks
            for rank in ranks:
                rank.send(op="setup", batches=[batch], precisions=["float32"])
            for rank in ranks:
                rank.receive()
            res["layouts"][name] = {"cpus": cpu_sets, "batch_per_rank": batch, "images_per_s": [],
                                    "plans": [r.info["plan"] for r in ranks]}
        names = list(running)
        if not names:
            return
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                ranks, entry = running[name], res["layouts"][name]
                t = time.perf_counter()
                for rank in ranks:
                    rank.send(op="step", batch=entry["batch_per_rank"], precision="float32", n=1)
                for rank in ranks:
                    rank.receive()
                entry["images_per_s"].append(entry["batch_per_rank"] * len(ranks) / (time.perf_counter() - t))
            log(f"layout: round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {res['layouts'][n]['images_per_s'][-1]:.1f} img/s" for n in names))
    finally:
        for ranks in running.values():
            for rank in ranks:
                rank.close()
    one = res["layouts"][names[0]]["images_per_s"]
    for name in names:
        entry = res["layouts"][name]
        rates = entry["images_per_s"]
        paired = [a / c for a, c in zip(rates, one)]
        b.row(f"layout.{name.split()[0]}", "layout",
              f"{name} ranks × threads, batch {entry['batch_per_rank']} per rank", f"{best(rates):.1f} img/s",
              f"{median(paired):.2f}x one rank" if name != names[0] else "reference",
              f"median {median(rates):.1f} img/s; paired ratios {min(paired):.2f}–{max(paired):.2f}; "
              f"CPUs {' | '.join(','.join(map(str, c)) for c in entry['cpus'])}", number=median(paired))

