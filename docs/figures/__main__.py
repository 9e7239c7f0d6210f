"""Redraw every figure of the docs: `python -m docs.figures [NAME ...]`."""

import sys

import matplotlib

matplotlib.use("Agg")

from docs.figures import applier_shards, architecture, plan_vs_paper, step_peak  # noqa: E402

FIGURES = {m.NAME: m for m in (architecture, step_peak, applier_shards, plan_vs_paper)}


def main(names: list[str]) -> int:
    unknown = set(names) - set(FIGURES)
    if unknown:
        print(f"unknown figure(s) {', '.join(sorted(unknown))}; known: {', '.join(FIGURES)}", file=sys.stderr)
        return 2
    for name in names or FIGURES:
        print(FIGURES[name].draw())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
