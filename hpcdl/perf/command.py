"""`hpcdl plan`: the planner's inputs from what the user gave (a file, a node rate, this machine's
measured step, a run's fitted stragglers, the job's exchange and network), the throughput plan
over group counts, and, with a target, the emulated race by time to accuracy. The CLI parses the
options into a `PlanRequest` and prints the `PlanOutcome`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hpcdl.errors import HpcdlError
from hpcdl.jobfile import load_job, resolve_job_path
from hpcdl.perf.accuracy import Target
from hpcdl.perf.inputs import shape_text
from hpcdl.perf.planner import Plan, PlanInputs, plan as plan_groups, with_job_exchange
from hpcdl.workloads import get_workload


class PlanInputError(HpcdlError, ValueError):
    """A plan that cannot be made from what was given; the message says what to change."""


class MeasureError(HpcdlError):
    """Measuring this machine's step failed: a fault of the system, not of the input."""

    exit_code = 1


@dataclass(frozen=True)
class PlanRequest:
    job: str  # a shipped job's name or a job file
    nodes: int
    inputs: str = ""  # "paper" or a .json/.toml file of planner inputs
    node_flops: float | None = None
    group_counts: tuple[int, ...] = ()  # empty: the planner's divisors of nodes
    overrides: tuple[str, ...] = ()  # exchange fields to model
    staleness_bound: float = 8.0
    max_applier_util: float = 0.5
    max_exchange_share: float = 0.05
    from_run: Any = None  # a RunDir whose step times give the stragglers
    seed: int = 0
    target: str = ""  # METRIC=VALUE: race to it
    race_ranks: int = 8
    race_steps: int = 300
    race_seeds: int = 3
    race_budget_s: float = 900.0  # 0: no limit
    race_overrides: tuple[str, ...] = ()  # the copy of the job the race trains, e.g. a narrower model


@dataclass(frozen=True)
class PlanOutcome:
    plan: Plan
    stragglers: Any = None  # hpcdl.perf.stragglers' fit, when from_run
    accuracy: Any = None  # hpcdl.perf.race_worker.AccuracyPlan, when a target

    def to_dict(self) -> dict[str, Any]:
        return {**self.plan.to_dict(), **({"stragglers": self.stragglers.to_dict()} if self.stragglers else {}),
                **({"accuracy": self.accuracy.to_dict()} if self.accuracy else {})}


def make_plan(request: PlanRequest, *, note: Callable[[str], None] = lambda _: None,
              race_progress: Callable[[int], Callable[[str], None]] | None = None) -> PlanOutcome:
    """The plan `request` asks for. `note` hears what is about to take time; `race_progress(n)`
    is told the number of races and returns what each finished race calls."""
    resolve_job_path(request.job)  # a job of jobs/ by name (hep, climate) or a .toml file
    if request.inputs and request.node_flops:
        raise PlanInputError("give --inputs or --node-flops, not both")
    fitted = _fitted_stragglers(request.from_run) if request.from_run is not None else None
    try:
        aim = Target.parse(request.target) if request.target else None  # before any measurement
        groups = _race_groups(request) if aim else []
        inputs = _inputs(request, note)
        if fitted is not None:
            inputs = fitted.applied_to(inputs, f"run {request.from_run.run_id}")
        result = plan_groups(inputs, request.nodes, list(request.group_counts) or None, seed=request.seed,
                             staleness_bound=request.staleness_bound, max_utilisation=request.max_applier_util,
                             max_exchange_share=request.max_exchange_share)
        accuracy = _race(request, aim, inputs, groups, note, race_progress) if aim else None
    except PlanInputError:
        raise
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    return PlanOutcome(result, fitted, accuracy)


def _fitted_stragglers(run):
    """Before any measurement: a run without step times fails at once."""
    from hpcdl.perf.stragglers import TooFewSteps, fit_run

    try:
        return fit_run(run)
    except TooFewSteps as exc:
        raise PlanInputError(str(exc)) from None


def _inputs(request: PlanRequest, note: Callable[[str], None]) -> PlanInputs:
    network = JobNetwork.of(request.job, request.overrides)
    if request.inputs:
        inputs = PlanInputs.load(request.inputs)
    else:
        node_flops, source = request.node_flops, "--node-flops"
        if node_flops is None:
            from hpcdl.perf.measure import CannotMeasure, measure_in_subprocess

            note(f"measuring this machine's training step of {network.name} (--node-flops skips this)")
            try:
                here = measure_in_subprocess(job=request.job, input_shape=network.input_shape,
                                             overrides=request.overrides)
            except CannotMeasure as exc:
                raise PlanInputError(str(exc)) from None
            except RuntimeError as exc:
                raise MeasureError(str(exc)) from None
            node_flops = here["node_flops"]
            source = (f"measured here: best of {here['steps']} steps of {network.name}, batch {here['batch']}, "
                      f"{here['threads']}")
        inputs = PlanInputs.measured_here(node_flops, source=source)
    inputs = with_job_exchange(inputs, request.job, request.overrides, whole_section=not request.inputs)
    return network.applied_to(inputs)


def _race_groups(request: PlanRequest) -> list[int]:
    """The group counts the race can emulate: dividing both its ranks and the nodes planned."""
    ranks = request.race_ranks
    candidates = request.group_counts or [g for g in range(1, ranks + 1) if ranks % g == 0]
    groups = [g for g in candidates if ranks % g == 0 and request.nodes % g == 0]
    if not groups:
        raise PlanInputError(f"no group count divides both --race-ranks {ranks} and --nodes {request.nodes}")
    return groups


def _race(request: PlanRequest, aim: Target, inputs: PlanInputs, groups: list[int], note: Callable[[str], None],
          race_progress: Callable[[int], Callable[[str], None]] | None):
    from hpcdl.perf.race_worker import budgeted_races, plan_accuracy

    # the exchange the plan models is the one raced; the race may learn on a smaller copy of the job
    job = load_job(request.job, [*request.overrides, *request.race_overrides])
    races = len(groups) * (3 + request.race_seeds)  # at least: a sweep's three rates, the race seeds
    if request.race_budget_s:
        note(f"timing a step and a score of the job here: {budgeted_races(len(groups), request.race_seeds)} "
             f"races (a sweep extended once per group count) must fit --race-budget ({request.race_budget_s / 60:g} min)")
    started: list[Callable[[str], None]] = []

    def on_race(what: str) -> None:  # the bar appears once the races begin, not while timing
        if not started:
            started.append(race_progress(races))
        started[0](what)

    return plan_accuracy(get_workload(job.workload), job, inputs, request.nodes, aim,
                         race_ranks=request.race_ranks, groups=groups, steps=request.race_steps,
                         race_seeds=request.race_seeds, tuning_seed=100 + request.seed,
                         budget_s=request.race_budget_s, copy=request.race_overrides,
                         progress=on_race if race_progress else None, note=note)


@dataclass(frozen=True)
class JobNetwork:
    """The job's network as the planner counts and times it: at its data's input shape where the
    data is readable here, else at its workload's `default_input_shape`."""

    job_name: str
    workload: str
    input_shape: tuple[int, ...]
    flops: float  # training FLOPs per example
    params: int
    how: str  # how the FLOPs were counted
    batch_per_node: int
    shape_is_default: bool = False  # the workload's default_input_shape: the data is not readable here

    @property
    def name(self) -> str:
        return f"the {self.workload} network at {shape_text(self.input_shape)}"

    @classmethod
    def of(cls, job_ref: str, overrides: tuple[str, ...] = ()) -> "JobNetwork":
        return cls.of_job(load_job(job_ref, list(overrides)), resolve_job_path(job_ref).name)

    @classmethod
    def of_job(cls, job, job_name: str) -> "JobNetwork":
        """PlanInputError where the input shape comes only from data not readable here."""
        workload = get_workload(job.workload)
        batch = job.train.batch_per_rank * job.run.ranks_per_node
        try:
            shape = tuple(int(x) for x in workload.input_shape(job))
        except (OSError, ValueError) as exc:  # not here, or not readable (DataFileError)
            if workload.default_input_shape is None:
                raise PlanInputError(f"the {job.workload} network's input shape comes from its data, not readable "
                                     f"here ({exc})") from None
            flops, params = job.model.cost(workload.default_input_shape)
            return cls(job_name, job.workload, tuple(workload.default_input_shape),
                       float(flops.training), params, f"{job.workload}'s ModelConfig.cost at the workload's "
                       f"default input shape (the job's data is not readable here)", batch, True)
        counted = getattr(workload, "network_cost_and_source", None)
        if counted is not None:
            flops, how, params = counted(job)
        else:
            (flops, params), how = workload.network_cost(job), f"{job.workload}'s ModelConfig.cost"
        return cls(job_name, job.workload, shape, float(flops), params, how, batch)

    def applied_to(self, inputs: PlanInputs) -> PlanInputs:
        """`inputs` with this network's FLOPs, size and batch, except the fields a file of inputs
        gave or the paper's preset holds (the paper check plans the paper's network)."""
        where = f"job {self.job_name}: {self.name}"
        values = {"flops_per_example": (self.flops, f"{where}, FLOPs by {self.how}"),
                  "model_bytes": (float(self.params * 4), f"{where}, {self.params:,} fp32 parameters"),
                  "batch_per_node": (self.batch_per_node,
                                     f"job {self.job_name}: train.batch_per_rank × run.ranks_per_node")}
        paper = inputs.label.startswith("paper")
        return inputs.with_sourced({name: value for name, value in values.items()
                                    if not paper and not inputs.source(name).startswith("given in")})
