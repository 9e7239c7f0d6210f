"""Horovod's allreduce of the HEP gradient in a 4-rank group, Gloo beside MPI.

Horovod's allreduce of the HEP gradient (2.38 MB) inside a 4-rank group on this machine, Gloo
beside MPI (Open MPI over TCP loopback, like Gloo, and over its default shared memory), each
round a fresh group per controller, rounds alternating (bench.allreduce_rank is one rank).
Loopback: this compares the controllers' software overheads, not networks.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench.harness import REPO, Bench, BenchError, median, module_argv


ALLREDUCE_RANKS = 4
# name -> (controller, extra environment, what the row says)
ALLREDUCE_CONFIGS = {
    "gloo": ("gloo", {}, "Gloo (TCP loopback)"),
    "mpi_tcp": ("mpi", {"OMPI_MCA_btl": "self,tcp"}, "MPI, Open MPI over TCP loopback"),
    "mpi": ("mpi", {}, "MPI, Open MPI's default transport (shared memory)"),
}


def allreduce_round(b: Bench, name: str, reps: int) -> list[float]:
    """One fresh 4-rank group of bench.allreduce_rank under one controller: rank 0's timings."""
    from hpcdl.process.launch import find_mpi_launcher, local_group, start_rendezvous, worker_environ

    controller, extra, _ = ALLREDUCE_CONFIGS[name]
    argv = module_argv("allreduce_rank", "--reps", str(reps))
    envs = local_group(0, ALLREDUCE_RANKS)
    base = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", **extra}
    server = None
    with open(b.logdir / f"allreduce-{name}.log", "a") as err:
        if controller == "gloo":
            server, port = start_rendezvous(envs)
            procs = [subprocess.Popen(argv, env=worker_environ(base, e.to_horovod_env("127.0.0.1", port, iface="lo")),
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True) for e in envs]
        else:
            launcher = find_mpi_launcher()
            if os.geteuid() == 0:  # this bench as root (a container): Open MPI's consent, here only
                base.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            procs = [subprocess.Popen(launcher.command(ALLREDUCE_RANKS, argv), cwd=REPO,
                                      env=worker_environ(base, envs[0].to_mpi_env()),
                                      stdout=subprocess.PIPE, stderr=err, text=True)]
        try:
            outs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            if server is not None:
                server.stop()
    if any(p.returncode for p in procs):
        raise BenchError(f"allreduce under {name} failed; see {b.logdir / f'allreduce-{name}.log'}")
    for out in outs:
        for line in out.splitlines():
            if line.startswith("@@ "):
                return json.loads(line[3:])["seconds"]
    raise BenchError(f"allreduce under {name}: rank 0 printed no timings")


def run(b: Bench) -> None:
    from hpcdl.process.launch import find_mpi_launcher

    launcher = find_mpi_launcher()
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow as h; print(h.mpi_built())"],
                           capture_output=True, text=True)
    names = ["gloo"]
    if launcher and launcher.open_mpi and probe.stdout.strip().endswith("True"):
        names += ["mpi_tcp", "mpi"]
    else:
        b.row("allreduce.mpi", "allreduce", "MPI beside Gloo", "not measured", "",
              "needs Horovod built with MPI (make install MPI=1) and Open MPI's mpirun")
    reps = 10 if b.args.quick else 20
    per_round: dict[str, list[float]] = {n: [] for n in names}
    samples: dict[str, list[list[float]]] = {n: [] for n in names}
    for r in range(b.args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):  # alternate who goes first
            seconds = allreduce_round(b, name, reps)
            samples[name].append(seconds)
            per_round[name].append(statistics.median(seconds))
    b.data["allreduce"] = {"ranks": ALLREDUCE_RANKS, "bytes": 2_376_712, "reps": reps, "samples_s": samples,
                           "round_medians_s": per_round, "mpi_launcher": launcher.path if launcher else None}
    gloo = median(per_round["gloo"])
    for name in names:
        rounds = per_round[name]
        ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
        ratio = "" if name == "gloo" else f"{gloo / median(rounds):.2f}× Gloo's speed"
        b.row(f"allreduce.{name}", "allreduce",
              f"HEP gradient (2.38 MB) allreduce, {ALLREDUCE_RANKS}-rank group, {ALLREDUCE_CONFIGS[name][2]}",
              f"{ms(median(rounds))} ms", ratio,
              f"median of {len(rounds)} rounds' medians (rounds {ms(min(rounds))}–{ms(max(rounds))} ms, "
              f"{reps} each); loopback: software overheads, not networks", number=median(rounds))

