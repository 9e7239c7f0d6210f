"""Physics-motivated synthetic RPV-SUSY vs QCD calorimeter images, in the NERSC RPV-SUSY layout.

The chain is read top to bottom in two modules: the events (hard process, showers, hadrons,
pile-up, jets and the selection, the detector: :mod:`hpcdl.workloads.hep.events`, whose docstring
is the physics) and the written files (here); `generate`, `simulate`, `selection`,
`gluino_xsec_fb` and `GeneratorConfig` are its interface.

The paper's HEP workload (Kurth et al., SC17, after Bhimji et al., "Deep neural networks for
physics analysis on low-level whole-detector data at the LHC") classifies whole-detector
calorimeter images: new-physics events with many jets against the overwhelming QCD multijet
background. The real samples (Pythia + Delphes) are not redistributable here, so this module
simulates events from their physics, keeping what makes the problem what it is. It is a toy
Monte Carlo, not a physics generator, but each ingredient has the right shape and sign.

File layout
-----------
``train.h5``, ``val.h5``, ``test.h5``, each with group ``all_events``: ``hist``, ``histEM``,
``histtrack`` (N, H, W) float32; ``y`` (N,) float32 (1 signal, 0 background); ``weight`` (N,)
float32 (expected events at ``lumi_fb``); ``passSR``, ``passSR4J``, ``passSR5J`` (N,) bool. Group
``truth`` holds the true high-level features (R = 0.4 jet count, fat-jet count, leading fat-jet
pT, M_J^Σ, Δη, HT, gluino mass, pT-hat and slice) for analysis. Generator parameters are
attributes of the root group (``config`` holds the full :class:`GeneratorConfig` as JSON). Files
are written in chunks (bounded memory for any N) to a temporary name and renamed into place when
complete; the output is a deterministic function of the arguments (given the numpy version).

Validation (24k events, 64×64, a 4-layer CNN trained 4–10 minutes on 2 cores, two seeds): test
AUC ≈ 0.995 weighted, 0.965–0.985 unweighted (≈ 0.85 after the first epoch); the selection keeps
≈ 40 % of the weighted signal at a weighted background efficiency of ≈ 2.5e-3, where the CNN
keeps 60–88 %. No single image sum (energy,
tracks) comes close to the selection; the true jet multiplicity is the strongest single variable
the cuts leave out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import h5py
import numpy as np

from hpcdl.workloads.common import SPLITS, check_seed, check_splits, is_int, write_splits
from hpcdl.workloads.hep.events import (
    ETA_MAX, TRUTH_FEATURES, GeneratorConfig, gluino_xsec_fb, selection, simulate, slice_xsec_fb,
)

__all__ = ["GeneratorConfig", "SPLITS", "generate", "gluino_xsec_fb", "selection", "simulate"]

GENERATOR_VERSION = 1
MIN_EVENTS = 10
MIN_IMAGE_SIZE = 8
MAX_IMAGE_SIZE = 512
CHUNK_EVENTS = 1000


# --------------------------------------------------------------------------------------------------
# files


def _check_args(events, image_size, seed, fractions, signal_fraction):
    if not is_int(events) or events < MIN_EVENTS:
        raise ValueError(f"events must be an integer >= {MIN_EVENTS}, got {events!r}")
    if not is_int(image_size) or not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
        raise ValueError(
            f"image_size must be an integer in [{MIN_IMAGE_SIZE}, {MAX_IMAGE_SIZE}], got {image_size!r}"
        )
    check_seed(seed)
    fr, sizes = check_splits(events, fractions, "events")
    sf = signal_fraction
    if isinstance(sf, bool) or not isinstance(sf, (int, float)) or not 0.0 < sf < 1.0:
        raise ValueError(f"signal_fraction must be in (0, 1), got {signal_fraction!r}")
    return fr, sizes


def _balanced(rng, n: int, k: int) -> np.ndarray:
    """``n`` values in ``range(k)``, each ``n // k`` or one more times, in random order."""
    return rng.permutation(np.arange(n) % k)


def _write_split(path: Path, name: str, split_index: int, n: int, image_size: int, seed: int,
                 signal_fraction: float, cfg: GeneratorConfig, attrs: dict,
                 progress: Optional[Callable[[int], None]]) -> None:
    rng = np.random.default_rng([seed, split_index, 0])
    n_sig = min(max(int(round(n * signal_fraction)), 0), n)
    is_signal = rng.permutation(np.arange(n) < n_sig)
    # each signal mass point / QCD slice gets an equal share of its class; weight = σ L / count
    masses = np.asarray(cfg.gluino_masses, float)
    point = np.zeros(n, np.int64)
    point[is_signal] = _balanced(rng, n_sig, masses.size)
    slices = np.zeros(n, np.int64)
    n_slices = len(cfg.pthat_slices) - 1
    slices[~is_signal] = _balanced(rng, n - n_sig, n_slices)
    weight = np.zeros(n)
    sig_count = np.bincount(point[is_signal], minlength=masses.size)
    sig_w = gluino_xsec_fb(masses, cfg) * cfg.lumi_fb / np.maximum(sig_count, 1)
    bkg_count = np.bincount(slices[~is_signal], minlength=n_slices)
    bkg_w = slice_xsec_fb(cfg) * cfg.lumi_fb / np.maximum(bkg_count, 1)
    weight[is_signal] = sig_w[point[is_signal]]
    weight[~is_signal] = bkg_w[slices[~is_signal]]
    m_gluino = np.where(is_signal, masses[point], 0.0)

    h = w = image_size
    rows = max(1, min(n, (1 << 21) // (h * w * 4)))  # HDF5 chunks of ~2 MB
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        f.attrs["split"] = name
        f.attrs["events"] = n
        f.attrs["signal_events"] = n_sig
        g = f.create_group("all_events")
        img = dict(shape=(n, h, w), dtype=np.float32, chunks=(rows, h, w), compression="gzip",
                   compression_opts=1, shuffle=True)
        for key in ("hist", "histEM", "histtrack"):
            g.create_dataset(key, **img)
        g["hist"].attrs["unit"] = "GeV"
        g["histEM"].attrs["unit"] = "GeV"
        g["histtrack"].attrs["unit"] = "tracks"
        g.create_dataset("y", data=is_signal.astype(np.float32))
        g.create_dataset("weight", data=weight.astype(np.float32))
        flags = {k: g.create_dataset(k, shape=(n,), dtype=bool) for k in ("passSR", "passSR4J", "passSR5J")}
        t = f.create_group("truth")
        t.create_dataset("m_gluino", data=m_gluino.astype(np.float32))
        t.create_dataset("pthat_slice", data=np.where(is_signal, -1, slices).astype(np.int8))
        truth = {k: t.create_dataset(k, shape=(n,), dtype=np.float32) for k in TRUTH_FEATURES + ("pthat",)}
        for c, lo in enumerate(range(0, n, CHUNK_EVENTS)):
            hi = min(lo + CHUNK_EVENTS, n)
            crng = np.random.default_rng([seed, split_index, 1, c])
            ev = simulate(crng, is_signal[lo:hi], m_gluino[lo:hi], slices[lo:hi], image_size, cfg)
            for key in ("hist", "histEM", "histtrack"):
                g[key][lo:hi] = ev[key]
            for key, ds in flags.items():
                ds[lo:hi] = ev[key]
            for key, ds in truth.items():
                ds[lo:hi] = ev[key]
            del ev
            if progress is not None:
                progress(hi - lo)


def generate(
    out_dir: Path,
    events: int,
    image_size: int = 64,
    seed: int = 0,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    signal_fraction: float = 0.5,
    progress: Optional[Callable[[int], None]] = None,
    config: GeneratorConfig = GeneratorConfig(),
) -> Dict[str, Path]:
    """Write ``train.h5``, ``val.h5`` and ``test.h5`` with ``events`` events in total into ``out_dir``.

    ``fractions`` splits the events (train, val, test); each split has exactly
    ``round(signal_fraction × n)`` signal events. ``progress(k)`` is called after each chunk of
    ``k`` events is written. Returns ``{"train": path, "val": path, "test": path}``. Raises
    ValueError for bad arguments. Deterministic for given arguments.
    """
    fr, sizes = _check_args(events, image_size, seed, fractions, signal_fraction)
    attrs = {
        "layout": "nersc-rpv-susy",
        "generator": "hpcdl.workloads.hep.generate",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "image_size": image_size,
        "total_events": events,
        "fractions": np.asarray(fr),
        "signal_fraction": float(signal_fraction),
        "eta_range": np.array([-ETA_MAX, ETA_MAX]),
        "phi_range": np.array([-np.pi, np.pi]),
        "config": config.to_json(),
    }
    return write_splits(out_dir, sizes, lambda tmp, name, i, n, report: _write_split(
        tmp, name, i, n, image_size, seed, float(signal_fraction), config, attrs, report), progress)
