"""The applier: the parameter server of the hybrid scheme (the loop in :mod:`.server`, the update
rules in :mod:`.rules`)."""

from hpcdl.applier.server import CRASH_ENV, AlreadyRunning, Applier, Ledger

__all__ = ["CRASH_ENV", "AlreadyRunning", "Applier", "Ledger"]
