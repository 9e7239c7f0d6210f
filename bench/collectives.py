"""The two in-group collectives side by side: Horovod over MPI and mpi4py (hpcdl.engine.collective),
both under the same mpirun on this machine, at 2 and 4 ranks.

For each rank count and each measure (bench.collective_rank: the allreduce of the HEP gradient and
of a larger buffer, and the engine's training step on the HEP network and the race network), a
fresh group per collective, the collectives alternating who goes first, `--rounds` rounds. A
round's figure is the median of its timed repetitions; the result is the median over rounds with
their range, and the ratio mpi4py / Horovod in steps (or allreduces) per second, per round pair.
The allreduce's bus bandwidth is 2 (n - 1) / n x bytes / seconds (NCCL-tests' convention).
Loopback on a shared 2-core machine: this compares the libraries' overheads, not networks.

    python -m bench.collectives [--ranks 2,4] [--rounds 5] [--quick]

Writes bench/results/collectives/<date>-<machine>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import REPO, BenchError, machine, module_argv, result_path, write_result

SUITE = "collectives"
CONTROLLERS = ("mpi", "mpi4py")
LABELS = {"mpi": "Horovod (MPI)", "mpi4py": "mpi4py"}
MEASURES = ("allreduce:2.38", "allreduce:32", "step:hep", "step:race")


def one_group(controller: str, kind: str, ranks: int, reps: int, log_path) -> dict:
    """One fresh group of bench.collective_rank under mpirun: rank 0's figures."""
    from hpcdl.process.launch import find_mpi_launcher, local_group, worker_environ

    launcher = find_mpi_launcher()
    if launcher is None:
        raise BenchError("no mpirun or mpiexec: bench.collectives needs an MPI launcher")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    if os.geteuid() == 0:  # this bench as root (a container): Open MPI's consent, here only
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argv = launcher.command(ranks, module_argv("collective_rank", controller, kind, "--reps", str(reps)))
    with open(log_path, "a") as err:
        proc = subprocess.run(argv, cwd=REPO, env=worker_environ(env, local_group(0, 1)[0].to_mpi_env()),
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("@@ ")]
    if proc.returncode or not lines:
        raise BenchError(f"{controller} {kind} at {ranks} ranks failed (exit {proc.returncode}); see {log_path}")
    return json.loads(lines[-1][3:])


def bus_bandwidth(nbytes: int, ranks: int, seconds: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / seconds


def measure(ranks: list[int], rounds: int, reps: int, work) -> list[dict]:
    rows = []
    for n in ranks:
        for kind in MEASURES:
            medians: dict[str, list[float]] = {c: [] for c in CONTROLLERS}
            facts: dict = {}
            for r in range(rounds):
                for c in (CONTROLLERS if r % 2 == 0 else CONTROLLERS[::-1]):
                    got = one_group(c, kind, n, reps, work / f"collectives-{c}.log")
                    medians[c].append(statistics.median(got["seconds"]))
                    facts = {k: v for k, v in got.items() if k not in ("seconds", "controller", "size", "kind")}
            ratios = [h / m for h, m in zip(medians["mpi"], medians["mpi4py"])]  # mpi4py's speed / Horovod's
            row = {"ranks": n, "kind": kind, **facts, "round_medians_s": medians,
                   "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
            if kind.startswith("allreduce"):
                row["bus_gb_s"] = {c: bus_bandwidth(facts["bytes"], n, statistics.median(medians[c])) / 1e9
                                   for c in CONTROLLERS}
            rows.append(row)
            print(render_row(row), file=sys.stderr, flush=True)
    return rows


def render_row(row: dict) -> str:
    ms = {c: 1e3 * statistics.median(row["round_medians_s"][c]) for c in CONTROLLERS}
    what = f"{row['kind']:<15} {row['ranks']} ranks"
    cells = "  ".join(f"{LABELS[c]} {ms[c]:7.2f} ms" for c in CONTROLLERS)
    extra = ""
    if "bus_gb_s" in row:
        extra = "  bus " + " / ".join(f"{row['bus_gb_s'][c]:.2f}" for c in CONTROLLERS) + " GB/s"
    return (f"{what}  {cells}  mpi4py {row['ratio_median']:.2f}x Horovod's speed "
            f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}){extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 10: a smoke test, not a figure")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-bench"))
    args = ap.parse_args(argv)
    rounds, reps = (2, 10) if args.quick else (args.rounds, args.reps)
    args.work.mkdir(parents=True, exist_ok=True)
    began = time.time()
    rows = measure([int(n) for n in args.ranks.split(",")], rounds, reps, args.work)
    result = {"rounds": rounds, "reps": reps, "quick": args.quick, "rows": rows, "seconds": time.time() - began,
              "machine": machine()}
    path = write_result(result_path(SUITE, result["machine"]), result)
    print("\n".join(render_row(r) for r in rows))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
