"""Reading a job: find its file, apply `--set` overrides, build it with its workload's sections.

The schema is hpcdl.config's; what a job's `[data]` and `[model]` hold is its workload's, so
reading a job sits above both.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

from hpcdl.config import CommandLineValue, Job, build_job
from hpcdl.errors import JobError
from hpcdl.fs.files import read_regular
from hpcdl.resources import shipped_dir
from hpcdl.workloads import get_workload

JOBS_DIR = shipped_dir("jobs")


def resolve_job_path(name_or_path: str) -> Path:
    """A job is found by name in jobs/ (`hep`), or given as a path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.parent != Path("."):
        if not path.is_file():
            raise JobError(f"job file not found: {path}")
        return path
    candidate = JOBS_DIR / f"{name_or_path}.toml"
    if not candidate.is_file():
        known = ", ".join(sorted(p.stem for p in JOBS_DIR.glob("*.toml"))) or "none"
        raise JobError(f"unknown job {name_or_path!r} (known jobs: {known}; or give a path to a .toml file)")
    return candidate


def load_job(name_or_path: str, overrides: Mapping[str, str] | list[str] = (),
             settings: Mapping[str, Any] | None = None) -> Job:
    """Read a job file, apply `section.key=value` overrides (text, as typed after --set) and
    `settings` (typed values, e.g. the CLI's own options), validate, and freeze."""
    path = resolve_job_path(name_or_path)
    try:
        raw = tomllib.loads(read_regular(path).decode("utf-8"))
    except OSError as exc:
        raise JobError(f"cannot read job file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise JobError(f"cannot read job file {path}: not UTF-8 text, so not TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobError(f"cannot read job file {path}: not valid TOML ({' '.join(str(exc).split())})") from None
    raw.setdefault("name", path.stem)
    job = job_from_dict(_overridden(raw, overrides, settings))
    # Code a job file names beside itself (a Keras builder file) is found from the job file's
    # directory, and job.toml keeps the absolute path, so every rank and `resume` find it too.
    resolved = {section: getattr(job, section).resolved(path.parent) for section in ("data", "model")
                if hasattr(getattr(job, section), "resolved")}
    return job.replace(**resolved) if resolved else job


def job_with(job: Job, overrides: Mapping[str, str] | list[str] = (),
             settings: Mapping[str, Any] | None = None) -> Job:
    """`job` with overrides and settings applied as load_job applies them, validated again."""
    if not overrides and not settings:
        return job
    return job_from_dict(_overridden(tomllib.loads(job.to_toml()), overrides, settings))


def _overridden(raw: dict[str, Any], overrides: Mapping[str, str] | list[str],
                settings: Mapping[str, Any] | None) -> dict[str, Any]:
    for key, text in _split_overrides(overrides):
        _apply_override(raw, key, CommandLineValue(text))
    for key, value in (settings or {}).items():
        _apply_override(raw, key, value)
    return raw


def job_from_dict(raw: Mapping[str, Any], *, workload_code: bool = True) -> Job:
    """The job a parsed job file describes. `workload_code=False` leaves `[data]` and `[model]`
    the plain tables they are, without loading the workload, for what only watches or stops a
    run (status, cancel) from a shell where the workload's package may not be installed."""
    if not workload_code or not isinstance(raw.get("workload"), str):
        return build_job(raw)
    workload = get_workload(raw["workload"])
    return build_job(raw, workload.DataConfig, workload.ModelConfig)


def _split_overrides(overrides: Mapping[str, str] | list[str]) -> list[tuple[str, str]]:
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise JobError(f"--set expects section.key=value, got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return pairs


def _apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    section, dot, field_name = key.partition(".")
    if not dot or not field_name:
        raise JobError(f"--set key must be section.key (e.g. train.steps), got {key!r}")
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise JobError(f"{section} is not a section")
    field_name, dot, key_in_table = field_name.partition(".")
    if dot:  # a key of a table field, e.g. model.args.units=64 (a Keras builder's argument)
        table = raw[section].setdefault(field_name, {})
        if not isinstance(table, dict) or not key_in_table:
            raise JobError(f"--set {key}: {section}.{field_name} is not a table")
        table[key_in_table] = value
        return
    raw[section][field_name] = value
