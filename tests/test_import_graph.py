"""hpcdl's modules import each other without a cycle at module level (imports inside functions,
made on purpose to break one or to defer TensorFlow, are not edges)."""

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "hpcdl"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:  # module level only
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def test_no_import_cycle():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: top_level_imports(p, set(files)) - {m} for m, p in files.items()}
    # importing a.b.c imports its packages a and a.b first
    for m in files:
        parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
        graph[m] |= {p for p in parents if p in files} - {m}
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
