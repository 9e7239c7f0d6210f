"""The generated reference pages: committed as the code renders them, and saying what the code does."""

import dataclasses
import subprocess
import sys

from hpcdl.config import COMMON_SECTIONS, RunConfig
from hpcdl.reference import field_comments, render_cli, render_configuration, stale_pages
from tests.conftest import REPO


def test_committed_pages_match_the_code():
    stale = stale_pages(REPO)
    assert not stale, f"{[str(p) for p in stale]} differ from the code: run `python -m hpcdl.reference`"


def test_check_mode_exits_1_on_a_stale_page(tmp_path):
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "docs" / "reference" / "configuration.md").write_text("# old\n")
    check = [sys.executable, "-m", "hpcdl.reference", "--check", str(tmp_path)]
    stale = subprocess.run(check, capture_output=True, text=True)
    assert stale.returncode == 1
    assert "configuration.md differs from the code" in stale.stderr
    assert subprocess.run([sys.executable, "-m", "hpcdl.reference", str(tmp_path)], capture_output=True).returncode == 0
    assert subprocess.run(check, capture_output=True).returncode == 0


def test_every_field_of_every_section_is_listed():
    page = render_configuration()
    for section, cls in COMMON_SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in page


def test_a_row_carries_type_default_allowed_values_and_help():
    page = render_configuration()
    row = next(line for line in page.splitlines() if line.startswith("| `run.backend` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "string" and cells[2] == '`"auto"`'
    assert all(choice in cells[3] for choice in ("auto", "local", "slurm"))
    assert "slurm where sbatch is on PATH" in cells[4]
    shards = next(line for line in page.splitlines() if line.startswith("| `exchange.shards` |"))
    assert "integer or string" in shards and '"auto"' in shards


def test_field_comments_read_line_and_block_comments():
    @dataclasses.dataclass
    class Example:
        # Said of both fields below.
        first: int = 1
        second: int = 2
        third: int = 3  # its own

        fourth: int = 4

    comments = field_comments(Example, "x")
    assert comments == {"first": "Said of both fields below.", "second": "see `x.first`", "third": "its own"}
    assert field_comments(RunConfig)["group_size"].startswith("0: all nodes")


def test_cli_page_lists_every_command_and_option():
    from hpcdl.cli import main

    page = render_cli()
    for name in main.list_commands(None):
        assert f"## `hpcdl {name}`" in page
    assert "## `hpcdl data generate`" in page
    assert "`--dry-run`" in page and "`--group-size INTEGER RANGE`" in page


def test_planner_inputs_page_lists_every_input_with_both_presets():
    from hpcdl.perf.inputs import FIELDS
    from hpcdl.reference import render_planner_inputs

    page = render_planner_inputs()
    for f in FIELDS:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{f.name}` |"))
        assert row.count("|") == 6
    assert "`1.9e+12`: paper" in page


def test_required_fields_none_defaults_and_lists_render_as_a_job_file_spells_them():
    from hpcdl.reference import section_table

    @dataclasses.dataclass(frozen=True)
    class Section:
        builder: str  # the user's function
        limit: int | None = None
        sizes: tuple[int, ...] = (32, 64)

    rows = section_table("model", Section)
    assert rows[2] == "| `model.builder` | string | (required) |  | the user's function |"
    assert rows[3].startswith("| `model.limit` | integer | none |")
    assert rows[4].startswith("| `model.sizes` | list of integers | `[32, 64]` |")
