"""Two installations side by side: the engine's HEP training step (bench.probe's "tf" role, set up
as a rank is) in one venv against another's, e.g. the TensorFlow 2.21 stack against the 2.16 one
it replaced.

One probe process per installation, both on this machine, used one after the other: each round
times `--steps` steps of each (who goes first alternates), at each --image size, batch --batch.
The figure is the median over rounds of the ratio B / A in steps per second, with its range.

    python -m bench.stack_compare --a /old/venv/bin/python --b .venv/bin/python [--rounds 5]

Writes bench/results/stacks/<date>-<machine>.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.harness import Probe, machine, result_path, write_result

SUITE = "stacks"


def compare(pythons: dict[str, str], images: list[int], batch: int, rounds: int, steps: int, work: Path) -> list[dict]:
    rows = []
    for image in images:
        probes = {k: Probe(f"stack-{k}-{image}", ["--role", "tf", "--image", str(image)], work, python=py)
                  for k, py in pythons.items()}
        try:
            for probe in probes.values():
                probe.ask(op="setup", batches=[batch])
            medians: dict[str, list[float]] = {k: [] for k in probes}
            for r in range(rounds):
                for k in (list(probes) if r % 2 == 0 else list(probes)[::-1]):
                    medians[k].append(statistics.median(probes[k].ask(op="step", batch=batch, n=steps)["seconds"]))
            ratios = [a / b for a, b in zip(medians["a"], medians["b"])]  # B's speed / A's
            rows.append({"image": image, "batch": batch, "round_medians_s": medians,
                         "tf": {k: p.info["tf"] for k, p in probes.items()},
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
            print(render(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for probe in probes.values():
                probe.close()
    return rows


def render(row: dict) -> str:
    ms = {k: 1e3 * statistics.median(v) for k, v in row["round_medians_s"].items()}
    return (f"HEP step {row['image']}x{row['image']}, batch {row['batch']}: TensorFlow {row['tf']['a']} "
            f"{ms['a']:.0f} ms, {row['tf']['b']} {ms['b']:.0f} ms; B {row['ratio_median']:.2f}x A's speed "
            f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="the first installation's python")
    ap.add_argument("--b", default=sys.executable, help="the second's (default: this one)")
    ap.add_argument("--images", default="64,224")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-bench"))
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    began = time.time()
    rows = compare({"a": args.a, "b": args.b}, [int(i) for i in args.images.split(",")], args.batch,
                   args.rounds, args.steps, args.work)
    result = {"pythons": {"a": args.a, "b": args.b}, "rounds": args.rounds, "steps": args.steps, "rows": rows,
              "seconds": time.time() - began, "machine": machine()}
    path = write_result(result_path(SUITE, result["machine"]), result)
    print("\n".join(render(r) for r in rows))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
