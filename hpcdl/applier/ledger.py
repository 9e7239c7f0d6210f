"""The ledger: which (group, seq) updates the applier has processed, so none is applied twice."""

from __future__ import annotations

import bisect

import numpy as np


class Ledger:
    """Processed (group, seq) pairs, kept per group as sorted disjoint inclusive intervals."""

    def __init__(self) -> None:
        self._iv: dict[int, list[list[int]]] = {}

    def __contains__(self, key: tuple[int, int]) -> bool:
        group, seq = key
        ivs = self._iv.get(group, [])
        i = bisect.bisect_right(ivs, seq, key=lambda iv: iv[0])
        return i > 0 and ivs[i - 1][1] >= seq

    def add(self, group: int, seq: int) -> None:
        ivs = self._iv.setdefault(group, [])
        i = bisect.bisect_right(ivs, seq, key=lambda iv: iv[0])
        if i > 0 and ivs[i - 1][1] >= seq:
            return
        left = i > 0 and ivs[i - 1][1] == seq - 1
        right = i < len(ivs) and ivs[i][0] == seq + 1
        if left and right:
            ivs[i - 1][1] = ivs[i][1]
            del ivs[i]
        elif left:
            ivs[i - 1][1] = seq
        elif right:
            ivs[i][0] = seq
        else:
            ivs.insert(i, [seq, seq])

    def seen(self, group: int, seq: int) -> bool:
        """True for a processed pair and for any seq below the group's newest processed one.

        A group's updates are processed in seq order, so a lower seq arriving later is a replay
        (of a processed update, or of one the backlog bound deleted): never applied as new.
        """
        ivs = self._iv.get(group)
        return bool(ivs) and seq <= ivs[-1][1]

    def __len__(self) -> int:
        return sum(b - a + 1 for ivs in self._iv.values() for a, b in ivs)

    def last_seq(self) -> dict[int, int]:
        return {g: ivs[-1][1] for g, ivs in self._iv.items() if ivs}

    def pairs(self) -> list[tuple[int, int]]:
        return [(g, s) for g in sorted(self._iv) for a, b in self._iv[g] for s in range(a, b + 1)]

    def to_array(self) -> np.ndarray:
        rows = [(g, a, b) for g in sorted(self._iv) for a, b in self._iv[g]]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    @classmethod
    def from_array(cls, arr: np.ndarray) -> "Ledger":
        ledger = cls()
        for g, a, b in np.asarray(arr, dtype=np.int64).reshape(-1, 3).tolist():
            ledger._iv.setdefault(g, []).append([a, b])
        for ivs in ledger._iv.values():
            ivs.sort()
        return ledger
