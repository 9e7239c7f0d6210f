"""How an applier applies: its update rule, its hyper-parameters and its bounds, in one object."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl.applier.rules import UPDATE_RULES, RuleParams, applier_learning_rate
from hpcdl.adam import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON
from hpcdl.config import StalePolicy, choices


@dataclass(frozen=True)
class ApplierConfig:
    optimizer: str = "adam"  # a name in hpcdl.applier.rules.UPDATE_RULES
    lr: float = 1e-3
    momentum: float = 0.9
    beta1: float = ADAM_BETA1
    beta2: float = ADAM_BETA2
    eps: float = ADAM_EPSILON
    momentum_delay: int = 1  # nesterov: arrivals per momentum step
    staleness_scaling: bool = False  # every update at lr / max(1, staleness)
    max_staleness: int | None = None  # None: updates of any staleness are applied
    stale_policy: str = "drop"
    keep_versions: int = 3  # published weight versions kept
    max_batch: int = 32  # updates applied per commit of the durable state (and weights publish)
    temp_max_age_s: float = 600.0  # writers' temporaries older than this are a dead writer's
    status_interval: float = 5.0  # status.json rewritten at least this often when idle
    events_max_bytes: int = 64 << 20  # events.jsonl rotated past this

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", float(self.lr))
        if self.optimizer not in UPDATE_RULES:
            raise ValueError(f"optimizer must be one of {sorted(UPDATE_RULES)}, got {self.optimizer!r}")
        if self.stale_policy not in choices(StalePolicy):
            raise ValueError(f"stale_policy must be one of {choices(StalePolicy)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 or None")
        if self.keep_versions < 1 or self.max_batch < 1:
            raise ValueError("keep_versions and max_batch must be >= 1")

    @property
    def rule_params(self) -> RuleParams:
        return RuleParams(lr=self.lr, momentum=self.momentum, beta1=self.beta1, beta2=self.beta2,
                          eps=self.eps, delay=self.momentum_delay)

    @classmethod
    def for_job(cls, job) -> "ApplierConfig":
        """A run's applier, from its job's [exchange] and the number of groups."""
        x, groups = job.exchange, job.run.groups
        # exchange.momentum is the rule's momentum: heavy ball's and Nesterov's μ, Adam's β1
        return cls(optimizer=x.optimizer, lr=applier_learning_rate(x, job.train.learning_rate, groups),
                   momentum=x.momentum, beta1=x.momentum, momentum_delay=x.momentum_delay_for(groups),
                   staleness_scaling=x.staleness_scaling, max_staleness=x.max_staleness,
                   stale_policy=x.stale_policy, keep_versions=x.keep_versions)
