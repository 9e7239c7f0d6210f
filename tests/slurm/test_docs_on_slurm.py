"""The docs' SLURM blocks (`<!-- doc-test: slurm -->`), run against the real local cluster.

A page's SLURM blocks run in order in one fresh directory holding a tiny HEP set at data/hep/,
as tests/test_docs.py runs a page's other blocks. What a site would put in its job file for this
test cluster (several slurmd on one loopback host) is added to every `hpcdl submit` and
`hpcdl resume` command, before a trailing comment.
"""

import re
import subprocess
import time

import pytest

from tests.conftest import HPCDL
from tests.test_docs import PAGES, page_id, run_block, shell_blocks, shell_env, write_hep_data

pytestmark = pytest.mark.slurm

TEST_CLUSTER = ["slurm.rendezvous_host=127.0.0.1", "slurm.gloo_iface=lo", "slurm.cpus_per_task=1",
                "slurm.time=00:10:00"]
SETTINGS = " ".join(f"--set {s}" for s in TEST_CLUSTER)
ON_SLURM = [p for p in PAGES if shell_blocks(p, "slurm")]


def with_test_cluster(script: str) -> str:
    """`script` with the test cluster's settings at the end of each hpcdl submit/resume command
    (a command continued with backslashes ends on its last line; a comment stays last)."""
    out, command = [], []
    for line in script.split("\n"):
        command.append(line)
        if line.endswith("\\"):
            continue
        if re.search(r"\bhpcdl (submit|resume)\b", "\n".join(command)):
            body, comment = re.match(r"^(.*?)(\s+#\s.*)?$", command[-1]).groups()
            command[-1] = f"{body} {SETTINGS}{comment or ''}"
        out += command
        command = []
    return "\n".join(out + command)


def test_the_settings_end_each_command_before_its_comment():
    script = "hpcdl submit hep --dry-run    # print\nhpcdl submit hep \\\n  --nodes 4\nls -l  # list"
    assert with_test_cluster(script).split("\n") == [
        f"hpcdl submit hep --dry-run {SETTINGS}    # print", "hpcdl submit hep \\", f"  --nodes 4 {SETTINGS}",
        "ls -l  # list"]


@pytest.fixture
def cancels_what_it_submitted(tmp_path):
    yield
    for run in sorted((tmp_path / "runs").glob("*/run.json")):
        subprocess.run([HPCDL, "cancel", str(run.parent)], cwd=tmp_path, capture_output=True, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=60).stdout.strip():
            break
        time.sleep(0.5)


@pytest.mark.parametrize("page", ON_SLURM, ids=page_id)
def test_slurm_blocks_run(page, slurm_cluster, tmp_path, cancels_what_it_submitted):
    write_hep_data(tmp_path)
    env = shell_env()
    blocks = shell_blocks(page, "slurm")
    assert blocks, f"{page} is listed for SLURM but has no block marked for it"
    for block in blocks:
        assert run_block(block, tmp_path, env, rewrite=with_test_cluster).returncode == 0
