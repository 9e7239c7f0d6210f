"""Physically plausible synthetic climate fields with extreme-weather events, in the ExtremeWeather layout.

One module, read top to bottom, because it is one chain: background fields, storms placed and
grown, their boxes, the written files; `generate`, `simulate_image`, `orography` and
`GeneratorConfig` are its interface.

The paper's climate workload (Kurth et al., SC17, after Racah et al., "ExtremeWeather: A large-scale
climate dataset for semi-supervised detection, localization, and understanding of extreme weather
events", NIPS 2017) finds and boxes extreme weather in snapshots of a CAM5 climate simulation: 16
global fields on a 768×1152 latitude-longitude grid, labelled by the TECA heuristics. The real data
are terabytes; this module simulates snapshots from the physics the detector has to see. It is a
toy, not a climate model, but every field has the right units, magnitude, latitude structure and
sign of response to each event, and the fields are mutually consistent (derived from one another
by the hydrostatic, hypsometric, geostrophic / gradient-wind and Clausius-Clapeyron relations).

Grid
----
An image covers the globe: rows are latitude from the South Pole (row 0) to the North Pole, columns
longitude eastward from 0° (periodic). A pixel is 180/H degrees of latitude by 360/W of longitude
(0.23° × 0.31° ≈ 25 km at 768×1152; 1.9° × 2.5° ≈ 210 km at 96×144). Distances for the event
physics are great-circle-like: rows × km per degree, columns × km per degree × cos(latitude).

Background state
----------------
Each snapshot has a random season s ∈ [−1, 1] shifting the thermal equator and the ITCZ by 6° s.

* Surface temperature TS ≈ 300.5 − 50 sin²(φ − φ_s) K (≈ 300 K at the equator, 250 K at the poles)
  plus smooth synoptic noise (1.5 K); reference-height temperature TREFHT = TS − 1.2 K ± 0.5 K.
* Mid and upper troposphere: T500 = 232 + 36 cos²φ K, T200 = 223 − 8 cos²φ K (the tropical
  tropopause is the coldest), with noise, and a baroclinic T500 anomaly of 1.5 K per 1000 Pa of
  the pressure eddies.
* Sea-level pressure PSL: 101 325 Pa with subtropical highs (+900 Pa at ±30°) and subpolar lows
  (−1400 Pa at ±62°), plus synoptic eddies (smooth noise with a ~1500 km scale; ~150 Pa in the
  tropics, ~850 Pa in the storm tracks at ±50°).
* Winds at 850 hPa: a zonal mean u = −6 cos 3φ + 8 exp(−((|φ| − 45°)/15°)²) m/s (trade easterlies,
  mid-latitude westerlies, polar easterlies), plus the geostrophic wind of the pressure eddies
  (u' = −∂p'/∂y / ρf, v' = ∂p'/∂x / ρf, with |f| held at its 15° value nearer the equator and
  the eddy wind fading linearly in sin φ to zero at the equator, where geostrophy fails).
  Lowest-level winds UBOT, VBOT are the 850 hPa winds slowed to 65 % by surface friction and turned
  20° toward low pressure (counter-clockwise in the north, clockwise in the south).
* Orography: one fixed random planet per seed (about 30 % land, mostly below 2 km,
  peaks up to 4.5 km); surface pressure
  PS = PSL exp(−z_s / (R T / g)) (hypsometric).
* Moisture: relative humidity 0.75 ± 0.08 (smooth noise); QREFHT = RH × q_sat(TREFHT, PS) with
  the Magnus formula; precipitable water TMQ = 55 exp(0.07 (TS − 300)) (RH / 0.75) kg m⁻²
  (Clausius-Clapeyron, ~7 % per K: ~55 in the tropics, a few at the poles).
* Precipitation PRECT (m s⁻¹): an ITCZ band (9e-8 ≈ 8 mm/day) and storm-track bands (4e-8), times
  smooth log-normal intermittency.
* Geopotential heights (m): ZBOT, the lowest model level at σ = 0.9926, is (R T_v / g) ln(1/σ) ≈ 60 m;
  Z1000 = (R T_v / g) ln(PSL / 1000 hPa) (≈ 8 m per hPa); Z200 = Z1000 + (R T̄ / g) ln 5 with
  T̄ = 0.25 TREFHT + 0.45 T500 + 0.30 T200, so warm cores lift and cold cores lower Z200.

Events and their boxes
----------------------
Events are added to the primitive fields (PSL, TS, T500, T200, winds, RH, TMQ, PRECT) before the
derived ones are computed, so every channel responds consistently. Cyclones have a Gaussian
pressure deficit Δp exp(−d²/2r²) and the gradient wind balancing it,
v = −|f|d/2 + √(f²d²/4 + (d/ρ) ∂p/∂d), rotating counter-clockwise in the north and clockwise in
the south. Per class (sizes and intensities drawn uniformly in the ranges of :class:`GeneratorConfig`):

* **0 TD, tropical depression**: 5–22° latitude, r 120–220 km, Δp 2.5–7 hPa (winds ≲ 17 m/s),
  a weak warm core (T500 +0.9–1.5 K), a moist core (TMQ +5 to +8 kg m⁻²) and moderate rain.
* **1 TC, tropical cyclone**: 8–30°, r 120–250 km, Δp 15–60 hPa (winds 30–60 m/s), a warm core
  aloft (T500 +0.8 K per 10 hPa, T200 +0.5 K per 10 hPa), a near-saturated moist core (TMQ +12 to +26 kg m⁻²)
  and intense rain (up to ~130 mm/day) in spiral bands, a slight cold wake at the surface.
* **2 ETC, extratropical cyclone**: 35–65°, r 450–850 km, Δp 10–35 hPa (winds 15–35 m/s), a cold
  core aloft tilted westward (T500 −2 to −5 K), a surface thermal dipole (warm sector east, cold
  air west), and a comma-shaped frontal band of rain and moisture trailing equatorward.
* **3 AR, atmospheric river**: centred at 22–48°, a long narrow filament 2500–5000 km by
  150–280 km (Gaussian half-width), slightly curved, oriented poleward-eastward (15–45° from east,
  north-east in the north, south-east in the south), with TMQ +12 to +28 kg m⁻², a low-level jet
  of 10–20 m/s along it carrying the moisture, and rain enhanced over land (orographic lift).

Counts per image are Poisson (means 0.8 TD, 0.8 TC, 1.5 ETC, 0.8 AR; at most 15 events). An
event's box is the bounding box of its footprint — the pixels where its own signature (pressure
deficit for cyclones, moisture anomaly for rivers) exceeds 10 % of its peak — as TECA's
closed-contour extents; boxes are whole pixels, [ymin, xmin, ymax, xmax) edges. Placements whose
boxes would overlap another box, wrap around the date line or touch a pole are redrawn.

At coarse resolutions cyclone radii are held to at least ``min_radius_px`` pixels (2 by default,
a box of about 9 pixels): a real tropical cyclone's box (~1000 km) would be 4–5 pixels wide at
96×144, too small for a stride-8 detector. Larger images are not affected.

Labels and files
----------------
``generate`` writes ``train.h5``, ``val.h5`` and ``test.h5`` (80/10/10 % of the images; each file
plays the role of one year of the published set) with datasets ``images`` float32 (N, 16, H, W)
in the order of :data:`~hpcdl.workloads.climate.data.CHANNELS`, ``boxes`` int32 (N, 15, 5)
[ymin, xmin, ymax, xmax, class] padded with −1, and ``labelled`` bool (N,). In ``train.h5`` only a
fraction ``labelled_fraction`` of the images (chosen at random, exactly round(F × N)) keeps its
boxes; the others have boxes all −1 and ``labelled`` False — the unlabelled part. ``labelled``
tells an unlabelled image from a labelled one with no event. Validation and test files are fully
labelled. The group ``truth`` holds every image's true boxes (``truth/boxes``, labelled or not) for
analysis; readers ignore it. Channel units are in ``images.attrs``; generator parameters are root
attributes (``config`` as JSON). Files are written in chunks of images (bounded memory), HDF5
chunks of one image, uncompressed (the fields are noisy floats), to a temporary name renamed into
place when complete; the output is a deterministic function of the arguments (given numpy).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import h5py
import numpy as np

from hpcdl.workloads.climate.data import CHANNELS, CLASSES, MAX_BOXES
from hpcdl.workloads.common import SPLITS, check_seed, check_splits, is_int, write_splits

__all__ = ["GeneratorConfig", "SPLITS", "generate", "simulate_image"]

GENERATOR_VERSION = 1
MIN_IMAGES = 10
MIN_SIZE, MAX_SIZE = 16, 4096
CHUNK_BYTES = 64 << 20

UNITS = {"PRECT": "m/s", "PS": "Pa", "PSL": "Pa", "QREFHT": "kg/kg", "T200": "K", "T500": "K",
         "TMQ": "kg/m2", "TREFHT": "K", "TS": "K", "U850": "m/s", "UBOT": "m/s", "V850": "m/s",
         "VBOT": "m/s", "Z1000": "m", "Z200": "m", "ZBOT": "m"}

KM_PER_DEG = 111.2
OMEGA = 7.292e-5
RHO = 1.2  # kg/m3, boundary-layer air
RD_G = 287.04 / 9.81  # R/g, m/K
TD, TC, ETC, AR = range(4)


@dataclass(frozen=True)
class GeneratorConfig:
    """Event climatology (latitudes in degrees, sizes in km, pressures in Pa)."""

    mean_counts: Tuple[float, float, float, float] = (0.8, 0.8, 1.5, 0.8)  # TD, TC, ETC, AR
    td_lat: Tuple[float, float] = (5.0, 22.0)
    td_radius_km: Tuple[float, float] = (120.0, 220.0)
    td_dp: Tuple[float, float] = (250.0, 700.0)
    tc_lat: Tuple[float, float] = (8.0, 30.0)
    tc_radius_km: Tuple[float, float] = (120.0, 250.0)
    tc_dp: Tuple[float, float] = (1500.0, 6000.0)
    etc_lat: Tuple[float, float] = (35.0, 65.0)
    etc_radius_km: Tuple[float, float] = (450.0, 850.0)
    etc_dp: Tuple[float, float] = (1000.0, 3500.0)
    ar_lat: Tuple[float, float] = (22.0, 48.0)
    ar_length_km: Tuple[float, float] = (2500.0, 5000.0)
    ar_width_km: Tuple[float, float] = (150.0, 280.0)
    ar_tmq: Tuple[float, float] = (12.0, 28.0)
    ar_jet: Tuple[float, float] = (10.0, 20.0)
    ar_angle_deg: Tuple[float, float] = (15.0, 45.0)
    min_radius_px: float = 2.0
    footprint: float = 0.1  # box = where the event's signature exceeds this fraction of its peak
    eddy_km: float = 1500.0
    land_fraction: float = 0.3

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


# --------------------------------------------------------------------------------------------------
# helpers


def _smooth_noise(rng: np.random.Generator, h: int, w: int, sigma_y: float, sigma_x: float) -> np.ndarray:
    """Unit-variance Gaussian-filtered white noise, periodic in x (longitude), not in y."""
    hh = 2 * h  # doubled in latitude so the poles are not correlated through the periodic FFT
    white = rng.standard_normal((hh, w))
    ky = np.fft.fftfreq(hh)[:, None] * 2 * np.pi
    kx = np.fft.rfftfreq(w)[None, :] * 2 * np.pi
    transfer = np.exp(-0.5 * ((ky * sigma_y) ** 2 + (kx * sigma_x) ** 2))
    f = np.fft.irfft2(np.fft.rfft2(white) * transfer, s=(hh, w))[:h]
    sd = f.std()
    return f / sd if sd > 0 else f


class _Grid:
    def __init__(self, h: int, w: int):
        self.h, self.w = h, w
        self.dlat, self.dlon = 180.0 / h, 360.0 / w
        self.lat = -90.0 + (np.arange(h) + 0.5) * self.dlat  # degrees, row 0 = south
        self.phi = np.deg2rad(self.lat)[:, None]  # (h, 1)
        self.km_y = KM_PER_DEG * self.dlat
        self.km_x = KM_PER_DEG * self.dlon * np.cos(self.phi)  # (h, 1)
        self.rows = np.arange(h)[:, None] + 0.5
        self.cols = np.arange(w)[None, :] + 0.5

    def row_of(self, lat: float) -> float:
        return (lat + 90.0) / self.dlat

    def offsets_km(self, y0: float, x0: float) -> Tuple[np.ndarray, np.ndarray]:
        """(northward, eastward) km from the point (row y0, col x0), longitude wrapped."""
        dy = (self.rows - y0) * self.km_y
        dc = (self.cols - x0 + self.w / 2) % self.w - self.w / 2
        lat0 = math.radians(-90.0 + y0 * self.dlat)
        dx = dc * KM_PER_DEG * self.dlon * max(math.cos(lat0), 0.05)
        return np.broadcast_to(dy, (self.h, self.w)), np.broadcast_to(dx, (self.h, self.w))

    def ddx(self, f: np.ndarray) -> np.ndarray:
        """∂f/∂x per metre (periodic); the metric is floored at 60° so that noise drawn isotropic in
        pixels does not turn into polar gales."""
        km_x = np.maximum(self.km_x, 0.5 * KM_PER_DEG * self.dlon)
        return (np.roll(f, -1, axis=1) - np.roll(f, 1, axis=1)) / (2 * km_x * 1000.0)

    def ddy(self, f: np.ndarray) -> np.ndarray:
        return np.gradient(f, axis=0) / (self.km_y * 1000.0)


def orography(seed: int, h: int, w: int, land_fraction: float = 0.3) -> np.ndarray:
    """Surface height (m) of the fixed random planet of ``seed``: one per data set."""
    rng = np.random.default_rng([seed, 7])
    n = _smooth_noise(rng, h, w, h / 18, w / 18)
    level = np.quantile(n, 1.0 - land_fraction)
    return np.where(n > level, np.minimum(1500.0 * (n - level), 4500.0), 0.0)


def _q_sat(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    e = 611.2 * np.exp(17.67 * (t - 273.15) / (t - 29.65))
    return 0.622 * e / np.maximum(p - 0.378 * e, 1.0)


# --------------------------------------------------------------------------------------------------
# one snapshot


class _Fields:
    """The primitive fields an image is built from; events add to them."""

    def __init__(self, rng: np.random.Generator, g: _Grid, z_s: np.ndarray):
        h, w = g.h, g.w
        phi = g.phi
        alat = np.abs(np.rad2deg(phi))
        self.season = float(rng.uniform(-1.0, 1.0))
        shift = math.radians(6.0 * self.season)
        ey, ex = 1500.0 / g.km_y, 1500.0 / (KM_PER_DEG * g.dlon)  # synoptic scale in pixels
        ey, ex = max(ey * 0.5, 1.0), max(ex * 0.5, 1.0)
        noise = lambda: _smooth_noise(rng, h, w, ey, ex)  # noqa: E731

        eddy_amp = 150.0 + 700.0 * np.exp(-(((alat - 50.0) / 15.0) ** 2))
        p_eddy = eddy_amp * noise()
        self.psl = (101325.0 + 900.0 * np.exp(-(((alat - 30.0) / 12.0) ** 2))
                    - 1400.0 * np.exp(-(((alat - 62.0) / 10.0) ** 2)) + p_eddy)
        self.ts = 300.5 - 50.0 * np.sin(phi - shift) ** 2 + 1.5 * noise()
        self.t500 = 232.0 + 36.0 * np.cos(phi) ** 2 + 0.0015 * p_eddy + 0.7 * noise()
        self.t200 = 223.0 - 8.0 * np.cos(phi) ** 2 + 0.5 * noise()
        f = 2 * OMEGA * np.sin(phi)
        f = np.where(np.abs(f) < 2 * OMEGA * math.sin(math.radians(15)),
                     np.where(phi >= 0, 1.0, -1.0) * 2 * OMEGA * math.sin(math.radians(15)), f)
        ubar = -6.0 * np.cos(3 * phi) + 8.0 * np.exp(-(((alat - 45.0) / 15.0) ** 2))
        # geostrophy fails at the equator: the eddies' wind fades out equatorward of 15°
        fade = np.minimum(np.abs(np.sin(phi)) / math.sin(math.radians(15)), 1.0)
        self.u = ubar - fade * g.ddy(p_eddy) / (RHO * f) + 0.8 * noise()
        self.v = fade * g.ddx(p_eddy) / (RHO * f) + 0.8 * noise()
        self.rh = 0.75 + 0.08 * noise()
        itcz = math.degrees(shift)
        intermittency = np.exp(0.9 * _smooth_noise(rng, h, w, ey / 3, ex / 3) - 0.4)
        self.prect = (1e-8 + 9e-8 * np.exp(-(((np.rad2deg(phi) - itcz) / 7.0) ** 2))
                      + 4e-8 * np.exp(-(((alat - 45.0) / 10.0) ** 2))) * intermittency
        self.dtmq = np.zeros((h, w))
        self.trefht_noise = 0.5 * noise()
        self.z_s = z_s
        self.grid = g
        self.land = z_s > 0

    def channels(self) -> np.ndarray:
        g = self.grid
        ts = self.ts
        trefht = ts - 1.2 + self.trefht_noise
        psl = self.psl
        ps = psl * np.exp(-self.z_s / (RD_G * trefht))
        rh = np.clip(self.rh, 0.05, 1.0)
        q = rh * _q_sat(trefht, ps)
        tv = trefht * (1.0 + 0.61 * q)
        tmq = np.maximum(55.0 * np.exp(0.07 * (ts - 300.0)) * rh / 0.75 + self.dtmq, 0.2)
        zbot = RD_G * tv * math.log(1.0 / 0.9926)
        z1000 = RD_G * tv * np.log(psl / 1.0e5)
        tbar = 0.25 * trefht + 0.45 * self.t500 + 0.30 * self.t200
        z200 = z1000 + RD_G * tbar * math.log(5.0)
        beta = math.radians(20.0) * np.where(g.phi >= 0, 1.0, -1.0)
        ubot = 0.65 * (self.u * np.cos(beta) - self.v * np.sin(beta))
        vbot = 0.65 * (self.u * np.sin(beta) + self.v * np.cos(beta))
        out = {
            "PRECT": np.maximum(self.prect, 0.0), "PS": ps, "PSL": psl, "QREFHT": q,
            "T200": self.t200, "T500": self.t500, "TMQ": tmq, "TREFHT": trefht, "TS": ts,
            "U850": self.u, "UBOT": ubot, "V850": self.v, "VBOT": vbot, "Z1000": z1000,
            "Z200": z200, "ZBOT": zbot,
        }
        shape = (g.h, g.w)
        return np.stack([np.broadcast_to(out[c], shape) for c in CHANNELS]).astype(np.float32)


def _uniform(rng, lo_hi) -> float:
    return float(rng.uniform(*lo_hi))


def _footprint_box(mask: np.ndarray) -> Optional[Tuple[int, int, int, int]]:
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    if not rows.size:
        return None
    h, w = mask.shape
    if rows[0] == 0 or rows[-1] == h - 1:
        return None  # touches a pole
    if cols[0] == 0 or cols[-1] == w - 1 or cols[-1] - cols[0] + 1 > w // 2:
        return None  # wraps around the date line
    return int(rows[0]), int(cols[0]), int(rows[-1]) + 1, int(cols[-1]) + 1


def _cyclone(fl: _Fields, rng, kind: int, cfg: GeneratorConfig):
    """Draw a cyclone of class ``kind``; returns (box, apply) or None if it does not fit."""
    g = fl.grid
    lat_range, r_range, dp_range = {
        TD: (cfg.td_lat, cfg.td_radius_km, cfg.td_dp),
        TC: (cfg.tc_lat, cfg.tc_radius_km, cfg.tc_dp),
        ETC: (cfg.etc_lat, cfg.etc_radius_km, cfg.etc_dp),
    }[kind]
    s = 1.0 if rng.uniform() < 0.5 else -1.0
    lat0 = s * _uniform(rng, lat_range)
    y0, x0 = g.row_of(lat0), float(rng.uniform(0, g.w))
    r = max(_uniform(rng, r_range), cfg.min_radius_px * g.km_y)  # km
    dp = _uniform(rng, dp_range)
    dy, dx = g.offsets_km(y0, x0)
    d2 = dy**2 + dx**2
    gp = np.exp(-d2 / (2 * r * r))
    box = _footprint_box(gp > cfg.footprint)
    if box is None:
        return None

    def apply():
        d = np.sqrt(d2) * 1000.0  # m
        rm = r * 1000.0
        f = abs(2 * OMEGA * math.sin(math.radians(lat0)))
        dpdd = dp * d / rm**2 * gp
        vt = -f * d / 2 + np.sqrt((f * d / 2) ** 2 + d * dpdd / RHO)
        with np.errstate(invalid="ignore", divide="ignore"):
            sin_t = np.where(d > 0, dy * 1000.0 / d, 0.0)
            cos_t = np.where(d > 0, dx * 1000.0 / d, 0.0)
        fl.psl -= dp * gp
        fl.u += -s * vt * sin_t
        fl.v += s * vt * cos_t
        if kind in (TD, TC):
            _warm_core(fl, kind, dp, gp, d2, np.arctan2(dy, dx), r, s)
        else:
            _cold_front(fl, dp, dy, dx, d2, r, s)

    return box, apply


def _warm_core(fl: _Fields, kind: int, dp: float, gp, d2, theta, r: float, s: float) -> None:
    """A tropical depression's or cyclone's warm core, moisture and spiral rain bands."""
    gq = np.exp(-d2 / (2 * (1.3 * r) ** 2))
    gr = np.exp(-d2 / (2 * (1.2 * r) ** 2))
    spiral = 0.6 + 0.4 * np.cos(2 * theta - s * 3.0 * np.sqrt(d2) / r)
    hpa10 = dp / 1000.0
    if kind == TC:
        fl.t500 += 0.8 * hpa10 * gp
        fl.t200 += 0.5 * hpa10 * gp
        fl.dtmq += (8.0 + 3.0 * hpa10) * gq
        fl.prect += (1e-7 + 2.4e-7 * hpa10) * gr * spiral
        fl.ts -= 0.5 * gr
        fl.rh += 0.2 * gq
    else:
        fl.t500 += (0.5 + 1.4 * hpa10) * gp
        fl.dtmq += (4.0 + 6.0 * hpa10) * gq
        fl.prect += (5e-8 + 1.2e-7 * hpa10) * gr * spiral
        fl.rh += 0.12 * gq


def _cold_front(fl: _Fields, dp: float, dy, dx, d2, r: float, s: float) -> None:
    """An extratropical cyclone's cold air to the west, its temperature dipole and its comma."""
    west = np.exp(-((dx + 0.6 * r) ** 2 + dy**2) / (2 * r * r))
    fl.t500 -= (1.0 + dp / 1000.0) * west
    g15 = np.exp(-d2 / (2 * (1.5 * r) ** 2))
    fl.ts += 3.0 * (dx / r) * g15
    # comma: a frontal band from the centre equatorward and east (60° from east)
    ang = math.radians(-60.0) * s
    a = dx * math.cos(ang) + dy * math.sin(ang)
    c = -dx * math.sin(ang) + dy * math.cos(ang)
    band = np.exp(-(c**2) / (2 * (0.25 * r) ** 2)) * np.exp(-((a - 0.7 * r) ** 2) / (2 * (0.6 * r) ** 2))
    fl.prect += 2.5e-7 * band
    fl.dtmq += 6.0 * band
    fl.rh += 0.1 * band


def _river(fl: _Fields, rng, cfg: GeneratorConfig):
    g = fl.grid
    s = 1.0 if rng.uniform() < 0.7 else -1.0
    lat0 = s * _uniform(rng, cfg.ar_lat)
    y0, x0 = g.row_of(lat0), float(rng.uniform(0, g.w))
    length = _uniform(rng, cfg.ar_length_km)
    width = max(_uniform(rng, cfg.ar_width_km), 0.75 * cfg.min_radius_px * g.km_y)
    ang = math.radians(_uniform(rng, cfg.ar_angle_deg)) * s  # poleward-eastward
    curve = float(rng.uniform(-0.15, 0.15)) / length
    amp = _uniform(rng, cfg.ar_tmq)
    jet = _uniform(rng, cfg.ar_jet)
    dy, dx = g.offsets_km(y0, x0)
    a = dx * math.cos(ang) + dy * math.sin(ang)
    c = -dx * math.sin(ang) + dy * math.cos(ang) - curve * a**2
    shape = np.exp(-(c**2) / (2 * width**2)) * np.exp(-((2 * a / length) ** 8))
    box = _footprint_box(shape > cfg.footprint)
    if box is None:
        return None

    def apply():
        fl.dtmq += amp * shape
        fl.u += jet * math.cos(ang) * shape
        fl.v += jet * math.sin(ang) * shape
        fl.rh += 0.1 * shape
        poleward = 1.0 / (1.0 + np.exp(-(a - 0.25 * length) / (0.1 * length)))
        fl.prect += 6e-8 * (amp / 20.0) * shape * (1.0 + 1.5 * poleward + 3.0 * fl.land)

    return box, apply


def _overlaps(box, boxes, margin: int = 1) -> bool:
    y0, x0, y1, x1 = box
    for b in boxes:
        if y0 < b[2] + margin and b[0] < y1 + margin and x0 < b[3] + margin and b[1] < x1 + margin:
            return True
    return False


def simulate_image(rng: np.random.Generator, h: int, w: int, z_s: np.ndarray,
                   cfg: GeneratorConfig = GeneratorConfig()) -> Tuple[np.ndarray, np.ndarray]:
    """One snapshot: fields (16, h, w) float32 and its true boxes (k, 5) int32."""
    g = _Grid(h, w)
    fl = _Fields(rng, g, z_s)
    counts = rng.poisson(cfg.mean_counts)
    kinds = [k for k in (ETC, AR, TC, TD) for _ in range(counts[k])][:MAX_BOXES]
    boxes = []
    for kind in kinds:
        for _attempt in range(20):
            ev = _river(fl, rng, cfg) if kind == AR else _cyclone(fl, rng, kind, cfg)
            if ev is None or _overlaps(ev[0], boxes):
                continue
            box, apply = ev
            apply()
            boxes.append((*box, kind))
            break
    out = np.asarray(boxes, np.int32).reshape(-1, 5)
    return fl.channels(), out


# --------------------------------------------------------------------------------------------------
# files


def _check_args(images, height, width, labelled_fraction, seed, fractions):
    if not is_int(images) or images < MIN_IMAGES:
        raise ValueError(f"images must be an integer >= {MIN_IMAGES}, got {images!r}")
    for name, v in (("height", height), ("width", width)):
        if not is_int(v) or not MIN_SIZE <= v <= MAX_SIZE:
            raise ValueError(f"{name} must be an integer in [{MIN_SIZE}, {MAX_SIZE}], got {v!r}")
    lf = labelled_fraction
    if isinstance(lf, bool) or not isinstance(lf, (int, float)) or not 0.0 <= lf <= 1.0:
        raise ValueError(f"labelled_fraction must be in [0, 1], got {labelled_fraction!r}")
    check_seed(seed)
    return check_splits(images, fractions, "images")


def _write_split(path: Path, name: str, split_index: int, n: int, h: int, w: int, seed: int,
                 labelled_fraction: float, z_s: np.ndarray, cfg: GeneratorConfig, attrs: dict,
                 progress: Optional[Callable[[int], None]]) -> None:
    n_lab = n if name != "train" else int(round(labelled_fraction * n))
    labelled = np.random.default_rng([seed, split_index, 0]).permutation(np.arange(n) < n_lab)
    image_bytes = len(CHANNELS) * h * w * 4
    per_chunk = max(1, min(n, CHUNK_BYTES // image_bytes))
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        f.attrs["split"] = name
        f.attrs["n_images"] = n
        f.attrs["n_labelled"] = n_lab
        images = f.create_dataset("images", shape=(n, len(CHANNELS), h, w), dtype=np.float32,
                                  chunks=(1, len(CHANNELS), h, w))
        images.attrs["channels"] = np.array(CHANNELS, dtype="S")
        images.attrs["units"] = np.array([UNITS[c] for c in CHANNELS], dtype="S")
        boxes = f.create_dataset("boxes", shape=(n, MAX_BOXES, 5), dtype=np.int32, fillvalue=-1)
        boxes.attrs["columns"] = np.array(["ymin", "xmin", "ymax", "xmax", "class"], dtype="S")
        boxes.attrs["classes"] = np.array(CLASSES, dtype="S")
        f.create_dataset("labelled", data=labelled)
        truth = f.create_group("truth").create_dataset("boxes", shape=(n, MAX_BOXES, 5), dtype=np.int32,
                                                       fillvalue=-1)
        for c, lo in enumerate(range(0, n, per_chunk)):
            hi = min(lo + per_chunk, n)
            rng = np.random.default_rng([seed, split_index, 1, c])
            block = np.empty((hi - lo, len(CHANNELS), h, w), np.float32)
            true = np.full((hi - lo, MAX_BOXES, 5), -1, np.int32)
            for k in range(hi - lo):
                block[k], b = simulate_image(rng, h, w, z_s, cfg)
                true[k, :len(b)] = b
            images[lo:hi] = block
            truth[lo:hi] = true
            shown = true.copy()
            shown[~labelled[lo:hi]] = -1
            boxes[lo:hi] = shown
            if progress is not None:
                progress(hi - lo)


def generate(
    out_dir: Path,
    images: int,
    height: int = 96,
    width: int = 144,
    labelled_fraction: float = 0.2,
    seed: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    config: GeneratorConfig = GeneratorConfig(),
) -> Dict[str, Path]:
    """Write ``train.h5``, ``val.h5`` and ``test.h5`` with ``images`` images in total into ``out_dir``.

    ``fractions`` splits the images (train, val, test); in ``train.h5`` a ``labelled_fraction`` of
    the images keeps its boxes, val and test are fully labelled. ``progress(k)`` is called after
    each chunk of ``k`` images is written. Returns ``{"train": path, "val": path, "test": path}``.
    Raises ValueError for bad arguments. Deterministic for given arguments.
    """
    fr, sizes = _check_args(images, height, width, labelled_fraction, seed, fractions)
    z_s = orography(seed, height, width, config.land_fraction)
    attrs = {
        "layout": "extremeweather",
        "generator": "hpcdl.workloads.climate.generate",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "height": height,
        "width": width,
        "total_images": images,
        "fractions": np.asarray(fr),
        "labelled_fraction": float(labelled_fraction),
        "config": config.to_json(),
    }
    return write_splits(out_dir, sizes, lambda tmp, name, i, n, report: _write_split(
        tmp, name, i, n, height, width, seed, float(labelled_fraction), z_s, config, attrs, report), progress)
