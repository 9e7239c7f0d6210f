"""Helpers shared by tests; the scripts beside this file run as processes of their own."""

from __future__ import annotations

from pathlib import Path

APPLIER_PROCESS = str(Path(__file__).with_name("applier_process.py"))


def applier_for(channel, optimizer: str = "sgd", lr: float = 1.0, *, initial=None, lock: bool = True, **config):
    """An Applier on `channel` with `optimizer` at `lr` and any other ApplierConfig field."""
    from hpcdl.applier import Applier, ApplierConfig

    return Applier(channel, ApplierConfig(optimizer=optimizer, lr=lr, **config), initial=initial, lock=lock)
