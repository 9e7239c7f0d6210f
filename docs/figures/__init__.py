"""The docs' pictures, each drawn by one module of this package from files kept in the repository.

`python -m docs.figures` (or `make docs`) redraws every PNG next to its source. A figure of
measurements reads the result JSON it names in `SOURCES` and says in its caption which machine
made it; the architecture diagram and the planner's figure are drawn from the code alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIGURES = Path(__file__).resolve().parent
RESULTS = REPO / "bench" / "results"


def load_result(name: str) -> dict[str, Any]:
    """A bench result by its path under bench/results/, with a message naming it if it moved."""
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is gone: point the figure's SOURCES at its new name (bench/results/INDEX.md)")
    return json.loads(path.read_text(encoding="utf-8"))


def save(fig, name: str) -> Path:
    """Write a figure as docs/figures/<name>.png with fixed metadata, so a redraw of unchanged
    inputs gives the same bytes."""
    from hpcdl.fs.files import atomic_path

    out = FIGURES / f"{name}.png"
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return out
