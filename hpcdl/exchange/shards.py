"""The partition of a model's tensors over ``exchange.shards`` appliers (see the protocol docstring).

A *piece* is a whole tensor or a block of its rows ``[start, stop)`` along the first axis; a
shard's pieces are one contiguous run of the model's tensors (see :meth:`Partition.balanced`), so
a shard's update stays a handful of large arrays and no shard holds much more than its share.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]
PARTITION_FORMAT = 1
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

    @property
    def count(self) -> int:
        return len(self.shards)

    @classmethod
    def balanced(cls, tensors: Arrays | dict[str, tuple[tuple[int, ...], str]], count: int) -> "Partition":
        """Deal ``tensors`` (arrays, or name -> (shape, dtype)) to ``count`` shards by bytes.

        The tensors, in model order, are laid end to end and cut into ``count`` runs of equal
        bytes; a cut that falls inside a tensor splits it between rows, unless moving the cut to
        the tensor's edge costs less than ``EDGE_SLACK`` of a share.
        """
        if count < 1:
            raise ValueError(f"exchange.shards must be at least 1, got {count}")
        specs = {n: ((tuple(np.shape(v)), np.asarray(v).dtype.str) if hasattr(v, "dtype")  # numpy scalars too
                     else (tuple(v[0]), np.dtype(v[1]).str)) for n, v in tensors.items()}
        share = sum(_rows_of(s) * _row_bytes(s) for s in specs.values()) / count
        slack = EDGE_SLACK * share
        dealt: list[list[Piece]] = [[] for _ in range(count)]
        shard, filled = 0, 0.0
        for name, spec in specs.items():
            rows, per_row = _rows_of(spec), _row_bytes(spec)
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
        return cls(specs, tuple(tuple(pieces) for pieces in dealt))

    def shard_bytes(self) -> list[int]:
        out = []
        for pieces in self.shards:
            out.append(sum(_rows(p, self.tensors) * _row_bytes(self.tensors[p.tensor]) for p in pieces))
        return out

    def split(self, tensors: Arrays) -> list[Arrays]:
        """One dict per shard, keyed by piece; row blocks are views, not copies."""
        return [{p.key: tensors[p.tensor] if p.stop is None else np.asarray(tensors[p.tensor])[p.start:p.stop]
                 for p in pieces} for pieces in self.shards]

    def join(self, parts: list[Arrays]) -> Arrays:
        """The whole tensors from every shard's pieces (``split``'s inverse)."""
        blocks: dict[str, list[tuple[int, np.ndarray]]] = {}
        for pieces, part in zip(self.shards, parts, strict=True):
            for p in pieces:
                blocks.setdefault(p.tensor, []).append((p.start, part[p.key]))
        out = {}
        for name in self.tensors:
            found = sorted(blocks[name], key=lambda b: b[0])
            out[name] = found[0][1] if len(found) == 1 else np.concatenate([b for _, b in found])
        return out

    # -- the run's record ----------------------------------------------------------------------
    def to_json(self) -> bytes:
        return json.dumps({
            "format": PARTITION_FORMAT,
            "tensors": {n: {"shape": list(s), "dtype": d} for n, (s, d) in self.tensors.items()},
            "shards": [[[p.tensor, p.start, p.stop] for p in pieces] for pieces in self.shards],
        }, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Partition":
        """Parse and check a recorded partition; ValueError with one line if it is not one."""
        try:
            doc = json.loads(data)
            if doc.get("format") != PARTITION_FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            tensors = {str(n): (tuple(int(x) for x in t["shape"]), str(np.dtype(t["dtype"]).str))
                       for n, t in doc["tensors"].items()}
            shards = tuple(tuple(Piece(str(t), int(a), None if b is None else int(b)) for t, a, b in pieces)
                           for pieces in doc["shards"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not an hpcdl partition ({exc})") from None
        partition = cls(tensors, shards)
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
                covered[p.tensor].append((p.start, _rows(p, self.tensors) + p.start))
        for name, spans in covered.items():
            spans.sort()
            rows = self.tensors[name][0][0] if self.tensors[name][0] else 1
            contiguous = spans and spans[0][0] == 0 and spans[-1][1] == rows and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:]))
            if not contiguous:
                raise ValueError(f"not an hpcdl partition (tensor {name!r} is not covered exactly once)")

    def describe(self) -> dict[str, Any]:
        return {"shards": self.count, "bytes": self.shard_bytes(),
                "pieces": [len(pieces) for pieces in self.shards]}


def _row_bytes(spec: tuple[tuple[int, ...], str]) -> int:
    shape, dtype = spec
    return math.prod(shape[1:]) * np.dtype(dtype).itemsize


def _rows_of(spec: tuple[tuple[int, ...], str]) -> int:
    return spec[0][0] if spec[0] else 1


def _rows(piece: Piece, specs) -> int:
    if piece.stop is None:
        return _rows_of(specs[piece.tensor])
    return piece.stop - piece.start
