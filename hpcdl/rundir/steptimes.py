"""Each rank's own step times: the file format, its writer and its reader.

A synchronous step lasts as long as its slowest rank, so a group's step time hides which rank
was slow and how often; each rank's own time -- its forward and backward pass before the
gradients' allreduce waits for the others, stretched to an emulated step's length
(hpcdl.process.emulate) -- tells the straggler model (hpcdl.perf.stragglers) what the planner would
otherwise have to guess.

A file holds one rank's records, 8 bytes each: the step (uint32) and its seconds (float32),
little-endian. Records are buffered and appended every `every` steps (and at the end), one
``write`` each, so the step pays a list append; a rank killed with SIGKILL loses at most its
buffer, and a record torn by the kill is cut off by the next append or ignored by the reader.
A restarted rank repeats steps from its checkpoint: the reader keeps a step's last record.

No TensorFlow here: the planner reads these files on a login node.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np

from hpcdl.fs.access import Access
from hpcdl.fs.files import append_records, read_regular

RECORD = np.dtype([("step", "<u4"), ("seconds", "<f4")])
_PACK = struct.Struct("<If")
assert _PACK.size == RECORD.itemsize
FLUSH_EVERY = 50  # steps between appends: 400 bytes, one write
MAX_FILE_BYTES = RECORD.itemsize * 8_000_000  # steps of one rank; beyond, reading is refused


class StepTimeLog:
    """The writer of one rank's file; a failed append (a full disk) drops its records and
    training goes on: the times are advice for the next plan, not the run's results."""

    def __init__(self, path: Path, every: int = FLUSH_EVERY, access: Access | None = None):
        self.path, self.every, self.access = Path(path), every, access
        self.pending = bytearray()
        self.warned = False

    def record(self, step: int, seconds: float) -> None:
        self.pending += _PACK.pack(step, seconds)
        if len(self.pending) >= self.every * RECORD.itemsize:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data, self.pending = bytes(self.pending), bytearray()
        try:
            # the directory's policy, asked once it is needed (a run made before the directory was)
            self.access = self.access or Access.of_directory(self.path.parent)
            append_records(self.path, data, RECORD.itemsize, access=self.access)
        except OSError as exc:
            if not self.warned:
                print(f"hpcdl: step times not recorded in {self.path}: {exc.strerror or exc}",
                      file=sys.stderr, flush=True)
                self.warned = True


def read_step_times(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(steps, seconds) of one rank's file, by step, each step's last record; a torn last record
    and records that are not finite positive times are left out. OSError if it cannot be read."""
    data = read_regular(path, MAX_FILE_BYTES)
    whole = len(data) - len(data) % RECORD.itemsize  # without a record torn by a kill
    records = np.frombuffer(data[:whole], dtype=RECORD)
    steps = records["step"].astype(np.int64)
    seconds = records["seconds"].astype(np.float64)
    good = np.isfinite(seconds) & (seconds > 0)
    steps, seconds = steps[good], seconds[good]
    # np.unique sorts the steps; on the reversed records its first index is a step's last record
    unique, first_reversed = np.unique(steps[::-1], return_index=True)
    return unique, seconds[len(steps) - 1 - first_reversed]
