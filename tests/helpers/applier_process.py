"""One applier as a process of its own, for tests that kill it, signal it or run two at once:
``python tests/helpers/applier_process.py --exchange DIR --run-id ID [...]``.

A run's applier is ``python -m hpcdl.process.worker RUN --applier`` (it reads the job); this builds the
same :class:`hpcdl.applier.Applier` on a bare exchange directory, with ``--crash POINT[:N]``
killing the process (SIGKILL) at the N-th pass through a commit's crash point.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from hpcdl.applier import AlreadyRunning, Applier, ApplierConfig
from hpcdl.exchange import Channel, CorruptFile, Signer
from hpcdl.rundir.runkey import RunKeyError, load_key_file


def crash_at(spec: str | None):
    if not spec:
        return lambda point: None
    name, _, n = spec.partition(":")
    hits = {"n": 0}

    def crash(point: str) -> None:
        if point == name:
            hits["n"] += 1
            if hits["n"] >= int(n or 1):
                os.kill(os.getpid(), signal.SIGKILL)

    return crash


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exchange", required=True, type=Path)
    p.add_argument("--run-id", required=True)
    p.add_argument("--key-file", type=Path, default=None)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--keep-versions", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--poll-interval", type=float, default=0.05)
    p.add_argument("--idle-exit-after", type=float, default=None)
    p.add_argument("--status-interval", type=float, default=5.0)
    p.add_argument("--no-fsync", action="store_true")
    p.add_argument("--crash", default=None, help="POINT[:N]: SIGKILL at the N-th pass through POINT")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(levelname)s %(message)s")
    try:
        signer = Signer(load_key_file(args.key_file)) if args.key_file else Signer()
    except RunKeyError as e:
        print(f"cannot start: {e}", file=sys.stderr)
        return 1
    channel = Channel(args.exchange, args.run_id, create=True, fsync=not args.no_fsync, signer=signer)
    config = ApplierConfig(optimizer=args.optimizer, lr=args.lr, keep_versions=args.keep_versions,
                           max_batch=args.max_batch, status_interval=args.status_interval)
    try:
        applier = Applier(channel, config, crash=crash_at(args.crash))
    except AlreadyRunning as e:
        print(e, file=sys.stderr)
        return 3
    except (CorruptFile, ValueError) as e:  # e.g. a state of another run or optimizer
        print(f"cannot start: {e}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda *_: applier.request_stop())
    with applier:
        applier.run(poll_interval=args.poll_interval, idle_exit_after=args.idle_exit_after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
