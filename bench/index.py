"""The results index: bench/results/index.json says what each result file is and whether it is
current or superseded; bench/results/INDEX.md is rendered from it.

    python -m bench.index            # rewrite INDEX.md from index.json
    python -m bench.index --check    # exit 1 if INDEX.md is stale, an entry's file is missing,
                                     # or a result file has no entry
    python -m bench.index --new SUITE   # print a new result's name (for a study's --json)

A new result is described by adding its entry to index.json (file, suite, machine, status
"current" or "superseded" with "superseded_by", what it measured and why it was run); a
superseded file moves to <suite>/superseded/.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from bench.harness import REPO, RESULTS, SUITES, publish, result_path

INDEX = RESULTS / "index.json"
INDEX_MD = RESULTS / "INDEX.md"
STATUSES = ("current", "superseded")


def load_index(path: Path = INDEX) -> list[dict]:
    return json.loads(path.read_text())["results"]


def summary(module: str) -> str:
    """The first line of a bench module's docstring, read without importing it."""
    if not module:
        return ""
    doc = ast.get_docstring(ast.parse((REPO / "bench" / f"{module}.py").read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def render(entries: list[dict]) -> str:
    """INDEX.md: per suite, its command, then its current results and its superseded ones."""
    out = ["# bench/results", "",
           "What each result file is. Names are `<suite>/<date>_<time>-<machine>.json` (the machine: the CPU model",
           "and the ISA its kernels used, `onednn-<isa>` under ONEDNN_MAX_CPU_ISA); superseded results are in",
           "`<suite>/superseded/`. Rendered from `index.json` by `python -m bench.index`; bench/README.md says what",
           "each suite measures and how long it takes.", ""]
    for suite, module in SUITES.items():
        rows = [e for e in entries if e["suite"] == suite]
        if not rows:
            continue
        command = f"`python -m bench.{module}`" if module else "no module of its own"
        out += [f"## {suite}", "", f"{summary(module)} ({command})".lstrip(), ""]
        for status in STATUSES:
            chosen = [e for e in rows if e["status"] == status]
            if not chosen:
                continue
            head = "| file | what | was |" if status == "current" else "| file | what | superseded by | was |"
            out += [f"**{status}**", "", head, "|---" * (head.count("|") - 1) + "|"]
            for e in chosen:
                what = e["what"] + (f" ({e['note']})" if e.get("note") else "")
                cells = [f"`{e['file']}`", what]
                if status == "superseded":
                    cells.append(f"`{e['superseded_by']}`")
                cells.append(f"`{e['was']}`" if e.get("was") else "")
                out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
            out.append("")
    return "\n".join(out)


def problems(entries: list[dict]) -> list[str]:
    """What is wrong in the index: entries whose file is missing, unknown suites or statuses,
    superseded entries without their successor or outside superseded/."""
    found = []
    named = {e["file"] for e in entries}
    for e in entries:
        where = e["file"]
        if not (RESULTS / where).is_file():
            found.append(f"{where}: in the index, not on disk")
        if e["suite"] not in SUITES or not where.startswith(e["suite"] + "/"):
            found.append(f"{where}: suite {e['suite']!r} unknown or not its directory")
        if e["status"] not in STATUSES:
            found.append(f"{where}: status {e['status']!r} is not one of {', '.join(STATUSES)}")
        if e["status"] == "superseded" and (e.get("superseded_by") not in named
                                            or not where.startswith(e["suite"] + "/superseded/")):
            found.append(f"{where}: superseded, but its successor is not indexed or it is not in superseded/")
    return found


def undescribed(entries: list[dict]) -> list[str]:
    """Result files on disk that the index does not describe (a new run's, until described)."""
    named = {e["file"] for e in entries}
    files = (path.relative_to(RESULTS).as_posix() for path in sorted(RESULTS.rglob("*.json")) if path != INDEX)
    return [f"{rel}: no entry in index.json" for rel in files if rel not in named]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="check, write nothing")
    ap.add_argument("--new", metavar="SUITE", choices=SUITES, help="print where a result of SUITE made now goes")
    args = ap.parse_args(argv)
    if args.new:
        print(result_path(args.new).relative_to(REPO))
        return 0
    entries = load_index()
    text = render(entries)
    if args.check:
        found = problems(entries) + undescribed(entries)
        if INDEX_MD.read_text() != text:
            found.append(f"{INDEX_MD.name} is stale: python -m bench.index rewrites it")
        print("\n".join(found) or "index OK")
        return 1 if found else 0
    publish(INDEX_MD, text.encode())
    print(f"wrote {INDEX_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
