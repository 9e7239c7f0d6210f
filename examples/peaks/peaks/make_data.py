"""Write a small synthetic data set: `python -m peaks.make_data --out data --examples 4000`.

Each example is a 16×16 single-channel image of noise with one Gaussian peak; the targets are the
peak's row and column (in pixels, 0..15) and its height. train.h5, val.h5 and test.h5 (80/10/10)
each hold `images` (N, 16, 16, 1) and `targets` (N, 3).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import h5py
import numpy as np

SIZE = 16


def examples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    row, col = rng.uniform(2, SIZE - 2, n), rng.uniform(2, SIZE - 2, n)
    height = rng.uniform(1.0, 4.0, n)
    grid = np.arange(SIZE)
    dr = grid[None, :, None] - row[:, None, None]
    dc = grid[None, None, :] - col[:, None, None]
    images = height[:, None, None] * np.exp(-(dr ** 2 + dc ** 2) / (2 * 1.5 ** 2))
    images += rng.normal(0.0, 0.3, images.shape)
    targets = np.stack([row, col, height], axis=1)
    return images[..., None].astype(np.float32), targets.astype(np.float32)


def write(out: Path, total: int, seed: int = 0) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": total * 8 // 10, "val": total // 10, "test": total - total * 8 // 10 - total // 10}
    files = {}
    for i, (split, n) in enumerate(sizes.items()):
        images, targets = examples(n, seed + i)
        files[split] = out / f"{split}.h5"
        with h5py.File(files[split], "w") as f:
            f.create_dataset("images", data=images, chunks=(min(n, 256), SIZE, SIZE, 1))
            f.create_dataset("targets", data=targets)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data"))
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, path in write(args.out, args.examples, args.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
