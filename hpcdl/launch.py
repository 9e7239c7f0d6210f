"""Rank bootstrap: where a process sits in its group, as Horovod's environment, without ssh.

Each synchronous group is its own Gloo world with its own HTTP rendezvous, so ranks of different
groups never share a collective. Mapping a scheduler's variables to Horovod's is parsing, kept
pure: `RankEnv.from_slurm(environ)` and `RankEnv.to_horovod_env(...)` return values and write
nothing; only `start_rendezvous` has a side effect (a listening thread in the caller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


class LaunchError(RuntimeError):
    """The environment does not describe a rank; the message says what to fix."""


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
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HPCDL_GROUP": str(self.group),
        }
        if iface:
            env["HOROVOD_GLOO_IFACE"] = iface
        return env


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


def worker_environ(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """A child's environment: the parent's, minus another launcher's Horovod variables."""
    env = {k: v for k, v in base.items() if not k.startswith("HOROVOD_")}
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
