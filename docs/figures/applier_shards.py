"""The applier's CPU per update against the number of shards, per CPU measured.

One full HEP update (594,178 parameters) applied by one shard of K, in full batches of 32: the
median CPU time of `Applier.step` per update from `python -m bench.exchange_load --breakdown`, beside
the ideal 1/K of K = 1.
"""

from __future__ import annotations

from docs.figures import load_result, save

NAME = "applier-shards"

SOURCES = {
    "exchange-load/2026-12-01_194015-amd-epyc-avx2.json": "AMD EPYC, AVX2 (load 3–4)",
    "exchange-load/2026-12-01_231031-amd-epyc-avx512.json": "AMD EPYC Zen 4, AVX-512",
    "exchange-load/2026-12-02_055010-intel-xeon-amx.json": "Xeon Sapphire Rapids (idle)",
}


def per_shard(result: dict) -> dict[int, float]:
    """K -> median CPU ms per update of one shard."""
    steps = result["breakdown"]["shard_step_per_update"]
    return {int(k): v["cpu"]["median_ms"] for k, v in sorted(steps.items(), key=lambda kv: int(kv[0]))}


def draw():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    for (name, machine), marker in zip(SOURCES.items(), "osD"):
        costs = per_shard(load_result(name))
        ks = list(costs)
        line, = ax.plot(ks, list(costs.values()), marker=marker, label=machine)
        ax.plot(ks, [costs[ks[0]] / k for k in ks], ls=":", color=line.get_color(), lw=1)
    ax.plot([], [], ls=":", color="grey", label="1/K of K = 1 (ideal)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel("shards K (exchange.shards)")
    ax.set_ylabel("CPU ms per update, one shard")
    ax.set_ylim(bottom=0)
    ax.set_title("Applier CPU per HEP update (2.38 MB) against shards", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, -0.03, "Sources: bench/results/" + ", ".join(SOURCES) + "\n(python -m bench.exchange_load --breakdown; "
             "batches of 32, fsync on)", fontsize=6.5)
    return save(fig, NAME)
