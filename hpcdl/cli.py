"""`hpcdl`: parse, call the library, print. Nothing here decides how training or scheduling works."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from hpcdl import __version__
from hpcdl.config import RUNS_DIR, Backend, choices
from hpcdl.errors import HpcdlError, JobError
from hpcdl.engine.tuning import quiet_tensorflow_import
from hpcdl.workloads import names as workload_names

# TensorFlow's C++ INFO lines (oneDNN notices, CPU features) are not for a CLI user's screen.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
quiet_tensorflow_import()

# Piped output (logs, CI) is not wrapped at 80 columns: tables stay readable there too.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


# click >= 8.2 shows a group's help as this UsageError; earlier versions exit without one
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class InputError(click.ClickException):
    """Bad input: the one line ``Error: ...`` and exit 2 (no usage text around it)."""

    exit_code = 2


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange without nan and inf (which pass its bounds, or mean nothing here)."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value


class HpcdlGroup(click.Group):
    """Turns input errors into one line and exit 2, and failures into exit 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except _NO_ARGS_IS_HELP:  # `hpcdl data` alone: its help, as click shows it
            raise
        except click.UsageError as exc:  # a subcommand's options, as click parsed them
            raise InputError(exc.format_message()) from None
        except HpcdlError as exc:
            raise (InputError if exc.exit_code == 2 else click.ClickException)(str(exc)) from None
        except OSError as exc:  # a path the user gave that cannot be written or read: full, read-only, ...
            where = f"{exc.filename}: " if exc.filename else ""
            raise click.ClickException(f"{where}{exc.strerror or exc}") from None


def _strict(value):
    """JSON has no NaN or Infinity: a figure that is not a number prints as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _emit_json(data) -> None:
    click.echo(json.dumps(_strict(data), indent=2, sort_keys=True, default=str, allow_nan=False))


runs_dir_option = click.option("--runs-dir", default=RUNS_DIR, show_default=True, type=click.Path(file_okay=False))


@click.group(cls=HpcdlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcdl")
def main() -> None:
    """Hybrid synchronous/asynchronous deep learning on CPU clusters (Kurth et al., SC17).

    Nodes are split into groups; each group trains synchronously with Horovod; groups exchange
    updates asynchronously through a shared directory. Start with `hpcdl data generate hep`,
    then `hpcdl submit hep`, `hpcdl status` and `hpcdl evaluate RUN`.
    """


# -- submit --------------------------------------------------------------------------------------
@main.command()
@click.argument("job")
@click.option("--backend", type=click.Choice(choices(Backend)), help="Where to run (default: the job's run.backend, auto: SLURM where sbatch is on PATH and the controller answers, else this machine).")
@click.option("--nodes", type=click.IntRange(min=1), help="Nodes in total (run.nodes).")
@click.option("--group-size", type=click.IntRange(min=0), help="Nodes per synchronous group; must divide --nodes (run.group_size, 0 = one group).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), help="Horovod ranks per node (run.ranks_per_node).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override any job field, e.g. --set train.steps=2000 (repeatable).")
@click.option("--runs-dir", type=click.Path(file_okay=False), help="Where run directories go (run.runs_dir, default ./runs).")
@click.option("--dry-run", is_flag=True, help="Print the exact scripts and commands; submit nothing, write nothing.")
@click.option("--no-check-data", is_flag=True, help="Do not open the data files at submit (run.check_data = false): they exist only on the compute nodes.")
@click.option("--detach", is_flag=True, help="Local backend: run in the background and return at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def submit(job, backend, nodes, group_size, ranks_per_node, overrides, runs_dir, dry_run, no_check_data, detach, as_json):
    """Start a run of JOB (a name in jobs/, e.g. `hep`, or a path to a .toml job file).

    The local backend trains in the foreground with a progress bar (Ctrl-C cancels); the slurm
    backend submits a job array, one element per group, and returns.
    """
    from hpcdl.commands.submit import prepare, submit_run

    settings = _settings({"run.backend": backend, "run.nodes": nodes, "run.group_size": group_size,
                          "run.ranks_per_node": ranks_per_node, "run.runs_dir": runs_dir and str(runs_dir),
                          "run.check_data": False if no_check_data else None})
    from hpcdl.commands.display import ScanProgress

    with ScanProgress(err) as scan:
        prepared = prepare(job, list(overrides), settings, on_note=_print_note, progress=scan)
    if dry_run:
        text = prepared.dryrun.render()
        _emit_json({"backend": prepared.scheduler.name, "files": prepared.dryrun.files,
                    "commands": prepared.dryrun.commands}) if as_json else click.echo(text, nl=False)
        return
    _start_and_report(prepared.job, lambda **kw: submit_run(prepared, **kw), detach, as_json)


def _settings(options: dict[str, Any]) -> dict[str, Any]:
    """The job fields the command's own options set: those given."""
    return {key: value for key, value in options.items() if value is not None}


def _print_note(note: str) -> None:
    err.print(note, soft_wrap=True, markup=False)


def _start_and_report(job, start, detach: bool, as_json: bool) -> None:
    """Start a prepared run (submit or resume), with a progress bar while the backend keeps it
    attached here (the local one, unless detached); print the run and its SLURM job ids. A run
    watched to its end exits 0 only if status calls it finished; otherwise each group that did
    not finish says why, and the exit status is 1."""
    from hpcdl.commands.display import GroupProgress
    from hpcdl.commands.status import with_outcome

    if as_json or detach:
        result = with_outcome(start(detach=detach))
    else:
        with GroupProgress(console, job.train.steps) as progress:
            result = with_outcome(start(detach=False, watch=progress.update))
    if as_json:
        _emit_json(result)
    else:
        console.print(f"run: [bold]{result['run_dir']}[/]")
        if result.get("slurm_array_job_id"):
            applier = result.get("slurm_applier_job_id")
            console.print(f"SLURM jobs: group array {result['slurm_array_job_id']} "
                          f"(elements 0-{job.run.groups - 1})"
                          + (f", applier {applier}" if applier else ""))
        if result.get("ok") is False:
            err.print(f"[red]the run did not finish: {result['state']}[/] (`hpcdl status` shows it; "
                      "the logs are under groups/)")
            for group in result["not_finished"]:
                err.print(f"  group {group['group']} {group['state']}: {group['why']}", markup=False,
                          soft_wrap=True)
    if result.get("ok") is False:
        sys.exit(1)


# -- resume ---------------------------------------------------------------------------------------


@main.command()
@click.argument("run")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Change a job field for the rest of the run, e.g. --set train.steps=2000 (repeatable).")
@click.option("--backend", type=click.Choice(choices(Backend)), help="Where to run it now (run.backend).")
@runs_dir_option
@click.option("--no-check-data", is_flag=True, help="Do not open the data files now (run.check_data = false).")
@click.option("--detach", is_flag=True, help="Local backend: run in the background and return at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def resume(run, overrides, backend, runs_dir, no_check_data, detach, as_json):
    """Continue RUN (a run directory or id) in place: every group from its newest checkpoint, the
    applier from its state. For a run whose supervisor died, that was cancelled, gave up after
    its restarts, or finished and should train longer (--set train.steps=N)."""
    from hpcdl.commands.display import ScanProgress
    from hpcdl.commands.resume import prepare_resume, resume_run
    from hpcdl.rundir.runs import find_run

    settings = _settings({"run.backend": backend, "run.check_data": False if no_check_data else None})
    with ScanProgress(err) as scan:
        prepared = prepare_resume(find_run(run, runs_dir), list(overrides), settings, on_note=_print_note,
                                  progress=scan)
    _start_and_report(prepared.job, lambda **kw: resume_run(prepared, **kw), detach, as_json)


# -- status / cancel ------------------------------------------------------------------------------
@main.command()
@click.argument("run", required=False)
@runs_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until the run ends (Ctrl-C stops).")
@click.option("--interval", default=2.0, show_default=True, type=FiniteFloatRange(min=0.2))
@click.option("--plot", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Also write the run's curves (loss, FLOP/s per group and in all, master versions) to this PNG.")
def status(run, runs_dir, as_json, watch, interval, plot):
    """Show a run (default: the newest under --runs-dir): per group, the applier, and totals."""
    from hpcdl.commands.display import status_view
    from hpcdl.rundir.runs import find_run
    from hpcdl.commands.status import collect

    if plot and watch:
        raise InputError("--plot writes one picture: use it without --watch")
    run_dir = find_run(run, runs_dir)
    if plot:
        from hpcdl.commands.progress_plot import plot_run

        try:
            err.print(f"plot: {plot_run(run_dir, plot)}")
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:
            raise click.ClickException(f"cannot write {plot}: {exc.strerror}") from None
    if as_json:
        _emit_json(collect(run_dir))
        return
    if not watch:
        console.print(status_view(collect(run_dir)))
        return
    from rich.live import Live

    with Live(status_view(collect(run_dir)), console=console, refresh_per_second=4) as live:
        try:
            while True:
                current = collect(run_dir)
                live.update(status_view(current))
                if not current["underway"] and current["state"] != "ending":  # appliers drain
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass


@main.command()
@click.argument("run", required=False)
@runs_dir_option
def cancel(run, runs_dir):
    """Stop every process or SLURM job of RUN (safe to repeat). Without RUN: the newest run under
    --runs-dir that is still queued or running, named in the answer."""
    from hpcdl.schedulers.select import cancel_run

    click.echo(cancel_run(run, runs_dir))


# -- logs -----------------------------------------------------------------------------------------
@main.command()
@click.argument("run", required=False)
@runs_dir_option
@click.option("--group", "group", type=click.IntRange(min=0), help="Only this group's logs.")
@click.option("--rank", "rank", type=click.IntRange(min=0), help="With --group: only this rank's log (local backend).")
@click.option("--applier", is_flag=True, help="The applier's logs (with --group: both).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what is appended, and new files, until Ctrl-C.")
def logs(run, runs_dir, group, rank, applier, follow):
    """Print a run's log files (default: the newest run under --runs-dir): every rank's, the
    applier's, the local supervisor's and SLURM's output files; as tail does, each under a
    ==> path <== header when there are several (or with --follow), a single file as it is."""
    from hpcdl.commands.logs import select, stream, until_signalled
    from hpcdl.rundir.runs import find_run

    run_dir = find_run(run, runs_dir)
    run_dir.info()  # a torn run.json: one line naming it
    files, note = select(run_dir, group, rank, applier)
    if note:
        err.print(note)
    if not files and not follow:
        err.print(f"no log files yet in {run_dir.root}")
        return
    keep_going = until_signalled() if follow else (lambda: False)
    try:
        stream(lambda: select(run_dir, group, rank, applier)[0], click.get_binary_stream("stdout"),
               follow=follow, keep_going=keep_going)
    except KeyboardInterrupt:  # a long print without --follow
        pass


# -- evaluate -------------------------------------------------------------------------------------
@main.command()
@click.argument("checkpoint", required=False)
@runs_dir_option
@click.option("--data", type=click.Path(path_type=Path), help="Test file (default: the job's data.test).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), help="Where plots go (default: <run>/eval).")
@click.option("--scores-out", type=click.Path(dir_okay=False, path_type=Path), help="Write per-event scores (hep) or detections (climate) as .npz or .csv; predictions (keras) as .npz.")
@click.option("--no-check-finite", is_flag=True, help="Do not scan the data for NaN/Inf first (it reads every value once).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
def evaluate(checkpoint, runs_dir, data, out_dir, scores_out, no_check_finite, as_json):
    """Score a model. CHECKPOINT is a run directory or run id, a checkpoint directory or a
    checkpoint prefix such as runs/RUN/checkpoints/0/ckpt-400 (default: the newest run under
    --runs-dir). Prints the metrics (docs/reference/metrics.md) and writes the workload's plots
    into the run's eval/ (hep: a ROC curve; climate: detections; keras: a confusion matrix, or
    predicted against true per output). The data is scanned for NaN/Inf first."""
    from hpcdl.commands.evaluate import evaluate as run_evaluate, locate

    checkpoint = locate(checkpoint, runs_dir)
    if scores_out is not None and scores_out.suffix.lower() not in (".npz", ".csv"):
        raise InputError("--scores-out must end in .npz or .csv")
    from hpcdl.commands.display import ScanProgress, counting_progress

    progress, task = counting_progress(err, "scoring", None)

    def begin(examples):  # drawn once every check has passed: a refusal prints its line alone
        progress.update(task, total=examples)
        progress.start()

    with ScanProgress(err) as scan:
        try:
            result = run_evaluate(checkpoint, data, out_dir, scores_out, progress=lambda n: progress.advance(task, n),
                                  total=begin, check_finite=not no_check_finite, scan_progress=scan)
        finally:
            progress.stop()
    if as_json:
        _emit_json(result)
        return
    from hpcdl.commands.display import metrics_table

    console.print(metrics_table(f"{result['model']} on {result['data']}", result))


# -- export ---------------------------------------------------------------------------------------
@main.command()
@click.argument("checkpoint")
@click.argument("out", type=click.Path(path_type=Path))
@runs_dir_option
@click.option("--checkpoint-weights", "own", is_flag=True,
              help="For a run with an exchange: group 0's newest checkpoint, not the master weights.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def export(checkpoint, out, runs_dir, own, as_json):
    """Write the model of CHECKPOINT (a run directory or id, a checkpoint directory or prefix, as
    `evaluate` takes it) to OUT, with its input normalisation inside, loadable without hpcdl: a
    TensorFlow SavedModel directory (`model = tf.saved_model.load(OUT)`, then `model.serve(x)`), or for keras jobs
    Keras' own file when OUT ends in .keras (`keras.models.load_model(OUT)`)."""
    from hpcdl.commands.evaluate import locate
    from hpcdl.commands.export import export as run_export

    result = run_export(locate(checkpoint, runs_dir), out, master=not own)
    if as_json:
        _emit_json(result)
    else:
        console.print(f"{result['model']} -> [bold]{result['out']}[/] ({result['format']}, "
                      f"input {tuple(result['input_shape'])})", soft_wrap=True)


# -- data -----------------------------------------------------------------------------------------
@main.group()
def data():
    """Generate synthetic data sets in the published layouts."""


def _generator_option(option) -> click.Option:
    """A workload's GeneratorOption as a click option."""
    ranged = click.IntRange if option.kind is int else FiniteFloatRange
    # click >= 8.3 takes an explicit default=None as a value, which satisfies `required`
    default = {} if option.default is None else {"default": option.default, "show_default": True}
    text = option.help[:1].upper() + option.help[1:]
    return click.Option([f"--{option.name.replace('_', '-')}"], type=ranged(option.low, option.high),
                        required=option.default is None, help=text if text.endswith(".") else text + ".", **default)


class GeneratorCommands(click.Group):
    """`hpcdl data generate WORKLOAD`: a command per installed workload, with the options its
    generator declares (`Workload.generate_count` and `generate_options`); a workload is loaded
    only when it is named or help lists it."""

    def list_commands(self, ctx):
        return workload_names()

    def get_command(self, ctx, name):
        from hpcdl.workloads import get_workload

        if name not in workload_names():
            return None
        try:
            workload = get_workload(name)
        except JobError as exc:  # a plugin that fails to load: help still lists the others
            return _refusal(name, str(exc), "Cannot be loaded (run it for why).")
        if not workload.generator_module or workload.generate_count is None:
            return _refusal(name, f"the {name} workload has no synthetic data generator: its data is your own",
                            "No generator: its data is your own.")
        count = workload.generate_count
        declared = [count, *workload.generate_options]
        taken = sorted({o.name for o in declared} & _GENERATE_COMMON_NAMES)
        if taken:
            return _refusal(name, f"the {name} workload's generator declares {', '.join(taken)}, which "
                            "`hpcdl data generate` takes itself", "Cannot be used (run it for why).")
        try:  # numpy and h5py, for its summary: the first paragraph of the generator's docstring
            summary = (importlib.import_module(workload.generator_module).__doc__ or "").split("\n\n")[0]
        except Exception as exc:  # a plugin's generator that does not import
            return _refusal(name, f"the {name} workload's generator {workload.generator_module} cannot be "
                            f"imported: {type(exc).__name__}: {exc}", "Cannot be used (run it for why).")
        params = [*map(_generator_option, declared), *_GENERATE_COMMON]
        return click.Command(name, params=params, help=summary or f"Write a synthetic {name} data set.",
                             callback=lambda out_dir, seed, force, as_json, **options: _generate(
                                 workload, count.name, out_dir, seed, force, as_json, options))


def _refusal(name: str, message: str, summary: str) -> click.Command:
    def refuse(**_):
        raise InputError(message)

    return click.Command(name, callback=refuse, help=summary,
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


_GENERATE_COMMON = [
    click.Option(["--out", "out_dir"], required=True, type=click.Path(file_okay=False, path_type=Path),
                 help="Directory for train.h5, val.h5, test.h5 (80/10/10 %)."),
    click.Option(["--seed"], default=0, show_default=True, type=int),
    click.Option(["--force"], is_flag=True, help="Replace a data set already in --out (a run may be reading it)."),
    click.Option(["--json", "as_json"], is_flag=True, help="Print the written files as JSON."),
]
# what a workload's generator option may not be called: these options' flags and parameter names
_GENERATE_COMMON_NAMES = {p.name for p in _GENERATE_COMMON} | {
    flag.lstrip("-").replace("-", "_") for p in _GENERATE_COMMON for flag in p.opts}


@data.group("generate", cls=GeneratorCommands)
def data_generate():
    """Write a synthetic data set (train, val and test files) in a workload's own layout, by the
    generator the workload brings; its options are in `hpcdl data generate WORKLOAD --help`."""


def _generate(w, count_name: str, out_dir: Path, seed: int, force: bool, as_json: bool, options: dict) -> None:
    from hpcdl.commands.display import counting_progress
    from hpcdl.workloads.common import split_paths

    count = options.pop(count_name)
    present = [p.name for p in split_paths(out_dir).values() if p.exists()]
    if present and not force:
        raise InputError(f"{out_dir} already holds {', '.join(present)}: give --force to replace the set")
    progress, task = counting_progress(err, f"generating {count_name}", count)
    with progress:
        try:
            files = w.generate(out_dir, count, seed=seed, progress=lambda n: progress.advance(task, n), **options)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        except MemoryError as exc:
            raise click.ClickException(f"not enough memory for {count} {count_name}: {exc}") from None
    if as_json:
        _emit_json({k: str(v) for k, v in files.items()})
    else:
        for name, path in files.items():
            console.print(f"{name}: {path}")


# -- workloads ------------------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True)
def workloads(as_json):
    """List the installed workloads (the hpcdl.workloads entry points): where each comes from and
    the fields of its [data] and [model] sections."""
    from hpcdl.workloads import describe

    rows = describe()
    if as_json:
        _emit_json(rows)
        return
    from rich.table import Table

    table = Table("workload", "from", "\\[data] fields", "\\[model] fields")
    for row in rows:
        if "error" in row:
            table.add_row(row["name"], row["source"], f"[red]{row['error']}[/red]", "")
        else:
            table.add_row(row["name"], row["source"], ", ".join(row["data"]), ", ".join(row["model"]))
    console.print(table)


# -- plan -----------------------------------------------------------------------------------------
@main.command()
@click.argument("workload", metavar="JOB")
@click.option("--nodes", required=True, type=click.IntRange(min=1), help="Nodes to plan for.")
@click.option("--inputs", "inputs_spec", help="'paper' (the SC17 run on Cori) or a .json/.toml file of planner inputs.")
@click.option("--node-flops", type=FiniteFloatRange(min=1.0), help="Sustained training FLOP/s of one node (from `make bench` or a run's status). Without it and --inputs, this machine's step of the job's network is measured (about 30 s for hep).")
@click.option("--groups", "group_counts", help="Comma-separated group counts to compare (default: divisors of --nodes up to 128).")
@click.option("--set", "overrides", multiple=True, metavar="exchange.KEY=VALUE", help="An [exchange] field of the job to model, e.g. --set exchange.kind=delta --set exchange.every=8 (repeatable). Without --inputs the job's whole [exchange] section is read.")
@click.option("--staleness-bound", default=8.0, show_default=True, type=FiniteFloatRange(min=0.0), help="Largest mean staleness the recommendation accepts.")
@click.option("--max-applier-util", default=0.5, show_default=True, type=FiniteFloatRange(0.0, 1.0, min_open=True, max_open=True), help="H advice: the applier's largest busy share.")
@click.option("--max-exchange-share", default=0.05, show_default=True, type=FiniteFloatRange(0.0, 1.0, min_open=True, max_open=True), help="H advice: the exchange's largest share of a group's time.")
@click.option("--from-run", "from_run", metavar="RUN", help="Fit the stragglers (σ, stalls, slow nodes) to the step times each rank of RUN (a run directory or id) recorded, instead of assuming them.")
@runs_dir_option
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--target", metavar="METRIC=VALUE", help="Also predict the time to this validation metric for each group count by the emulated race on the job's data (e.g. auc=0.95, r2>=0.9, loss<=0.3), and recommend G by it.")
@click.option("--race-ranks", default=8, show_default=True, type=click.IntRange(min=1), help="--target: ranks the race trains (its group counts divide it); time is the planner's at --nodes.")
@click.option("--race-steps", default=300, show_default=True, type=click.IntRange(min=2), help="--target: each race's horizon, in steps of the synchronous group.")
@click.option("--race-seeds", default=3, show_default=True, type=click.IntRange(min=1), help="--target: race seeds per group count (the rates are tuned on another).")
@click.option("--race-set", "race_overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="--target: a field of the copy of the job the race trains, e.g. model.filters=16 or train.batch_per_rank=8 (repeatable): a smaller copy learns in its stead; the time stays the planned network's.")
@click.option("--race-budget", default=15.0, show_default=True, type=FiniteFloatRange(min=0.0), help="--target: minutes the races may take on this machine, estimated from a measured step before they start; over it, plan races a smaller copy of the job that fits (a narrower model, then a smaller batch), or stops and says what to lower (0: no limit).")
@click.option("--json", "as_json", is_flag=True)
def plan(workload, nodes, inputs_spec, node_flops, group_counts, overrides, staleness_bound,
         max_applier_util, max_exchange_share, from_run, runs_dir, seed, target, race_ranks, race_steps,
         race_seeds, race_overrides, race_budget, as_json):
    """Predict step time, FLOP/s, applier load and staleness for each way of splitting --nodes
    into groups, recommend one and the steps between exchanges (exchange.every) for it. Every
    assumption is printed. JOB is a job's name (hep, climate) or a job file of any workload; its
    network's FLOPs and size are counted from the model it builds at its data's shape (hep without
    its data: the paper's 224²). With --from-run the stragglers are measured: a short synchronous run of the job shows them. With --target the
    time to accuracy decides: the job's model races on its data for every group count."""
    from hpcdl.commands.display import accuracy_view, paper_check_text, plan_view
    from hpcdl.perf.command import PlanRequest, make_plan
    from hpcdl.perf.planner import paper_check
    from hpcdl.rundir.runs import find_run

    try:
        counts = tuple(int(c) for c in group_counts.split(",")) if group_counts else ()
    except ValueError:
        raise InputError(f"--groups must be comma-separated integers, got {group_counts!r}") from None
    request = PlanRequest(workload, nodes, inputs_spec or "", node_flops, counts, tuple(overrides),
                          staleness_bound, max_applier_util, max_exchange_share,
                          find_run(from_run, runs_dir) if from_run else None, seed, target or "",
                          race_ranks, race_steps, race_seeds, race_budget * 60, tuple(race_overrides))
    with _RaceProgress() as progress:
        outcome = make_plan(request, note=_print_note, race_progress=progress.start)
    if as_json:
        _emit_json(outcome.to_dict())
        return
    if outcome.stragglers is not None:
        console.print(outcome.stragglers.describe(), markup=False)
    console.print(plan_view(outcome.plan))
    if outcome.accuracy is not None:
        console.print(accuracy_view(outcome.accuracy))
    if inputs_spec == "paper":
        console.print("\n" + paper_check_text(paper_check(seed=seed)))


class _RaceProgress:
    """The races' progress bar, shown once plan knows how many races it runs."""

    def __init__(self):
        self.progress = None

    def start(self, races: int):
        from hpcdl.commands.display import counting_progress

        self.progress, task = counting_progress(err, "racing", races)
        self.progress.start()

        def one_more_race(_what: str) -> None:  # a sweep extended past its grid's edge adds races
            done = self.progress.tasks[task].completed + 1
            self.progress.update(task, completed=done, total=max(self.progress.tasks[task].total, done))

        return one_more_race

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()


# -- doctor / completion --------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True)
def doctor(as_json):
    """Report versions, how Horovod was built, oneDNN, and the thread settings a rank would use."""
    from hpcdl.commands.doctor import report_here

    info = report_here()
    if as_json:
        _emit_json(info)
        return
    from hpcdl.commands.display import metrics_table

    console.print(metrics_table("hpcdl doctor", info))


@main.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell):
    """Print the shell completion script: eval "$(hpcdl completion bash)"."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    click.echo(cls(main, {}, "hpcdl", "_HPCDL_COMPLETE").source())


if __name__ == "__main__":
    main()
