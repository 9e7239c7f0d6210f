"""Backends that run a job's groups: `local` (processes on this machine) and `slurm` (job arrays)."""

from __future__ import annotations

from hpcdl.schedulers.base import Scheduler, SchedulerError, SubmitRequest


def get_scheduler(name: str) -> Scheduler:
    if name == "local":
        from hpcdl.schedulers.local import LocalScheduler

        return LocalScheduler()
    if name == "slurm":
        from hpcdl.schedulers.slurm import SlurmScheduler

        return SlurmScheduler()
    raise SchedulerError(f"unknown backend {name!r} (local or slurm)")


__all__ = ["Scheduler", "SchedulerError", "SubmitRequest", "get_scheduler"]
