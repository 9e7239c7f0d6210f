"""The docs are tested: every shell block of README.md and docs/ runs, and every link resolves.

A page's ```sh blocks run in order, in one fresh directory per page, with the test's hpcdl first
on PATH (bash -e: a failing command fails the page). A block is kept from this run only by a
marker on the line before it: `<!-- doc-test: skip (why) -->` for what cannot run here (an
install, `make test` itself, a site's own partition), or `<!-- doc-test: slurm -->` for a block
that runs against the test cluster (tests/slurm/test_docs_on_slurm.py). A page that starts from
a data set, rather than making one, says `<!-- doc-test: setup hep-data -->`: its directory
then holds a tiny HEP set at data/hep/ before its first block; `setup peaks-example` puts the
worked example (examples/peaks, installed) at peaks/.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, write_nersc

PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
MARKER = re.compile(r"<!--\s*doc-test:\s*(skip|slurm)\b[^>]*-->")
SETUP = re.compile(r"<!--\s*doc-test:\s*setup\s+([\w-]+)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = {"sh", "bash"}
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    marker: str  # "", "skip" or "slurm"
    text: str


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, each with the marker on the line before it."""
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, language = i, match.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        before = lines[start - 1] if start else ""
        marker = MARKER.search(before)
        found.append(Block(page, start + 1, language, marker.group(1) if marker else "",
                           "\n".join(lines[start + 1:i])))
        i += 1
    return found


def shell_blocks(page: Path, marker: str) -> list[Block]:
    return [b for b in blocks(page) if b.language in SHELL and b.marker == marker]


def setups(page: Path) -> set[str]:
    return set(SETUP.findall(page.read_text(encoding="utf-8")))


def write_hep_data(directory: Path) -> None:
    """A tiny HEP set at directory/data/hep/, in the layout `hpcdl data generate hep` writes."""
    data = directory / "data" / "hep"
    data.mkdir(parents=True)
    for split, n, seed in (("train", 1024, 1), ("val", 256, 2), ("test", 256, 3)):
        write_nersc(data / f"{split}.h5", n, seed=seed)


def prepare(directory: Path, page: Path) -> None:
    """What a page says it starts from."""
    from tests.examples.conftest import copy_and_install_example

    known = {"hep-data": write_hep_data, "peaks-example": copy_and_install_example}
    for setup in setups(page):
        if setup not in known:
            raise AssertionError(f"{page}: unknown doc-test setup {setup!r}")
        known[setup](directory)


def run_block(block: Block, cwd: Path, env: dict[str, str], rewrite=lambda text: text) -> subprocess.CompletedProcess:
    script = rewrite(block.text)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    where = f"{block.page.relative_to(REPO)}:{block.line}"
    assert proc.returncode == 0, (f"{where} exited {proc.returncode}\n$ {script}\n"
                                  f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def shell_env() -> dict[str, str]:
    """This test's installation first on PATH, as `source .venv/bin/activate` puts it."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def trains(block: Block) -> bool:
    commands = re.split(r"(?<!\\)\n", block.text)  # a command continued over lines is one
    return any(re.search(r"\bhpcdl (submit|resume)\b", c) and "--dry-run" not in c for c in commands)


RUNNABLE = [p for p in PAGES if shell_blocks(p, "")]
# Pages that train: a minute or more each on two shared cores, so outside `make test-fast`.
TRAINING = {p for p in RUNNABLE if any(trains(b) for b in shell_blocks(p, ""))}


@pytest.mark.parametrize("page", [pytest.param(p, marks=[pytest.mark.slow] if p in TRAINING else [], id=page_id(p))
                                  for p in RUNNABLE])
def test_shell_blocks_run(page, tmp_path):
    prepare(tmp_path, page)
    env = shell_env()
    blocks = shell_blocks(page, "")
    assert blocks, f"{page_id(page)} is listed as runnable but has no shell block to run"
    for block in blocks:
        assert run_block(block, tmp_path, env).returncode == 0


def test_the_pages_have_blocks_that_run_and_markers_that_are_known():
    assert {REPO / "README.md", REPO / "docs" / "getting-started.md"} <= set(PAGES)
    assert shell_blocks(REPO / "docs" / "getting-started.md", "")
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for comment in re.findall(r"<!--\s*doc-test:[^>]*-->", text):
            assert MARKER.search(comment) or SETUP.search(comment), f"{page_id(page)}: unknown marker {comment}"
        for block in blocks(page):
            if block.marker:
                assert block.language in SHELL, f"{page_id(page)}:{block.line}: a marker on a {block.language!r} block"


def test_readme_shows_the_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^make run\b", text, re.M) and re.search(r"^make test\b", text, re.M)


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


def broken_links(page: Path) -> list[str]:
    """The links of a page to files (and their headings) that do not exist."""
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... are outside the repo
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_inside_the_repo_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page_id(page)}: links that do not resolve: {broken}"


def test_the_link_check_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code) [gone](nothing.md) [bad anchor](other.md#nope)\n"
                    "![picture](missing.png) [web](https://example.org) `[not a link](x.md)`\n"
                    "```sh\n[in code](y.md)\n```\n[here](#nowhere)\n")
    assert broken_links(page) == ["nothing.md", "other.md#nope", "missing.png", "#nowhere"]


def test_blocks_carry_the_marker_on_the_line_before_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```sh\necho run\n```\n<!-- doc-test: skip (no) -->\n```sh\necho skipped\n```\n"
                    "<!-- doc-test: slurm -->\n```bash\necho cluster\n```\n```toml\nx = 1\n```\n")
    assert [(b.language, b.marker, b.text) for b in blocks(page)] == [
        ("sh", "", "echo run"), ("sh", "skip", "echo skipped"), ("bash", "slurm", "echo cluster"), ("toml", "", "x = 1")]
    assert [b.text for b in shell_blocks(page, "")] == ["echo run"]
    assert trains(Block(page, 1, "sh", "", "hpcdl submit hep \\\n  --nodes 2"))
    assert not trains(Block(page, 1, "sh", "", "hpcdl submit hep \\\n  --dry-run"))
