"""Backends that run a job's groups, by name: `local` (processes on this machine) and `slurm`
(job arrays). Each implements hpcdl.schedulers.base.Scheduler; the names are declared here, and
the implementations loaded only when used (a job's validation and the CLI's choices read the
names; hpcdl.schedulers.select picks one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcdl.registry import load_registered

if TYPE_CHECKING:
    from hpcdl.schedulers.base import Scheduler

SCHEDULERS = {"local": "hpcdl.schedulers.local:LocalScheduler", "slurm": "hpcdl.schedulers.slurm:SlurmScheduler"}


def get_scheduler(name: str) -> "Scheduler":
    return load_registered(SCHEDULERS, name, "run.backend")()
