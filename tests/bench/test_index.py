"""bench.index and the result names of bench.harness: the index describes files that exist, and
INDEX.md is what the index renders."""

from __future__ import annotations

import re

import pytest

from bench import index
from bench.harness import RESULTS, machine_tag, result_path


def test_every_indexed_result_exists_and_superseded_ones_name_their_successor():
    entries = index.load_index()
    assert entries and index.problems(entries) == []
    assert {e["status"] for e in entries} == set(index.STATUSES)


def test_index_md_is_rendered_from_the_index():
    assert index.INDEX_MD.read_text() == index.render(index.load_index())


def test_a_superseded_entry_outside_superseded_or_without_successor_is_a_problem():
    entry = {"file": "race/2026-12-01_104302-amd-epyc-avx2.json", "suite": "race", "status": "superseded",
             "superseded_by": "race/nowhere.json", "what": "x"}
    [problem] = index.problems([entry])
    assert "superseded" in problem and entry["file"] in problem


@pytest.mark.parametrize("facts, tag", [
    ({"cpu": "AMD EPYC 7B13 64-Core Processor", "isa": "avx2"}, "amd-epyc-7b13-avx2"),
    ({"cpu": "Intel(R) Xeon(R) Platinum 8488C CPU @ 2.40GHz", "isa": "amx"}, "intel-xeon-platinum-8488c-amx"),
    ({"cpu": "Intel(R) Xeon(R) Processor", "isa": "avx2", "onednn_isa_cap": "AVX2"}, "intel-xeon-onednn-avx2"),
    ({"cpu": "", "isa": "sse"}, "unknown-sse"),
])
def test_the_machine_in_a_result_name_is_the_cpu_model_and_its_isa(facts, tag):
    assert machine_tag(facts) == tag


def test_a_result_is_named_by_suite_date_and_machine():
    path = result_path("race", {"cpu": "AMD EPYC", "isa": "avx512"}, when=0)
    assert path.parent == RESULTS / "race"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_\d{6}-amd-epyc-avx512\.json", path.name)
    with pytest.raises(ValueError, match="unknown suite"):
        result_path("no-such-suite", {"cpu": "x", "isa": "avx2"})
