"""bench.race_maps: the heat maps' cells from emulated race summaries written here."""

from __future__ import annotations

import json
import math

from bench.race_maps import cells, label, main


def summary(per_seed: dict[int, dict[int, float | None]]) -> dict:
    """An emulated race summary of one scenario at N 8: groups -> seed -> time to loss 0.4."""
    return {"none/N8": {"configs": {str(g): {"targets": {"0.4": {"per_seed_s": {str(s): t for s, t in times.items()}}},
                                             "seeds": list(times)}
                                    for g, times in per_seed.items()}}}


def test_a_cell_is_the_median_ratio_and_a_missed_target_counts_as_slower(tmp_path):
    path = tmp_path / "race.json"
    path.write_text(json.dumps({"summary": summary({
        1: {0: 10.0, 1: 20.0, 2: None},
        2: {0: 5.0, 1: 30.0, 2: 8.0},  # ratios 0.5, 1.5, 0 (sync missed seed 2)
        8: {0: None, 1: None, 2: 9.0},  # ratios ∞, ∞, 0
    })}))
    grid = cells([path], "0.4")["none"]
    assert grid[(8, 1)] == {"ratio": 1.0, "seeds": 3, "reached": 2}
    assert grid[(8, 2)] == {"ratio": 0.5, "seeds": 3, "reached": 3}
    assert math.isinf(grid[(8, 8)]["ratio"]) and grid[(8, 8)]["reached"] == 1
    assert label(grid[(8, 2)], 2) == "0.50×\n3/3" and label(grid[(8, 8)], 8) == "✗\n1/3"
    assert main([str(path), "--target", "0.4"]) == 0
    assert (tmp_path / "race-map-none-0.4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
