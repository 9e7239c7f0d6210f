"""Every choice a job field takes is declared once, as the field's Literal type; each registry that
implements the choice covers exactly its names, and the CLI, validation and reference read them."""

import dataclasses
import typing

import numpy as np
import pytest

from hpcdl.config import (
    COMMON_SECTIONS, Backend, DeltaDtype, ExchangeKind, TrainOptimizer, UpdateRuleName, choices,
)
from hpcdl.errors import JobError
from hpcdl.exchange.format import ALLOWED_DTYPES
from hpcdl.jobfile import load_job


def test_the_schedulers_registry_implements_every_backend_but_auto():
    from hpcdl.schedulers import SCHEDULERS

    assert {"auto", *SCHEDULERS} == set(choices(Backend))


def test_the_engine_builds_every_train_optimizer():
    from hpcdl.engine import TRAIN_OPTIMIZERS

    assert set(TRAIN_OPTIMIZERS) == set(choices(TrainOptimizer))


def test_the_applier_has_a_rule_for_every_update_rule_name():
    from hpcdl.applier.rules import UPDATE_RULES

    assert set(UPDATE_RULES) == set(choices(UpdateRuleName))


def test_every_exchange_choice_is_one_the_wire_format_carries():
    assert {np.dtype(d).str for d in choices(DeltaDtype)} <= {np.dtype(d).str for d in ALLOWED_DTYPES}
    assert choices(ExchangeKind) == ("gradient", "delta")  # the kinds hpcdl.exchange's docstring defines


def choice_fields():
    for section, cls in COMMON_SECTIONS.items():
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if typing.get_origin(hint) is typing.Literal:
                yield section, f.name, hint


@pytest.mark.parametrize("section,name,hint", list(choice_fields()), ids=lambda v: str(v))
def test_a_value_outside_a_choice_is_refused_naming_it_and_every_choice_is_accepted(section, name, hint):
    with pytest.raises(JobError, match=rf"^{section}\.{name} must be one of {', '.join(choices(hint))}; "
                                       r"got 'not-a-choice'$"):
        load_job("hep", [f"{section}.{name}=not-a-choice"])
    with pytest.raises(JobError, match=rf"^{section}\.{name} must be one of .*; got 3$"):
        _build_with(section, name, 3)  # a TOML number where text is expected


def _build_with(section, name, value):
    from hpcdl.config import build_job

    return build_job({"workload": "hep", section: {name: value}})


def test_the_cli_offers_the_fields_choices():
    from hpcdl.cli import main

    backend = next(p for p in main.commands["submit"].params if p.name == "backend")
    assert tuple(backend.type.choices) == choices(Backend)
