"""The events of the synthetic RPV-SUSY vs QCD sample (:mod:`hpcdl.workloads.hep.generate` writes
them): hard process, radiation, hadrons, pile-up, truth jets and the selection, the detector.

Processes
---------
Signal: gluino pair production, ``pp → g̃ g̃``, with R-parity-violating decays. The gluino mass is
one of ``GeneratorConfig.gluino_masses`` (1.2–1.6 TeV); the pair is produced close to threshold
(gluino velocity in the pair frame from a Beta distribution), gets a longitudinal boost and a
transverse recoil against initial-state radiation. Each gluino decays either directly to three
quarks (``g̃ → qqq`` through the RPV coupling λ'') or in a cascade ``g̃ → q q̄ χ̃⁰`` with the
neutralino decaying RPV to three quarks (``χ̃⁰ → qqq``); decays are isotropic, uniform in phase
space. Events therefore have 6–10 hard quark jets plus radiation, a large scalar sum HT (~2 m_g̃),
are central and spherical, and quarks of one decay often merge into one large-radius ("fat") jet
with two or three hard sub-clusters (prongs) and a large mass.

Background: QCD 2 → 2 scattering. The hard scale pT-hat is generated in slices (ATLAS "JZ"
slices, ``GeneratorConfig.pthat_slices``, 0.4–3 TeV: the search triggers on a leading jet above
440 GeV, which softer QCD practically never produces) with an equal number of events per slice,
following a falling power law ``dσ/dpT ∝ pT^-n`` inside each slice; each event's weight is its
slice's cross section times the luminosity divided by the slice's event count, so background
weights span nearly three orders of magnitude and dwarf the signal weights. The hardest slices
carry more energy than the signal: energy alone does not separate the classes. The two partons are back to back
in φ, with the rapidity difference of t-channel scattering (forward-peaked, so QCD has large
|Δη| between the leading jets) and a gluon fraction falling with pT. Extra jets come only from
radiation, so QCD events have mostly 2–5 jets, gluon-rich and single-prong.

Radiation and hadronisation
---------------------------
Initial-state radiation adds Poisson-distributed (mostly gluon) jets with pT scaled to the hard
process. Final-state radiation: every parton emits a Poisson number of gluons with the
soft-collinear spectrum ``dz/z dθ/θ`` at a rate ∝ α_s C (C_F = 4/3 for quarks, C_A = 3 for
gluons), so gluon jets radiate more; narrow-angle emissions give jet mass and (asymmetric)
substructure, wide-angle ones extra jets. Each parton then fragments into charged hadrons,
photons (from π⁰ decays) and neutral hadrons: Poisson multiplicities growing with log E (gluon jets
~1.6× more particles), momentum fractions from a Dirichlet (gamma) sampling, and angles
``θ ~ kT / (x pT)`` with an exponential kT (soft particles are wide). Pileup adds a few hundred
soft particles (pT ~ 0.5 GeV) spread over the detector.

Detector
--------
A calorimeter of ``image_size × image_size`` cells over η ∈ [-2.5, 2.5] (axis 1) and
φ ∈ [-π, π) (axis 2, periodic). Photons deposit all their energy in the EM layer (resolution
10 %/√E ⊕ 1 %). Hadrons deposit ``hadron_response`` of their energy (non-compensation) with
50 %/√E ⊕ 5 % resolution, a random fraction of it (their own π⁰ content, Beta distributed) in the
EM layer; hadronic showers are wider (position smearing). Charged particles bend in the 2 T field
before reaching the calorimeter (Δφ ≈ 0.36/pT) and loop away below ~0.4 GeV; each with
pT > 0.5 GeV is counted as a track (90 % efficiency) in the cell of its direction at the vertex.
Random low-energy noise hits are added. Images store per cell:

* ``hist``: total deposited energy E (GeV; not ET), EM + hadronic
* ``histEM``: the EM part of it (so the EM fraction varies from jet to jet)
* ``histtrack``: number of tracks (a Poisson count correlated with the charged energy)

The channels have very different scales (a TeV jet's core vs. a handful of tracks): readers
normalise each channel (see :mod:`hpcdl.workloads.hep.data`).

Truth and the cut-based selection
---------------------------------
The selection works on the generator's true high-level objects, not on the images: every final
parton's particles are summed into a parton jet, parton jets are clustered with anti-kT
(R = ``fat_jet_radius``, 1.0) into fat jets, and each fat jet's mass is that of its constituents
above 5 % of its pT (a trimming). Fat jets with pT > 200 GeV and |η| < 2.0 count. Mirroring the
ATLAS RPV multijet search (ATLAS, Phys. Lett. B 785 (2018) 136 / ATLAS-CONF-2016-057):

* ``passSR4J``: ≥ 4 fat jets, leading pT > 440 GeV, M_J^Σ (summed mass of the 4 leading fat jets)
  > 800 GeV, |Δη| between the two leading fat jets < 1.4;
* ``passSR5J``: the same with ≥ 5 fat jets and M_J^Σ > 600 GeV;
* ``passSR = passSR4J or passSR5J``.

The selection is good but imperfect (signal fails it when quarks do not merge into massive jets,
or leave the acceptance; hard QCD with wide-angle radiation passes it), while the images carry
information it does not use: substructure prongs inside the fat jets, quark-like (narrow, fewer
tracks) vs gluon-like jets in the track and EM patterns, the total energy and the jet
multiplicity beyond 4 or 5. No artificial marker is put in the images: whatever a classifier
finds there comes from the physics above.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

ETA_MAX = 2.5


@dataclass(frozen=True)
class GeneratorConfig:
    """Physics and detector parameters (energies in GeV, angles in η–φ units)."""

    lumi_fb: float = 36.1
    # signal: gluino pair, NLO+NLL cross sections at 13 TeV (fb) interpolated in log
    gluino_masses: Tuple[float, ...] = (1200.0, 1300.0, 1400.0, 1500.0, 1600.0)
    gluino_xsec_fb: Tuple[float, ...] = (85.6, 46.1, 25.2, 14.1, 8.10)
    cascade_fraction: float = 0.7  # fraction of gluinos decaying g̃ → q q̄ χ̃⁰ (χ̃⁰ → qqq)
    neutralino_mass_fraction: float = 0.4  # m(χ̃⁰) / m(g̃) in cascades
    gluino_beta: Tuple[float, float] = (2.0, 2.5)  # Beta(a, b) gluino velocity in the pair frame
    pair_rapidity_sigma: float = 0.6
    # background: QCD dijets in pT-hat slices, dσ/dpT ∝ pT^-n
    pthat_slices: Tuple[float, ...] = (400.0, 550.0, 750.0, 1000.0, 1400.0, 2000.0, 3000.0)
    qcd_power: float = 5.0
    qcd_xsec_above_fb: float = 7.5e4  # σ(pT-hat > first slice edge): 1.2 nb above 200 GeV × (2)^-4
    qcd_ystar_sigma: float = 0.9  # |y*| = |Δy|/2 ~ |N(0, σ)|
    qcd_yboost_sigma: float = 0.7
    # radiation
    isr_mean: float = 1.5
    isr_pt_fraction: float = 0.2  # mean ISR pT = 20 GeV + fraction × hard scale
    isr_eta_sigma: float = 1.6
    alpha_s: float = 0.15
    fsr_z_min: float = 0.03
    fsr_theta: Tuple[float, float] = (0.04, 1.5)
    fsr_generations: int = 2  # emitted gluons radiate again (a two-step cascade)
    # hadronisation
    nch: Tuple[float, float] = (1.2, 3.0)  # quark-jet mean charged multiplicity a + b ln(E/GeV)
    gluon_multiplicity_ratio: float = 1.6
    photons_per_charged: float = 0.9
    neutral_hadrons_per_charged: float = 0.12
    fragmentation_alpha: Tuple[float, float] = (0.8, 0.55)  # Dirichlet α (quark, gluon)
    kt_mean: Tuple[float, float] = (0.8, 1.1)  # GeV (quark, gluon)
    pileup_particles: float = 250.0
    pileup_pt_mean: float = 0.5
    # detector
    hadron_response: float = 0.8
    magnetic_bend: float = 0.36  # Δφ = bend / pT (2 T, 1.2 m)
    track_pt_min: float = 0.5
    track_efficiency: float = 0.9
    noise_hits: float = 40.0
    noise_energy: float = 0.3
    # truth jets and the selection
    jet_radius: float = 0.4  # small-R jets, counted in truth/n_jet (pT > jet_pt_min, |η| < 2.5)
    jet_pt_min: float = 50.0
    fat_jet_radius: float = 1.0
    fat_jet_pt_min: float = 200.0
    fat_jet_eta_max: float = 2.0
    trim_fraction: float = 0.05
    sr_lead_pt_min: float = 440.0
    sr_deta_max: float = 1.4
    sr4j_mjsum_min: float = 800.0
    sr5j_mjsum_min: float = 600.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


# --------------------------------------------------------------------------------------------------
# kinematics helpers (4-vectors as (..., 4) arrays: px, py, pz, E)


def _p4(pt, eta, phi, m=0.0) -> np.ndarray:
    pt, eta, phi = np.broadcast_arrays(*map(np.asarray, (pt, eta, phi)))
    pz = pt * np.sinh(eta)
    e = np.sqrt((pt * np.cosh(eta)) ** 2 + np.asarray(m) ** 2)
    return np.stack([pt * np.cos(phi), pt * np.sin(phi), pz, e], axis=-1)


def _pt_eta_phi(p: np.ndarray):
    pt = np.hypot(p[..., 0], p[..., 1])
    eta = np.arcsinh(np.divide(p[..., 2], pt, out=np.zeros_like(pt), where=pt > 0))
    return pt, eta, np.arctan2(p[..., 1], p[..., 0])


def _mass(p: np.ndarray) -> np.ndarray:
    m2 = p[..., 3] ** 2 - (p[..., :3] ** 2).sum(axis=-1)
    return np.sqrt(np.maximum(m2, 0.0))


def _boost(p: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Boost ``p`` from the rest frame of ``parent`` (lab 4-momentum) to the lab."""
    b = parent[..., :3] / parent[..., 3:4]
    b2 = np.clip((b**2).sum(axis=-1, keepdims=True), 0.0, 1.0 - 1e-12)
    g = 1.0 / np.sqrt(1.0 - b2)
    bp = (b * p[..., :3]).sum(axis=-1, keepdims=True)
    g2 = np.where(b2 > 0, (g - 1.0) / np.where(b2 > 0, b2, 1.0), 0.0)
    p3 = p[..., :3] + b * (g2 * bp + g * p[..., 3:4])
    return np.concatenate([p3, g * (p[..., 3:4] + bp)], axis=-1)


def _isotropic(rng: np.random.Generator, n: int) -> np.ndarray:
    cos = rng.uniform(-1.0, 1.0, n)
    sin = np.sqrt(1.0 - cos**2)
    phi = rng.uniform(-np.pi, np.pi, n)
    return np.stack([sin * np.cos(phi), sin * np.sin(phi), cos], axis=-1)


def _two_body_q(m, m1, m2):
    return np.sqrt(np.maximum((m**2 - (m1 + m2) ** 2) * (m**2 - (m1 - m2) ** 2), 0.0)) / (2.0 * m)


def _two_body(rng, parent: np.ndarray, m, m1, m2) -> Tuple[np.ndarray, np.ndarray]:
    """Isotropic two-body decay of ``parent`` (lab 4-vectors, mass ``m``)."""
    n = parent.shape[0]
    q = _two_body_q(m, m1, m2)[:, None]
    d = _isotropic(rng, n) * q
    e1 = np.sqrt(q**2 + np.asarray(m1)[..., None] ** 2 * np.ones((n, 1)))
    e2 = np.sqrt(q**2 + np.asarray(m2)[..., None] ** 2 * np.ones((n, 1)))
    return _boost(np.concatenate([d, e1], 1), parent), _boost(np.concatenate([-d, e2], 1), parent)


def _three_body(rng, parent: np.ndarray, m: np.ndarray, m3: np.ndarray):
    """Uniform phase-space decay of ``parent`` (mass ``m``) to two massless quarks and a mass ``m3``.

    The (12) invariant mass is drawn with density ∝ q(m → m12 m3) · q(m12 → 0 0) by rejection, then
    two isotropic two-body decays: exactly uniform three-body phase space.
    """
    n = parent.shape[0]
    m12 = np.empty(n)
    todo = np.arange(n)
    lo, hi = np.zeros(n), m - m3
    # the weight's maximum over m12, on a grid (cheap, per decay)
    grid = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, 65)[None, :]
    wmax = (_two_body_q(m[:, None], grid, m3[:, None]) * grid / 2.0).max(axis=1) * 1.05
    while todo.size:
        cand = lo[todo] + (hi - lo)[todo] * rng.uniform(size=todo.size)
        w = _two_body_q(m[todo], cand, m3[todo]) * cand / 2.0
        ok = rng.uniform(size=todo.size) * wmax[todo] <= w
        m12[todo[ok]] = cand[ok]
        todo = todo[~ok]
    p12, p3 = _two_body(rng, parent, m, m12, m3)
    p1, p2 = _two_body(rng, p12, m12, 0.0, 0.0)
    return p1, p2, p3


# --------------------------------------------------------------------------------------------------
# partons: dict of 1-D arrays ev, pt, eta, phi, gluon


def _partons(ev, pt, eta, phi, gluon) -> dict:
    return {"ev": np.asarray(ev, np.int64), "pt": np.asarray(pt, float), "eta": np.asarray(eta, float),
            "phi": np.asarray(phi, float), "gluon": np.asarray(gluon, bool)}


def _concat(*tables: dict) -> dict:
    return {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}


def _isr(rng, n: int, scale: np.ndarray, cfg: GeneratorConfig):
    k = rng.poisson(cfg.isr_mean, n)
    ev = np.repeat(np.arange(n), k)
    pt = 20.0 + rng.exponential(cfg.isr_pt_fraction * scale[ev])
    eta = rng.normal(0.0, cfg.isr_eta_sigma, ev.size)
    phi = rng.uniform(-np.pi, np.pi, ev.size)
    gluon = rng.uniform(size=ev.size) < 0.8
    rx = -np.bincount(ev, pt * np.cos(phi), minlength=n)
    ry = -np.bincount(ev, pt * np.sin(phi), minlength=n)
    return _partons(ev, pt, eta, phi, gluon), rx, ry


def gluino_xsec_fb(m, cfg: GeneratorConfig) -> np.ndarray:
    """Gluino-pair cross section (fb) at mass ``m``, log-interpolated in ``cfg``'s table."""
    return np.exp(np.interp(m, cfg.gluino_masses, np.log(cfg.gluino_xsec_fb)))


def _signal(rng, m_g: np.ndarray, cascade: np.ndarray, cfg: GeneratorConfig) -> dict:
    """Final-state partons (before FSR) of gluino-pair events; ``cascade`` is (n, 2) bool."""
    n = m_g.size
    isr, rx, ry = _isr(rng, n, m_g, cfg)
    beta = rng.beta(*cfg.gluino_beta, size=n) * 0.95
    pstar = m_g * beta / np.sqrt(1.0 - beta**2)
    d = _isotropic(rng, n) * pstar[:, None]
    e = np.sqrt(pstar**2 + m_g**2)[:, None]
    y = rng.normal(0.0, cfg.pair_rapidity_sigma, n)
    mt = np.sqrt((2.0 * e[:, 0]) ** 2 + rx**2 + ry**2)
    pair = np.stack([rx, ry, mt * np.sinh(y), mt * np.cosh(y)], axis=-1)
    gl = np.concatenate([_boost(np.concatenate([d, e], 1), pair), _boost(np.concatenate([-d, e], 1), pair)])
    gev = np.concatenate([np.arange(n), np.arange(n)])
    gm = np.concatenate([m_g, m_g])
    casc = np.concatenate([cascade[:, 0], cascade[:, 1]])
    m3 = np.where(casc, cfg.neutralino_mass_fraction * gm, 0.0)
    q1, q2, p3 = _three_body(rng, gl, gm, m3)
    quarks = [q1, q2, p3[~casc]]
    qev = [gev, gev, gev[~casc]]
    if casc.any():
        c1, c2, c3 = _three_body(rng, p3[casc], m3[casc], np.zeros(int(casc.sum())))
        quarks += [c1, c2, c3]
        qev += [gev[casc]] * 3
    q = np.concatenate(quarks)
    pt, eta, phi = _pt_eta_phi(q)
    hard = _partons(np.concatenate(qev), pt, eta, phi, np.zeros(pt.size, bool))
    return _concat(hard, isr)


def slice_xsec_fb(cfg: GeneratorConfig) -> np.ndarray:
    edges = np.asarray(cfg.pthat_slices, float)
    a = 1.0 - cfg.qcd_power
    integral = (edges[1:] ** a - edges[:-1] ** a) / a  # ∫ pT^-n over each slice
    total = -(edges[0] ** a) / a  # ∫ from the first edge to infinity
    return cfg.qcd_xsec_above_fb * integral / total


def _qcd(rng, pthat: np.ndarray, cfg: GeneratorConfig) -> dict:
    n = pthat.size
    isr, rx, ry = _isr(rng, n, pthat, cfg)
    yb = rng.normal(0.0, cfg.qcd_yboost_sigma, n)
    ys = np.abs(rng.normal(0.0, cfg.qcd_ystar_sigma, n))
    phi = rng.uniform(-np.pi, np.pi, n)
    fg = np.clip(0.75 - 0.2 * pthat / 1000.0, 0.4, 0.75)
    parts = []
    for sign, dphi in ((1.0, 0.0), (-1.0, np.pi)):
        p = _p4(pthat, yb + sign * ys, phi + dphi)
        p[:, 0] += rx / 2.0  # recoil against ISR, shared
        p[:, 1] += ry / 2.0
        pt, eta, ph = _pt_eta_phi(p)
        parts.append(_partons(np.arange(n), pt, eta, ph, rng.uniform(size=n) < fg))
    return _concat(*parts, isr)


def _wrap(phi):
    return (phi + np.pi) % (2.0 * np.pi) - np.pi


def _fsr(rng, p: dict, cfg: GeneratorConfig) -> dict:
    """One generation of soft-collinear gluon emissions off every parton."""
    color = np.where(p["gluon"], 3.0, 4.0 / 3.0)
    zmin, (tmin, tmax) = cfg.fsr_z_min, cfg.fsr_theta
    lam = cfg.alpha_s * color / np.pi * math.log(0.5 / zmin) * math.log(tmax / tmin)
    k = rng.poisson(lam)
    parent = np.repeat(np.arange(p["pt"].size), k)
    z = zmin * (0.5 / zmin) ** rng.uniform(size=parent.size)
    zsum = np.bincount(parent, z, minlength=p["pt"].size)
    z *= np.where(zsum > 0.6, 0.6 / np.maximum(zsum, 1e-12), 1.0)[parent]
    zsum = np.bincount(parent, z, minlength=p["pt"].size)
    theta = tmin * (tmax / tmin) ** rng.uniform(size=parent.size)
    a = rng.uniform(0.0, 2.0 * np.pi, parent.size)
    daughters = _partons(
        p["ev"][parent], z * p["pt"][parent], p["eta"][parent] + theta * np.cos(a),
        _wrap(p["phi"][parent] + theta * np.sin(a)), np.ones(parent.size, bool),
    )
    parents = dict(p, pt=p["pt"] * (1.0 - zsum))
    return _concat(parents, daughters)


# --------------------------------------------------------------------------------------------------
# particles: dict of 1-D arrays ev, src (parton index, -1 pileup), pt, eta, phi, kind (0 charged,
# 1 photon, 2 neutral hadron), charge


def _hadronise(rng, p: dict, cfg: GeneratorConfig) -> dict:
    n = p["pt"].size
    e = p["pt"] * np.cosh(p["eta"])
    g = p["gluon"]
    mean = np.maximum(cfg.nch[0] + cfg.nch[1] * np.log(np.maximum(e, 1.0)), 1.0)
    mean = mean * np.where(g, cfg.gluon_multiplicity_ratio, 1.0)
    nch = rng.poisson(mean)
    ngam = rng.poisson(cfg.photons_per_charged * nch)
    nnh = rng.poisson(cfg.neutral_hadrons_per_charged * nch)
    nch = np.where(nch + ngam + nnh == 0, 1, nch)
    counts = np.stack([nch, ngam, nnh], axis=1)
    src = np.repeat(np.repeat(np.arange(n), 3), counts.ravel())
    kind = np.repeat(np.tile(np.arange(3), n), counts.ravel()).astype(np.int8)
    alpha = np.where(g, cfg.fragmentation_alpha[1], cfg.fragmentation_alpha[0])[src]
    share = rng.gamma(alpha) * np.where(kind == 1, 0.6, 1.0)
    share = np.maximum(share, 1e-12)
    x = share / np.bincount(src, share, minlength=n)[src]
    ppt = x * p["pt"][src]
    kt = rng.exponential(np.where(g, cfg.kt_mean[1], cfg.kt_mean[0])[src])
    theta = np.minimum(kt / np.maximum(ppt, 1e-6), 1.0)
    a = rng.uniform(0.0, 2.0 * np.pi, src.size)
    charge = np.where(kind == 0, rng.choice(np.array([-1, 1], np.int8), src.size), 0).astype(np.int8)
    return {"ev": p["ev"][src], "src": src, "pt": ppt, "eta": p["eta"][src] + theta * np.cos(a),
            "phi": _wrap(p["phi"][src] + theta * np.sin(a)), "kind": kind, "charge": charge}


def _pileup(rng, n: int, cfg: GeneratorConfig) -> dict:
    k = rng.poisson(cfg.pileup_particles, n)
    ev = np.repeat(np.arange(n), k)
    m = ev.size
    u = rng.uniform(size=m)
    kind = np.where(u < 0.6, 0, np.where(u < 0.9, 1, 2)).astype(np.int8)
    charge = np.where(kind == 0, rng.choice(np.array([-1, 1], np.int8), m), 0).astype(np.int8)
    return {"ev": ev, "src": np.full(m, -1, np.int64), "pt": 0.1 + rng.exponential(cfg.pileup_pt_mean, m),
            "eta": rng.uniform(-ETA_MAX - 0.5, ETA_MAX + 0.5, m), "phi": rng.uniform(-np.pi, np.pi, m),
            "kind": kind, "charge": charge}


# --------------------------------------------------------------------------------------------------
# truth jets and the selection


def _antikt(p: np.ndarray, radius: float):
    """Anti-kT clustering of a few 4-vectors; returns [(4-vector, constituent indices)]."""
    objs = [p[i].copy() for i in range(p.shape[0])]
    members = [[i] for i in range(p.shape[0])]
    jets = []
    r2 = radius * radius
    while objs:
        arr = np.array(objs)
        pt2 = arr[:, 0] ** 2 + arr[:, 1] ** 2
        rap = 0.5 * np.log((arr[:, 3] + arr[:, 2]) / np.maximum(arr[:, 3] - arr[:, 2], 1e-9))
        phi = np.arctan2(arr[:, 1], arr[:, 0])
        inv = 1.0 / np.maximum(pt2, 1e-12)
        ib = int(np.argmin(inv))
        best = inv[ib]
        if len(objs) > 1:
            dphi = np.abs(phi[:, None] - phi[None, :])
            dphi = np.minimum(dphi, 2.0 * np.pi - dphi)
            dr2 = (rap[:, None] - rap[None, :]) ** 2 + dphi**2
            dij = np.minimum(inv[:, None], inv[None, :]) * dr2 / r2
            np.fill_diagonal(dij, np.inf)
            flat = int(np.argmin(dij))
            i, j = divmod(flat, len(objs))
            if dij[i, j] < best:
                objs[i] = objs[i] + objs[j]
                members[i] = members[i] + members[j]
                del objs[j], members[j]
                continue
        jets.append((objs.pop(ib), members.pop(ib)))
    return jets


TRUTH_FEATURES = ("n_fatjet", "lead_pt", "mjsum", "deta12", "ht", "n_jet")


def _truth_features(partons: dict, particles: dict, n: int, cfg: GeneratorConfig) -> Dict[str, np.ndarray]:
    """True high-level event features from the hadronised partons (no pileup, no detector)."""
    mask = particles["src"] >= 0
    src = particles["src"][mask]
    q = _p4(particles["pt"][mask], particles["eta"][mask], particles["phi"][mask])
    npart = partons["pt"].size
    jets = np.stack([np.bincount(src, q[:, k], minlength=npart) for k in range(4)], axis=1)
    jpt, jeta, _ = _pt_eta_phi(jets)
    central = np.abs(jeta) < ETA_MAX
    ht = np.bincount(partons["ev"], jpt * ((jpt > 30.0) & central), minlength=n)
    out = {k: np.zeros(n) for k in TRUTH_FEATURES}
    out["ht"] = ht
    out["deta12"][:] = np.inf
    keep = jpt > 10.0
    order = np.argsort(partons["ev"][keep], kind="stable")
    jets_k, ev_k = jets[keep][order], partons["ev"][keep][order]
    bounds = np.searchsorted(ev_k, np.arange(n + 1))
    for i in range(n):
        cand = jets_k[bounds[i]:bounds[i + 1]]
        small = [v for v, _ in _antikt(cand, cfg.jet_radius)]
        out["n_jet"][i] = sum(
            1 for pt, eta, _ in map(_pt_eta_phi, small) if pt > cfg.jet_pt_min and abs(eta) < ETA_MAX
        )
        fat = []
        for vec, idx in _antikt(cand, cfg.fat_jet_radius):
            fpt = math.hypot(vec[0], vec[1])
            cpt = np.hypot(cand[idx, 0], cand[idx, 1])
            trimmed = cand[idx][cpt > cfg.trim_fraction * fpt].sum(axis=0)
            tpt, teta, _ = _pt_eta_phi(trimmed)
            if tpt > cfg.fat_jet_pt_min and abs(teta) < cfg.fat_jet_eta_max:
                fat.append((float(tpt), float(teta), float(_mass(trimmed))))
        fat.sort(reverse=True)
        out["n_fatjet"][i] = len(fat)
        if fat:
            out["lead_pt"][i] = fat[0][0]
            out["mjsum"][i] = sum(f[2] for f in fat[:4])
        if len(fat) >= 2:
            out["deta12"][i] = abs(fat[0][1] - fat[1][1])
    return out


def selection(features: Dict[str, np.ndarray], cfg: GeneratorConfig = GeneratorConfig()) -> Dict[str, np.ndarray]:
    """The ATLAS-like signal-region flags from true features (see the module docstring)."""
    base = (features["lead_pt"] > cfg.sr_lead_pt_min) & (features["deta12"] < cfg.sr_deta_max)
    sr4 = base & (features["n_fatjet"] >= 4) & (features["mjsum"] > cfg.sr4j_mjsum_min)
    sr5 = base & (features["n_fatjet"] >= 5) & (features["mjsum"] > cfg.sr5j_mjsum_min)
    return {"passSR": sr4 | sr5, "passSR4J": sr4, "passSR5J": sr5}


# --------------------------------------------------------------------------------------------------
# detector


def _detector(rng, particles: dict, n: int, size: int, cfg: GeneratorConfig):
    h = w = size
    pt, eta, kind = particles["pt"], particles["eta"], particles["kind"]
    e = pt * np.cosh(eta)
    charged = kind == 0
    photon = kind == 1
    # tracks: direction at the vertex
    trk = charged & (pt > cfg.track_pt_min) & (np.abs(eta) < ETA_MAX)
    trk &= rng.uniform(size=pt.size) < cfg.track_efficiency
    # calorimeter: bent charged particles, loopers lost
    reach = ~charged | (pt > cfg.magnetic_bend)
    phi = particles["phi"] - particles["charge"] * cfg.magnetic_bend / np.maximum(pt, 1e-6)
    smear = np.where(photon, 0.015, 0.04)
    ceta = eta + smear * rng.standard_normal(pt.size)
    cphi = phi + smear * rng.standard_normal(pt.size)
    res = np.where(photon, np.sqrt(0.01 / np.maximum(e, 1e-3) + 1e-4),
                   np.sqrt(0.25 / np.maximum(e, 1e-3) + 0.0025))
    resp = np.where(photon, 1.0, cfg.hadron_response)
    dep = e * resp * np.maximum(1.0 + res * rng.standard_normal(pt.size), 0.0)
    em = np.where(photon, dep, dep * rng.beta(1.2, 3.0, pt.size))
    calo = reach & (np.abs(ceta) < ETA_MAX)

    def cells(ev, et, ph):
        i = np.clip(((et + ETA_MAX) / (2 * ETA_MAX) * h).astype(np.int64), 0, h - 1)
        j = np.floor((_wrap(ph) + np.pi) / (2 * np.pi) * w).astype(np.int64) % w
        return (ev * h + i) * w + j

    ncell = n * h * w
    ev = particles["ev"]
    ci = cells(ev[calo], ceta[calo], cphi[calo])
    total = np.bincount(ci, dep[calo], minlength=ncell)
    emimg = np.bincount(ci, em[calo], minlength=ncell)
    tracks = np.bincount(cells(ev[trk], eta[trk], particles["phi"][trk]), minlength=ncell)
    # electronic noise: random low-energy hits
    k = rng.poisson(cfg.noise_hits * (h * w) / 4096.0, n)
    nev = np.repeat(np.arange(n), k)
    ni = (nev * h + rng.integers(0, h, nev.size)) * w + rng.integers(0, w, nev.size)
    ne = rng.exponential(cfg.noise_energy, nev.size)
    nem = rng.uniform(size=nev.size) < 0.5
    total += np.bincount(ni, ne, minlength=ncell)
    emimg += np.bincount(ni[nem], ne[nem], minlength=ncell)
    shape = (n, h, w)
    return (total.reshape(shape).astype(np.float32), emimg.reshape(shape).astype(np.float32),
            tracks.reshape(shape).astype(np.float32))


# --------------------------------------------------------------------------------------------------
# events


def simulate(
    rng: np.random.Generator,
    is_signal: np.ndarray,
    m_gluino: np.ndarray,
    pthat_slice: np.ndarray,
    image_size: int,
    cfg: GeneratorConfig = GeneratorConfig(),
) -> Dict[str, np.ndarray]:
    """Simulate a chunk of events: images, truth features and selection flags (no weights).

    ``is_signal`` (n,) bool; ``m_gluino`` (n,) the gluino mass of signal events (ignored for
    background); ``pthat_slice`` (n,) the QCD slice index of background events (ignored for signal).
    """
    n = is_signal.size
    sig = np.flatnonzero(is_signal)
    bkg = np.flatnonzero(~is_signal)
    tables = []
    pthat = np.zeros(n)
    if sig.size:
        cascade = rng.uniform(size=(sig.size, 2)) < cfg.cascade_fraction
        t = _signal(rng, m_gluino[sig].astype(float), cascade, cfg)
        t["ev"] = sig[t["ev"]]
        tables.append(t)
    if bkg.size:
        edges = np.asarray(cfg.pthat_slices, float)
        lo, hi = edges[pthat_slice[bkg]], edges[pthat_slice[bkg] + 1]
        a = 1.0 - cfg.qcd_power
        u = rng.uniform(size=bkg.size)
        pthat[bkg] = (lo**a + u * (hi**a - lo**a)) ** (1.0 / a)
        t = _qcd(rng, pthat[bkg], cfg)
        t["ev"] = bkg[t["ev"]]
        tables.append(t)
    partons = _concat(*tables)
    for _ in range(cfg.fsr_generations):
        partons = _fsr(rng, partons, cfg)
    particles = _hadronise(rng, partons, cfg)
    feats = _truth_features(partons, particles, n, cfg)
    pu = _pileup(rng, n, cfg)
    allp = {k: np.concatenate([particles[k], pu[k]]) for k in particles}
    hist, hist_em, hist_trk = _detector(rng, allp, n, image_size, cfg)
    out = {"hist": hist, "histEM": hist_em, "histtrack": hist_trk, "pthat": pthat}
    out.update(feats)
    out.update(selection(feats, cfg))
    return out
