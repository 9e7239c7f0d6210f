"""Do unlabelled images help? The climate workload with and without its reconstruction loss.

The paper (after Racah et al., NIPS 2017) trains the extreme-weather detector semi-supervised: a
decoder reconstructs every image, labelled or not, and the reconstruction loss shapes the shared
encoder. This script measures that claim on the synthetic data, side by side, on the same files
and the same number of steps, through the real `hpcdl submit` / `hpcdl evaluate` commands:

* **semi-supervised**: model.reconstruction_weight = W (default 1); each batch holds
  data.labelled_share (default 0.5) labelled images and the rest unlabelled ones; the detection
  loss sees the labelled ones, the reconstruction loss all of them.
* **supervised only**: model.reconstruction_weight = 0; batches hold labelled images alone (the
  unlabelled ones are never read) and the decoder is not run.

Both use the same batch size, steps, learning rate, seed and test file, so the supervised run sees
more labelled images per step (all of its batch) and the semi-supervised run pays for a decoder:
that is the trade the method makes, and it is what is measured. For fewer labels than the data
set has, `--labelled-fractions` makes label-subset views of the training file (an HDF5 file whose
`images` is an external link to the original, with its own `boxes` and `labelled`): the images
stay the same, only a random subset of the labelled ones keeps its labels.

Usage (generates the data into --work if --data is not given):

    python -m bench.climate_semisupervised [--data DIR] [--steps 300] [--labelled-fractions 0.2,0.05]

Prints a table (and with `--json FILE` writes the numbers there). Single runs are noisy: use --seeds 0,1,2 for spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

from bench.harness import HPCDL
from bench.local_runs import metrics as group_metrics


def label_subset(train: Path, fraction: float, out: Path, seed: int = 0) -> Path:
    """A view of `train` where only `fraction` of all images (a random subset of its labelled
    ones) keeps its boxes: `images` is an external link, nothing large is copied."""
    with h5py.File(train, "r") as f:
        n = f["images"].shape[0]
        boxes = f["boxes"][...]
        labelled = f["labelled"][...] if "labelled" in f else (boxes[:, :, 4] >= 0).any(axis=1)
    have = np.flatnonzero(labelled)
    want = int(round(fraction * n))
    if want > len(have):
        raise SystemExit(f"{train} has {len(have)} labelled images ({len(have) / n:.1%}); "
                         f"cannot keep {fraction:.1%}")
    keep = np.sort(np.random.default_rng(seed).choice(have, size=want, replace=False))
    new_lab = np.zeros(n, bool)
    new_lab[keep] = True
    new_boxes = np.full_like(boxes, -1)
    new_boxes[keep] = boxes[keep]
    tmp = out.with_name(out.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f["images"] = h5py.ExternalLink(str(Path(train).resolve()), "/images")
        f["boxes"] = new_boxes
        f["labelled"] = new_lab
    os.replace(tmp, out)
    return out


def run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def train_and_evaluate(work: Path, train: Path, test: Path, steps: int, batch: int, nodes: int,
                       weight: float, share: float, seed: int) -> dict:
    sets = {
        "data.train": f'"{train}"', "data.val": f'"{test}"', "data.test": f'"{test}"',
        "train.steps": steps, "train.batch_per_rank": batch, "train.seed": seed,
        "train.checkpoint_every": steps, "train.log_every": max(1, steps // 10),
        "model.reconstruction_weight": weight, "data.labelled_share": share,
        "run.runs_dir": f'"{work / "runs"}"',
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    t0 = time.perf_counter()
    submitted = json.loads(run([HPCDL, "submit", "climate", "--backend", "local", "--nodes", str(nodes),
                                "--json", *args], work))
    wall = time.perf_counter() - t0
    run_dir = Path(submitted["run_dir"])
    metrics = group_metrics(run_dir, 0)
    result = json.loads(run([HPCDL, "evaluate", str(run_dir), "--json"], work))
    return {
        "run": str(run_dir), "submit_wall_s": wall,
        "images_per_s": float(np.mean([m["images_per_s"] for m in metrics[1:]] or [metrics[-1]["images_per_s"]])),
        "final_loss": metrics[-1]["loss"],
        **{k: v for k, v in result.items() if k.startswith(("map_", "ap50_", "ap10_")) or k == "n_images"},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="directory with train.h5 and test.h5 (default: generate into --work)")
    p.add_argument("--work", type=Path, default=Path("bench-climate"), help="scratch directory (runs, label views, data)")
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--width", type=int, default=144)
    p.add_argument("--labelled-fractions", default="0.2", help="comma-separated fractions of the training images that keep labels")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--weight", type=float, default=1.0, help="reconstruction weight of the semi-supervised run")
    p.add_argument("--share", type=float, default=0.5, help="labelled share of a semi-supervised batch")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers as JSON to FILE")
    a = p.parse_args()

    a.work.mkdir(parents=True, exist_ok=True)
    work = a.work.resolve()
    fractions = [float(f) for f in a.labelled_fractions.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    data = a.data
    if data is None:
        data = work / "data"
        if not (data / "test.h5").is_file():
            from hpcdl.workloads.climate.generate import generate

            print(f"generating {a.images} images of 16×{a.height}×{a.width} into {data} ...", file=sys.stderr)
            generate(data, a.images, a.height, a.width, labelled_fraction=max(fractions), seed=0)
    data = data.resolve()
    rows = []
    for frac in fractions:
        train = label_subset(data / "train.h5", frac, work / f"train-labelled-{frac:g}.h5")
        for seed in seeds:
            for mode, weight in (("semi-supervised", a.weight), ("supervised only", 0.0)):
                print(f"labelled {frac:g}, seed {seed}: {mode} ...", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                r = train_and_evaluate(work, train, data / "test.h5", a.steps, a.batch, a.nodes, weight,
                                       a.share, seed)
                r.update(mode=mode, reconstruction_weight=weight, labelled_fraction=frac, seed=seed,
                         wall_s=time.perf_counter() - t0)
                rows.append(r)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    print_table(rows, f"climate detector, {a.steps} steps × batch {a.batch} × {a.nodes} rank(s), "
                      f"test file {data / 'test.h5'}")
    return 0


def print_table(rows: list[dict], title: str) -> None:
    def fmt(v):
        return "  -  " if v is None else f"{v:.3f}"

    print(f"\n{title}")
    head = (f"{'labelled':>8} {'seed':>4}  {'mode':<16} {'mAP@0.5':>7} {'mAP@0.1':>7}   {'AP50 TD':>7} "
            f"{'TC':>5} {'ETC':>5} {'AR':>5}   {'img/s':>6} {'wall s':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['labelled_fraction']:>8.3g} {r['seed']:>4}  {r['mode']:<16} {fmt(r['map_50']):>7} "
              f"{fmt(r['map_10']):>7}   {fmt(r['ap50_TD']):>7} {fmt(r['ap50_TC']):>5} {fmt(r['ap50_ETC']):>5} "
              f"{fmt(r['ap50_AR']):>5}   {r['images_per_s']:>6.1f} {r['wall_s']:>6.0f}")
    fractions = sorted({r["labelled_fraction"] for r in rows}, reverse=True)
    for frac in fractions:
        for mode in ("semi-supervised", "supervised only"):
            vals = [r["map_50"] for r in rows if r["labelled_fraction"] == frac and r["mode"] == mode]
            if len(vals) > 1:
                print(f"labelled {frac:g}, {mode}: mAP@0.5 mean {np.mean(vals):.3f} ± "
                      f"{np.std(vals, ddof=1):.3f} (sample std) over {len(vals)} seeds")

if __name__ == "__main__":
    sys.exit(main())
