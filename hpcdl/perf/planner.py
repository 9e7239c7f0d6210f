"""Scale planner: how to split N nodes into groups, and how often they exchange, predicted
before an allocation is spent (`hpcdl plan`).

Pure Python + numpy (no TensorFlow), deterministic for a seed. For each candidate group count G
(N/G nodes per group) it predicts the step time of a group, the sustained and peak FLOP/s of
the whole machine, the applier's load and the staleness of the updates it applies; it
recommends a group count and, for it, how many steps H (`exchange.every`) a group runs between
updates. Every input is printed with its source.

The planner is four small modules; this one gathers their public names:

* :mod:`hpcdl.perf.inputs`: the inputs as one table, the presets (the paper's Cori run,
  hpcdl's defaults), loading them from a file or a job's ``[exchange]`` section;
* :mod:`hpcdl.perf.model`: one group step (compute, stragglers, tree collectives);
* :mod:`hpcdl.perf.simulate`: the exchange and the applier, event by event;
* :mod:`hpcdl.perf.recommend`: the predictions per candidate, the two rules, the paper check.

The text of a plan is rendered by :func:`hpcdl.commands.display.plan_view`. What the paper reports, and
how the paper check depends on the inputs recalled or assumed, is in README's Figures section.
"""

from hpcdl.perf.inputs import (
    FIELDS,
    HPCDL_DEFAULTS,
    JOB_EXCHANGE_FIELDS,
    PAPER_CORI_HEP,
    Assumption,
    InputField,
    PlanInputs,
    job_exchange_values,
    with_job_exchange,
)
from hpcdl.perf.model import (
    allreduce_seconds,
    norm_ppf,
    sample_group_slowest,
    sample_slowest,
    slow_nodes_per_group,
    tree_collective_seconds,
    tree_rounds,
)
from hpcdl.perf.recommend import (
    MAX_APPLIER_UTILISATION,
    MAX_EXCHANGE_SHARE,
    PAPER_HEP_GROUPS,
    PAPER_HEP_PEAK_FLOPS,
    PAPER_HEP_SUSTAINED_FLOPS,
    PAPER_HEP_WORKERS,
    RULE,
    EveryAdvice,
    ShardAdvice,
    GroupPlan,
    Plan,
    applier_utilisation,
    default_candidates,
    evaluate,
    exchange_share,
    paper_check,
    plan,
    recommend,
    recommend_every,
    recommend_shards,
    smallest_every,
)
from hpcdl.perf.simulate import ExchangeSim, Update, simulate_exchange

__all__ = [
    "FIELDS", "HPCDL_DEFAULTS", "JOB_EXCHANGE_FIELDS", "PAPER_CORI_HEP", "Assumption",
    "InputField", "PlanInputs", "job_exchange_values", "with_job_exchange", "allreduce_seconds",
    "norm_ppf", "sample_group_slowest", "sample_slowest", "slow_nodes_per_group", "tree_collective_seconds", "tree_rounds",
    "MAX_APPLIER_UTILISATION", "MAX_EXCHANGE_SHARE", "PAPER_HEP_GROUPS", "PAPER_HEP_PEAK_FLOPS",
    "PAPER_HEP_SUSTAINED_FLOPS", "PAPER_HEP_WORKERS", "RULE", "EveryAdvice", "ShardAdvice", "GroupPlan", "Plan",
    "applier_utilisation", "default_candidates", "evaluate", "exchange_share", "paper_check",
    "plan", "recommend", "recommend_every", "recommend_shards", "smallest_every", "ExchangeSim", "Update",
    "simulate_exchange",
]
