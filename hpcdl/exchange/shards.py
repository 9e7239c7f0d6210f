"""The partition of a model's tensors over ``exchange.shards`` appliers (see the protocol docstring).

A *piece* is a whole tensor or a block of its rows ``[start, stop)``; a shard's pieces are one
contiguous run of the model's tensors (see :meth:`Partition.balanced`), so a shard's update stays
a handful of large arrays and no shard holds much more than its share.

A tensor's *rows* are the elements of all its axes but the last, the tensor seen as a matrix
(a 3×3×128×128 convolution kernel has 1152 rows of 128): a piece is then a contiguous view, and
a cut can fall within a row of 128 values of the share, where a kernel's first axis of 3 would
leave shards a third of a tensor apart. Partitions recorded in format 1 cut the first axis
instead; they stay readable, and a run keeps the layout it recorded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]
PARTITION_FORMAT = 2  # 1: rows along the first axis (runs recorded before format 2)
EDGE_SLACK = 0.05  # a cut moves to a tensor's edge when that unbalances a shard by less than this


class PartitionMismatch(ValueError):
    """The run's recorded partition is not the one this job and model would make."""


@dataclass(frozen=True)
class Piece:
    tensor: str
    start: int = 0
    stop: int | None = None  # None: the whole tensor

    @property
    def key(self) -> str:
        """The piece's name in an exchange file: the tensor's own name when it is whole."""
        return self.tensor if self.stop is None else f"{self.tensor}@{self.start}:{self.stop}"


@dataclass(frozen=True)
class Partition:
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, numpy dtype string)
    shards: tuple[tuple[Piece, ...], ...]
    format: int = PARTITION_FORMAT

    @property
    def count(self) -> int:
        return len(self.shards)

    @classmethod
    def balanced(cls, tensors: Arrays | dict[str, tuple[tuple[int, ...], str]], count: int,
                 fmt: int = PARTITION_FORMAT) -> "Partition":
        """Deal ``tensors`` (arrays, or name -> (shape, dtype)) to ``count`` shards by bytes.

        The tensors, in model order, are laid end to end and cut into ``count`` runs of equal
        bytes; a cut that falls inside a tensor splits it between rows (of format ``fmt``), unless
        moving the cut to the tensor's edge costs less than ``EDGE_SLACK`` of a share.
        """
        if count < 1:
            raise ValueError(f"exchange.shards must be at least 1, got {count}")
        specs = {n: ((tuple(np.shape(v)), np.asarray(v).dtype.str) if hasattr(v, "dtype")  # numpy scalars too
                     else (tuple(v[0]), np.dtype(v[1]).str)) for n, v in tensors.items()}
        if fmt not in (1, PARTITION_FORMAT):
            raise ValueError(f"partition format {fmt!r}")
        share = sum(_rows_of(s, fmt) * _row_bytes(s, fmt) for s in specs.values()) / count
        slack = EDGE_SLACK * share
        dealt: list[list[Piece]] = [[] for _ in range(count)]
        shard, filled = 0, 0.0
        for name, spec in specs.items():
            rows, per_row = _rows_of(spec, fmt), _row_bytes(spec, fmt)
            start = 0
            while start < rows or (rows == 0 and start == 0):
                room = (shard + 1) * share - filled if shard < count - 1 else math.inf
                rest = (rows - start) * per_row
                take = rows - start if rest <= room + slack else min(rows - start, round(room / per_row))
                if take == 0 and rows:
                    shard += 1  # less than half a row of room left: the next shard begins here
                    continue
                dealt[shard].append(Piece(name) if take == rows else Piece(name, start, start + take))
                filled += take * per_row
                start += max(take, 1)
                if shard < count - 1 and filled >= (shard + 1) * share - slack:
                    shard += 1
        if any(not pieces for pieces in dealt):
            raise ValueError(f"exchange.shards = {count}: this model's tensors cannot give every "
                             f"shard a part")
        return cls(specs, tuple(tuple(pieces) for pieces in dealt), fmt)

    def shard_bytes(self) -> list[int]:
        out = []
        for pieces in self.shards:
            out.append(sum(self._rows(p) * _row_bytes(self.tensors[p.tensor], self.format) for p in pieces))
        return out

    def split(self, tensors: Arrays) -> list[Arrays]:
        """One dict per shard, keyed by piece; row blocks are views, not copies."""
        return [{p.key: tensors[p.tensor] if p.stop is None else self._as_rows(tensors[p.tensor])[p.start:p.stop]
                 for p in pieces} for pieces in self.shards]

    def _as_rows(self, tensor: np.ndarray) -> np.ndarray:
        arr = np.asarray(tensor)  # format 1's pieces keep the tensor's trailing axes
        return arr.reshape(_matrix(arr.shape, self.format)) if self.format >= 2 and arr.ndim > 2 else arr

    def join(self, parts: list[Arrays]) -> Arrays:
        """The whole tensors from every shard's pieces (``split``'s inverse)."""
        blocks: dict[str, list[tuple[int, np.ndarray]]] = {}
        for pieces, part in zip(self.shards, parts, strict=True):
            for p in pieces:
                blocks.setdefault(p.tensor, []).append((p.start, part[p.key]))
        out = {}
        for name in self.tensors:
            found = sorted(blocks[name], key=lambda b: b[0])
            whole = found[0][1] if len(found) == 1 else np.concatenate([b for _, b in found])
            shape = self.tensors[name][0]
            out[name] = whole if np.shape(whole) == shape else np.reshape(whole, shape)
        return out

    # -- the run's record ----------------------------------------------------------------------
    def to_json(self) -> bytes:
        return json.dumps({
            "format": self.format,
            "tensors": {n: {"shape": list(s), "dtype": d} for n, (s, d) in self.tensors.items()},
            "shards": [[[p.tensor, p.start, p.stop] for p in pieces] for pieces in self.shards],
        }, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Partition":
        """Parse and check a recorded partition; ValueError with one line if it is not one."""
        try:
            doc = json.loads(data)
            fmt = doc.get("format")
            if type(fmt) is not int or fmt not in (1, PARTITION_FORMAT):  # JSON true is not 1
                raise ValueError(f"format {fmt!r}")
            tensors = {str(n): (tuple(int(x) for x in t["shape"]), str(np.dtype(t["dtype"]).str))
                       for n, t in doc["tensors"].items()}
            shards = tuple(tuple(Piece(str(t), int(a), None if b is None else int(b)) for t, a, b in pieces)
                           for pieces in doc["shards"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not an hpcdl partition ({exc})") from None
        partition = cls(tensors, shards, fmt)
        partition._check()
        return partition

    def _check(self) -> None:
        """Every row of every tensor in exactly one piece, every shard non-empty."""
        if not self.shards or any(not pieces for pieces in self.shards):
            raise ValueError("not an hpcdl partition (a shard without pieces)")
        covered: dict[str, list[tuple[int, int]]] = {n: [] for n in self.tensors}
        for pieces in self.shards:
            for p in pieces:
                if p.tensor not in covered:
                    raise ValueError(f"not an hpcdl partition (unknown tensor {p.tensor!r})")
                covered[p.tensor].append((p.start, self._rows(p) + p.start))
        for name, spans in covered.items():
            spans.sort()
            rows = _rows_of(self.tensors[name], self.format)
            contiguous = spans and spans[0][0] == 0 and spans[-1][1] == rows and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:]))
            if not contiguous:
                raise ValueError(f"not an hpcdl partition (tensor {name!r} is not covered exactly once)")

    def describe(self) -> dict[str, Any]:
        return {"shards": self.count, "bytes": self.shard_bytes(),
                "pieces": [len(pieces) for pieces in self.shards]}

    def _rows(self, piece: Piece) -> int:
        if piece.stop is None:
            return _rows_of(self.tensors[piece.tensor], self.format)
        return piece.stop - piece.start


def _matrix(shape: tuple[int, ...], fmt: int) -> tuple[int, int]:
    """(rows, elements per row) of a tensor of ``shape`` as format ``fmt`` cuts it."""
    if fmt >= 2 and len(shape) > 2:
        return math.prod(shape[:-1]), shape[-1]
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def _row_bytes(spec: tuple[tuple[int, ...], str], fmt: int) -> int:
    return _matrix(spec[0], fmt)[1] * np.dtype(spec[1]).itemsize


def _rows_of(spec: tuple[tuple[int, ...], str], fmt: int) -> int:
    return _matrix(spec[0], fmt)[0]
