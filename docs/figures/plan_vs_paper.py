"""`hpcdl plan`'s prediction for the paper's HEP run beside the paper's figures.

Computed from the code (`hpcdl.perf`, the `paper` inputs: `hpcdl plan hep --nodes 9600 --inputs
paper`): the predicted sustained and peak PFLOP/s at 9594 workers in 9 groups beside the paper's
11.41 and 11.73, and the sustained prediction as the one input nobody measured, the per-node
step-time spread σ, varies (0.10 is the planner's assumption).
"""

from __future__ import annotations

import dataclasses

from docs.figures import save

NAME = "plan-vs-paper"
SIGMAS = (0.0, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2)


def predictions():
    from hpcdl.perf.planner import PlanInputs, paper_check

    base = PlanInputs.paper_cori_hep()
    at_sigma = {s: paper_check(inputs=dataclasses.replace(base, straggler_sigma=s))["predicted_sustained_flops"]
                for s in SIGMAS}
    return paper_check(), base.straggler_sigma, at_sigma


def draw():
    import matplotlib.pyplot as plt

    check, assumed, at_sigma = predictions()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0), gridspec_kw={"width_ratios": [1, 1.5]})
    kinds = ("sustained", "peak")
    x = range(len(kinds))
    left.bar([i - 0.18 for i in x], [check[f"paper_{k}_flops"] / 1e15 for k in kinds], 0.36, label="paper (SC17)",
             color="#999999")
    left.bar([i + 0.18 for i in x], [check[f"predicted_{k}_flops"] / 1e15 for k in kinds], 0.36,
             label=f"hpcdl plan (σ = {assumed})", color="#4c72b0")
    for i, k in enumerate(kinds):
        left.text(i + 0.18, check[f"predicted_{k}_flops"] / 1e15 + 0.2, f"{check[f'{k}_ratio']:.2f}×",
                  ha="center", fontsize=8)
    left.set_xticks(list(x), kinds)
    left.set_ylabel("PFLOP/s")
    left.set_title(f"HEP, {check['nodes']} workers in {check['groups']} groups", fontsize=10)
    left.legend(fontsize=8, loc="lower center")

    paper = check["paper_sustained_flops"] / 1e15
    right.axhspan(paper * 0.85, paper * 1.15, color="#dddddd", label="paper's sustained ±15 %")
    right.axhline(paper, color="#777777", lw=1)
    right.plot(list(at_sigma), [v / 1e15 for v in at_sigma.values()], marker="o", color="#4c72b0",
               label="predicted sustained")
    right.axvline(assumed, color="#c44e52", ls="--", lw=1, label=f"assumed σ = {assumed}")
    right.set_xlabel("per-node step-time spread σ (lognormal)")
    right.set_ylabel("PFLOP/s")
    right.set_title("How the prediction rests on σ", fontsize=10)
    right.legend(fontsize=8)
    fig.text(0.01, -0.03, "From the code: hpcdl plan hep --nodes 9600 --inputs paper (hpcdl.perf.paper_check); "
             "the paper's figures: Kurth et al., SC17", fontsize=6.5)
    fig.tight_layout()
    return save(fig, NAME)
