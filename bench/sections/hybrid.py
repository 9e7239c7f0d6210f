"""The hybrid race's quick run (scenarios a and b): time to validation AUC 0.90.

bench.hybrid_race --quick on scenarios a and b (8 ranks as 1×8 synchronous and as hybrid groups,
emulated stragglers, time to validation AUC 0.90), read back from its results file: its table's rows.
"""

from __future__ import annotations

import json
import subprocess

from bench.harness import REPO, RESULTS, Bench, BenchError, module_argv


def run(b: Bench) -> None:
    """The race (bench.hybrid_race), one seed of scenarios a and b, read back from its JSON."""
    suite = RESULTS / "race"
    before = set(suite.glob("*.json"))
    cmd = module_argv("hybrid_race", "--quick", "--scenarios", "a,b", "--work", str(b.work / "race"))
    with open(b.logdir / "hybrid_race.log", "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    new = sorted(set(suite.glob("*.json")) - before)
    if proc.returncode != 0 or not new:
        raise BenchError(f"hybrid_race.py failed ({proc.returncode}); see {b.logdir / 'hybrid_race.log'}")
    race = json.loads(new[-1].read_text())
    b.data["hybrid"] = {"race_file": str(new[-1]), "summary": race["summary"]}
    for sc, entry in race["summary"].items():
        for name, e in entry["configs"].items():
            first = e["targets"]["0.9"]
            t = first["time_s"]
            value = f"{t:.0f} s" if t else f"not reached (best {e['best_auc']:.3f})"
            ratio = f"{first['ratio_to_sync']:.2f}× sync" if first["ratio_to_sync"] else ""
            b.row(f"hybrid.{sc}.{name}", "hybrid", f"({sc}) {entry['scenario']}: {name}, time to AUC 0.9",
                  value, ratio, "emulated stragglers, 1 seed, untuned rates (--quick)", number=t)
