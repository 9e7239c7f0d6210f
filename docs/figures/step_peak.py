"""The HEP training step's share of the machine's peak, per CPU measured.

The step (224², batch 32, float32) against the best float32 matrix multiply of the same bench run
(`make bench`; numpy's sgemm or TensorFlow's matmul, whichever was faster), one bar per result
file below, and `tuning.precision = "mixed_bfloat16"` beside it where the CPU has a bfloat16 unit.
"""

from __future__ import annotations

from docs.figures import load_result, save

NAME = "step-peak"

# result file under bench/results/, the machine as the caption names it
SOURCES = {
    "bench/2026-12-01_042017-amd-epyc-avx512.json": "AMD EPYC Zen 4\nAVX-512, AVX512_BF16",
    "bench/2026-12-02_062737-intel-xeon-amx.json": "Xeon Sapphire Rapids\nAMX",
    "bench/2026-12-02_062628-intel-xeon-onednn-avx2.json": "Sapphire Rapids as AVX2\n(ONEDNN_MAX_CPU_ISA)",
    "bench/2026-12-01_124937-amd-epyc-avx2.json": "AMD EPYC, AVX2\n(loaded: load avg 9–25)",
}
GOAL = 0.7


def shares(result: dict) -> tuple[float, float | None]:
    """(float32 step / float32 peak, mixed_bfloat16 step / float32 step or None)."""
    rows = {r["key"]: r.get("number") for r in result["rows"]}
    peak = max(v for k, v in rows.items() if k in ("sgemm.numpy", "sgemm.tf") and v)
    step = rows["step.fp32"]
    mixed = rows.get("step.bf16_explicit")
    return step / peak, (mixed / step if mixed else None)


def draw():
    import matplotlib.pyplot as plt

    labels, fp32, mixed = [], [], []
    for name, machine in SOURCES.items():
        share, speedup = shares(load_result(name))
        labels.append(machine)
        fp32.append(share)
        mixed.append(speedup)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    bars = ax.bar(range(len(labels)), fp32, color="#4c72b0", width=0.6)
    for bar, share, speedup in zip(bars, fp32, mixed):
        note = f"{share:.2f}" + (f"\nmixed_bfloat16:\n{speedup:.2f}× float32" if speedup else "")
        ax.text(bar.get_x() + bar.get_width() / 2, share + 0.02, note, ha="center", va="bottom", fontsize=8)
    ax.axhline(GOAL, color="#c44e52", ls="--", lw=1)
    ax.text(len(labels) - 0.55, GOAL - 0.01, f"goal {GOAL}", color="#c44e52", ha="right", va="top", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("HEP step FLOP/s ÷ best float32 matmul")
    ax.set_title("The training step's share of peak (224², batch 32, float32; 2 cores under KVM each)", fontsize=10)
    fig.text(0.01, -0.02, "Sources: bench/results/" + ", ".join(SOURCES) + " (make bench)", fontsize=6.5)
    return save(fig, NAME)
