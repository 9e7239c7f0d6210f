"""hpcdl's modules import each other without a cycle, imports inside functions and under
`if TYPE_CHECKING:` included, and the job schema sits at the bottom.

One allowance, named: an import inside a function of a module that loads TensorFlow or Horovod
(itself, or through what it imports) is deferred so that the CLI, the scheduler and the applier
start without them; such an import is not an edge. Any other import is one, wherever it stands.
"""

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "hpcdl"
HEAVY = ("tensorflow", "horovod", "keras")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str, known: set[str], top_level: bool) -> set[str]:
    """The hpcdl modules (and heavy libraries) that `path` imports: at module level only, or
    everywhere (function bodies too)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in HEAVY}
    return found


def test_no_import_cycle():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    top = {m: imports(p, m, known, top_level=True) - {m} for m, p in files.items()}
    everywhere = {m: imports(p, m, known, top_level=False) - {m} for m, p in files.items()}

    def parents(m: str) -> set[str]:  # importing a.b.c imports its packages a and a.b first
        return {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)} & known - {m}

    loads_heavy: dict[str, bool] = {}

    def heavy(m: str, seen=()) -> bool:
        if m not in loads_heavy:
            deps = top.get(m, set()) | parents(m)
            loads_heavy[m] = bool(deps & set(HEAVY)) or any(heavy(d, seen + (m,)) for d in deps - set(seen) if d in known)
        return loads_heavy[m]

    graph = {}
    for m in files:
        deferred = everywhere[m] - top[m]
        graph[m] = ((top[m] | {d for d in deferred if d in known and not heavy(d)}) & known) | parents(m)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1 and not m.startswith(n + "."):  # a package's own submodule is not a cycle
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert len(files) > 40  # the walk saw the package
    assert heavy("hpcdl.engine.train") and not heavy("hpcdl.cli")  # the allowance is what it says


def test_the_job_schema_imports_nothing_of_hpcdl_above_it():
    """config declares the fields and their choices; every layer reads them, so it reads none."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = imports(files["hpcdl.config"], "hpcdl.config", set(files), top_level=False)
    assert found == {"hpcdl.errors"}


def test_the_exchange_protocol_knows_no_run_directory_and_no_process_above_it():
    """exchange/ is the protocol beneath the run directory (hpcdl.rundir.run_exchange binds the two)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    above = {"hpcdl.rundir.runs", "hpcdl.jobfile", "hpcdl.rundir.run_exchange", "hpcdl.process.lifecycle", "hpcdl.process.worker",
             "hpcdl.commands.submit", "hpcdl.commands.resume", "hpcdl.cli", "hpcdl.commands.status"}
    for module, path in files.items():
        if module.startswith("hpcdl.exchange"):
            found = imports(path, module, set(files), top_level=False)
            assert not {m for m in found if m in above or m.startswith(("hpcdl.schedulers", "hpcdl.engine",
                                                                          "hpcdl.workloads", "hpcdl.applier"))}, module


def test_the_engine_knows_no_run_directory_no_scheduler_and_no_workload():
    """engine/ is given its checkpoint directory, recorder and exchange by the worker; it reads no
    run directory, job file or SLURM variable, and a workload reaches it as an argument."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    above = {"hpcdl.rundir.runs", "hpcdl.jobfile", "hpcdl.fs.files", "hpcdl.fs.storage", "hpcdl.rundir.steptimes", "hpcdl.fs.access",
             "hpcdl.rundir.group_files", "hpcdl.rundir.run_exchange", "hpcdl.process.lifecycle", "hpcdl.process.launch", "hpcdl.process.worker"}
    for module, path in files.items():
        if module.startswith("hpcdl.engine"):
            found = imports(path, module, set(files), top_level=False)
            assert not {m for m in found if m in above or m.startswith(("hpcdl.schedulers", "hpcdl.workloads",
                                                                          "hpcdl.exchange", "hpcdl.applier"))}, module
            assert "SLURM_" not in path.read_text().replace("SLURM's", ""), module
            assert not re.search(r"from hpcdl\.config import .*\bJob\b", path.read_text()), module  # a GroupTask


def test_the_planner_reaches_workloads_through_their_interface():
    """perf/ plans and times any job's network by its workload's methods: it imports the registry
    and the interface, never one workload's own modules."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for module, path in files.items():
        if module.startswith("hpcdl.perf"):
            found = imports(path, module, set(files), top_level=False)
            assert not {m for m in found if m.startswith("hpcdl.workloads.")
                        and m not in ("hpcdl.workloads.base", "hpcdl.workloads.get_workload")}, module


# The top level by role, from the bottom up: a unit (a folder of hpcdl/, or a top-level module)
# imports only from its own layer or a lower one, wherever the import stands.
LAYERS = [
    {"errors", "adam", "config", "registry", "resources", "fs"},  # the schema and the leaves
    {"engine", "exchange", "workloads"},  # training, the exchange protocol, the science
    {"applier", "jobfile", "rundir"},  # the parameter server; a job file; a run's directory
    {"process", "schedulers"},  # a run's processes and what starts them
    {"perf"},
    {"commands"},
    {"cli"},
    {"reference"},  # documents the CLI
]


def test_no_unit_imports_from_a_higher_layer():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    layer = {unit: n for n, units in enumerate(LAYERS) for unit in units}
    assert set(layer) == {m.split(".")[1] for m in files if m.count(".")} - {"__init__"} | {
        module_name(p).split(".")[1] for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    upward = []
    for module, path in files.items():
        if module == "hpcdl":
            continue
        unit = module.split(".")[1]
        for found in imports(path, module, set(files), top_level=False):
            other = found.split(".")[1] if found.startswith("hpcdl.") else None
            if other and other != unit and layer[other] > layer[unit]:
                upward.append(f"{module} -> {found}")
    assert not upward, upward
