"""A group's collectives, behind one interface: the engine averages its gradients, broadcasts its
start weights and makes its small agreements (adopt, stop, the end saved) through a `Collective`,
whichever library formed the group.

Two implementations:

- `HorovodCollective` over an initialised ``horovod.tensorflow`` (run.controller "gloo" or
  "mpi"): Horovod's own ops, traced into the step, its background thread fusing the tensors.
- `MpiCollective` over ``mpi4py`` (run.controller "mpi4py"): the step's gradients and loss are
  fused into one contiguous buffer and averaged in a single ``MPI_Allreduce``, called from the
  traced step through ``tf.numpy_function``. One call per step keeps the order of collectives
  identical on every rank, which blocking MPI requires. Its launcher (mpirun, srun --mpi) ends
  every rank when one dies, so a killed rank ends the step in bounded time, as with Horovod; a
  rank that leaves without `shutdown` (an exception only it raised) aborts the MPI job, for it
  would otherwise wait in MPI_Finalize for ranks that wait for it in a collective.

Every rank must call the same methods in the same order: each is a collective.
"""

from __future__ import annotations

import atexit
import sys
from typing import Protocol, Sequence

import numpy as np
import tensorflow as tf


class Collective(Protocol):
    """What the engine asks of the group it trains in."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def average(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The group's mean of each tensor; traceable, called inside the step's tf.function."""

    def broadcast_variables(self, variables: Sequence[tf.Variable], root_rank: int = 0) -> None:
        """Every rank's variables set to the root's."""

    def agree(self, values: Sequence[int], op: str) -> list[int]:
        """Element-wise "max" or "min" of small integers over the group."""

    def gather(self, value: int) -> np.ndarray:
        """One signed 64-bit integer from each rank, in rank order."""

    def shutdown(self) -> None: ...


class HorovodCollective:
    """The group Horovod formed (Gloo or MPI), through ``horovod.tensorflow``."""

    name = "horovod"

    def __init__(self, hvd):
        self.hvd = hvd

    def rank(self) -> int:
        return self.hvd.rank()

    def size(self) -> int:
        return self.hvd.size()

    def average(self, tensors):
        # what hvd.DistributedGradientTape does with its defaults; Horovod fuses them itself
        return [self.hvd.allreduce(t, op=self.hvd.Average) for t in tensors]

    def broadcast_variables(self, variables, root_rank: int = 0) -> None:
        self.hvd.broadcast_variables(variables, root_rank=root_rank)

    def agree(self, values, op: str) -> list[int]:
        reduce = {"max": self.hvd.Max, "min": self.hvd.Min}[op]
        return [int(v) for v in self.hvd.allreduce(tf.constant(list(values), tf.int32), op=reduce, name=f"agree_{op}").numpy()]

    def gather(self, value: int) -> np.ndarray:
        return self.hvd.allgather(tf.constant([value], tf.int64), name="gather").numpy()

    def shutdown(self) -> None:
        self.hvd.shutdown()


class MpiCollective:
    """The group an MPI launcher formed, through ``mpi4py`` (``MPI.COMM_WORLD`` by default)."""

    name = "mpi4py"

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self._rank, self._size = self.comm.Get_rank(), self.comm.Get_size()
        self._shut_down = False
        atexit.register(self._abort_unless_shut_down)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def average(self, tensors):
        tensors = list(tensors)
        if not tensors:
            return []
        wire = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32
        shapes = [tf.shape(t) for t in tensors]
        sizes = [tf.size(t) for t in tensors]
        fused = tf.concat([tf.reshape(tf.cast(t, wire), [-1]) for t in tensors], axis=0)
        summed = tf.numpy_function(self._sum, [fused], wire, stateful=True, name="mpi_allreduce")
        mean = summed / tf.cast(self.size(), wire)
        parts = tf.split(mean, sizes)
        return [tf.cast(tf.reshape(p, s), t.dtype) for p, s, t in zip(parts, shapes, tensors)]

    @tf.autograph.experimental.do_not_convert  # plain Python, run by numpy_function
    def _sum(self, buffer: np.ndarray) -> np.ndarray:
        out = np.empty_like(buffer)
        self.comm.Allreduce(np.ascontiguousarray(buffer), out, op=self._mpi.SUM)
        return out

    def broadcast_variables(self, variables, root_rank: int = 0) -> None:
        variables = list(variables)
        if not variables:
            return
        values = [v.numpy() for v in variables]
        # the bytes, whatever the dtypes: every rank ends with the root's weights to the bit
        buffer = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in values])
        self.comm.Bcast(buffer, root=root_rank)
        offset = 0
        for variable, value in zip(variables, values):
            variable.assign(buffer[offset:offset + value.nbytes].view(value.dtype).reshape(value.shape))
            offset += value.nbytes

    def agree(self, values, op: str) -> list[int]:
        reduce = {"max": self._mpi.MAX, "min": self._mpi.MIN}[op]
        mine = np.asarray(list(values), np.int64)
        out = np.empty_like(mine)
        self.comm.Allreduce(mine, out, op=reduce)
        return [int(v) for v in out]

    def gather(self, value: int) -> np.ndarray:
        out = np.empty(self.size(), np.int64)
        self.comm.Allgather(np.asarray([value], np.int64), out)
        return out

    def shutdown(self) -> None:
        self.comm.Barrier()
        self._shut_down = True

    def _abort_unless_shut_down(self) -> None:
        if not self._shut_down:
            sys.stderr.flush()
            self.comm.Abort(1)  # the worker's EXIT_FAILED: the group restarts from its checkpoint


def join_group(controller: str) -> Collective:
    """The group's Collective, its world formed from what the launcher set (run.controller):
    Horovod's for "gloo" and "mpi", mpi4py's for "mpi4py"."""
    if controller == "mpi4py":
        return MpiCollective()
    import horovod.tensorflow as hvd

    hvd.init()
    return HorovodCollective(hvd)
