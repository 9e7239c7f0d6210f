"""The harness every benchmark of bench/ shares: the measuring process's protocol (:class:`Probe`),
rows of figures and the state of a `make bench` run (:class:`Row`, :class:`Bench`), the machine's
facts recorded with every result (:func:`machine`, CPU model included), the table
(:func:`render`), an earlier run to compare with (:func:`previous_results`) and where results are
written (:func:`result_path`, :func:`write_result`: ``bench/results/<suite>/<date>-<machine>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
HPCDL = str(Path(sys.executable).with_name("hpcdl"))


# Every suite that writes results, and the module that does (bench/README.md describes them).
SUITES = {
    "bench": "run",  # `make bench`'s table
    "race": "hybrid_race",
    "emulated-race": "emulated_race",
    "coldstart": "coldstart",
    "exchange-load": "exchange_load",
    "precision": "precision_parity",
    "profile": "profile_step",
    "variants": "step_variants",
    "threads": "",  # one study of inter-op threads, run by hand with bench.probe (no module of its own)
    "climate": "climate_semisupervised",
    "keras": "keras_parity",
    "collectives": "collectives",
    "stacks": "stack_compare",
}


def module_argv(module: str, *args: str) -> list[str]:
    """The command that runs one of bench's modules (`python -m bench.<module>`); start it with
    cwd=REPO, where the package is found."""
    return [sys.executable, "-m", f"bench.{module}", *args]


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def best(xs):
    return max(xs) if xs else None


def median(xs):
    return statistics.median(xs) if xs else None


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def mem_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return float("inf")


def gf(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.1f} GFLOP/s"


# -- a measuring process ----------------------------------------------------------------------


class Probe:
    """bench.probe in its own process, answering JSON commands (its docstring has them)."""

    def __init__(self, name: str, args: list[str], logdir: Path, timeout: float = 900.0, python: str = sys.executable):
        """`python`: the interpreter (another venv's, to set two installations side by side)."""
        self.name = name
        self.timeout = timeout
        self.stderr = open(logdir / f"probe-{name}.log", "w")
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.proc = subprocess.Popen([python, *module_argv("probe", *args)[1:]], stdin=subprocess.PIPE, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"probe {self.name}: no answer in {self.timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise BenchError(f"probe {self.name} died (exit {self.proc.returncode}); see {self.stderr.name}")
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise BenchError(f"probe {self.name} died (exit {self.proc.wait()}); see {self.stderr.name}")
            if line.startswith("@@ "):
                out = json.loads(line[3:])
                if out.get("ok") is False:
                    raise BenchError(f"probe {self.name}: {out['error']}\n{out.get('trace', '')}")
                return out

    def send(self, **cmd) -> None:
        """A command without waiting for its answer (receive() reads it): several probes at once."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        return self._read()

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


# -- the results ------------------------------------------------------------------------------


@dataclass
class Row:
    key: str  # stable across runs, for --compare
    section: str
    what: str
    value: str
    ratio: str = ""
    note: str = ""
    number: float | None = None  # the figure compared across runs


@dataclass
class Bench:
    args: argparse.Namespace
    work: Path
    logdir: Path
    rows: list[Row] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    sgemm: list[float] = field(default_factory=list)  # every numpy sgemm FLOP/s measured
    tf_mm: list[float] = field(default_factory=list)  # every TensorFlow float32 matmul FLOP/s
    tf_default: Probe | None = None
    numpy: Probe | None = None

    def row(self, key, section, what, value, ratio="", note="", number=None) -> None:
        self.rows.append(Row(key, section, what, value, ratio, note, number))
        log(f"{section}: {what}: {value} {ratio} {note}".rstrip())

    @property
    def peak(self) -> float | None:
        """The better of numpy's sgemm and TensorFlow's float32 matmul: the stricter denominator."""
        return best(self.sgemm + self.tf_mm)

    def peak_ratio(self, flops: float | None) -> str:
        if flops is None or not self.peak:
            return ""
        return f"{flops / self.peak:.2f} of peak"

    # -- probes -----------------------------------------------------------------------------

    def numpy_probe(self) -> Probe:
        if self.numpy is None:
            self.numpy = Probe("numpy", ["--role", "numpy"], self.logdir)
            self.data["numpy"] = self.numpy.info
        return self.numpy

    def sgemm_sample(self, reps: int = 2) -> float:
        out = self.numpy_probe().ask(op="sgemm", n=self.args.sgemm_n, reps=reps,
                                     min_seconds=self.args.peak_seconds)
        rates = [out["flops"] / s for s in out["seconds"]]
        self.sgemm.extend(rates)
        return max(rates)

    def tf_probe(self) -> Probe:
        if self.tf_default is None:
            self.tf_default = Probe("tf-default", ["--role", "tf", "--image", "224"], self.logdir)
            self.data["tf_default"] = self.tf_default.info
        return self.tf_default

    def close_tf(self) -> None:
        if self.tf_default is not None:
            self.tf_default.close()
            self.tf_default = None

    def close(self) -> None:
        self.close_tf()
        if self.numpy is not None:
            self.numpy.close()
            self.numpy = None


# -- output -----------------------------------------------------------------------------------


def hep_data(work: Path, events: int, image: int, *, fractions: tuple[float, ...] | None = None) -> dict[str, Path]:
    """A generated HEP set (train, val, test), cached under `work`: the generator is
    deterministic, so its version, the events, the image size and the split name the set. Returns
    the files and, in `generation_seconds`, what generating each set took in this process."""
    from hpcdl.workloads.hep.generate import GENERATOR_VERSION, generate

    split = "" if fractions is None else "-f" + "-".join(f"{f:g}" for f in fractions)
    out = work / "data" / f"hep-v{GENERATOR_VERSION}-e{events}-s{image}{split}"
    files = {k: out / f"{k}.h5" for k in ("train", "val", "test")}
    if not all(p.is_file() for p in files.values()):
        log(f"generating {events} HEP events at {image}x{image} into {out} (cached for later runs)")
        start = time.perf_counter()
        generate(out, events, image_size=image, seed=0, **({"fractions": fractions} if fractions else {}))
        generation_seconds[out.name] = time.perf_counter() - start
    return files


generation_seconds: dict[str, float] = {}


def machine() -> dict[str, Any]:
    from hpcdl.engine.tuning import onednn_isa_cap, read_cpuinfo, usable_cores

    cpu = read_cpuinfo()  # as oneDNN uses it: capped by ONEDNN_MAX_CPU_ISA, if that is set
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    virt = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Hypervisor vendor:\s*(\S+)", lscpu)
        virt = m.group(1) if m else ""
    except OSError:
        pass
    from importlib import metadata

    versions = {}
    for dist in ("tensorflow-cpu", "tensorflow", "horovod", "numpy", "h5py"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu.model, "isa": cpu.vector_isa, "versions": versions, "bf16": cpu.bf16,
            "bf16_unit": cpu.bf16_unit, "flags": " ".join(sorted(cpu.flags)), "usable_cores": usable_cores(),
            "hypervisor": virt, "host": socket.gethostname(), "python": platform.python_version(),
            "commit": commit, "mem_available_gb": round(mem_available_gb(), 1),
            "onednn_isa_cap": onednn_isa_cap(os.environ), "load_average": loadavg()}


_CPU_NOISE = re.compile(r"\((r|tm)\)|\b(processor|cpu|\d+-core)\b|@.*", re.IGNORECASE)


def machine_tag(m: dict[str, Any]) -> str:
    """The machine in a result's name: the CPU model and the ISA its kernels use, e.g.
    "amd-epyc-avx512", or under ONEDNN_MAX_CPU_ISA the cap ("intel-xeon-onednn-avx2")."""
    model = re.sub(r"[^a-z0-9]+", "-", _CPU_NOISE.sub(" ", m.get("cpu") or "unknown").lower()).strip("-")
    cap = m.get("onednn_isa_cap")
    return f"{model or 'unknown'}-{'onednn-' + cap.lower() if cap else m.get('isa') or 'unknown'}"


def result_path(suite: str, m: dict[str, Any] | None = None, when: float | None = None) -> Path:
    """Where a suite's result of now (or `when`) on this machine (or `m`) goes:
    bench/results/<suite>/<date>_<time>-<machine>.json (bench/results/INDEX.md says what each is).
    The suite's directory is made here, so a study may write the file itself."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    stamp = time.strftime("%Y-%m-%d_%H%M%S", time.localtime(when))
    (RESULTS / suite).mkdir(parents=True, exist_ok=True)
    return RESULTS / suite / f"{stamp}-{machine_tag(m or machine())}.json"


def publish(path: Path, data: bytes) -> Path:
    """Write a file of bench/ whole (a crash leaves the old file or none, never half of one)."""
    from hpcdl.fs.files import atomic_write_bytes

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, data)


def publish_png(path: Path, fig) -> Path:
    """Publish a matplotlib figure as a PNG (laid out tight) and close it."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return publish(path, buf.getvalue())


def write_result(path: Path, doc: Any) -> Path:
    """Publish one result file (JSON)."""
    return publish(path, json.dumps(doc, indent=1, default=str).encode())


def previous_results(compare: str | None, suite: str) -> dict | None:
    """An earlier result to set beside this run's: a file, or "latest" (the suite's newest)."""
    if not compare:
        return None
    path: Path | None = Path(compare)
    if compare == "latest":
        olds = sorted((RESULTS / suite).glob("*.json"))  # names start with the date
        path = olds[-1] if olds else None
    return json.loads(path.read_text()) if path and path.is_file() else None


def render(b: Bench, m: dict, previous: dict | None) -> str:
    head = (f"hpcdl bench — {m['cpu']}{' (' + m['hypervisor'] + ')' if m['hypervisor'] else ''}, "
            f"{m['usable_cores']} cores, {m['isa']}"
            f"{' (ONEDNN_MAX_CPU_ISA=' + m['onednn_isa_cap'] + ')' if m.get('onednn_isa_cap') else ''}, TF "
            f"{m['versions'].get('tensorflow-cpu') or m['versions'].get('tensorflow', '?')}, "
            f"commit {m['commit']}, {b.data['started']}; load avg {b.data['load_start']:.1f} → "
            f"{b.data['load_end']:.1f}; {b.data['elapsed_s'] / 60:.1f} min")
    cols = ["section", "measurement", "value", "ratio", "notes"]
    prev = {}
    if previous:
        prev = {r["key"]: r for r in previous.get("rows", [])}
        cols.insert(4, "previous")
    rows = []
    for r in b.rows:
        cells = [r.section, r.what, r.value, r.ratio, r.note]
        if previous:
            cells.insert(4, prev.get(r.key, {}).get("value", "-"))
        rows.append(cells)
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [head, "", line(cols), line(["-" * w for w in widths[:-1]] + ["-----"])]
    out += [line(r) for r in rows]
    out.append("")
    out.append(f"peak = the best float32 matrix multiply of this run, numpy sgemm or TensorFlow matmul "
               f"({gf(b.peak)}); each figure is the best of its rounds (medians in notes): the machine "
               f"is shared and figures move with its load.")
    return "\n".join(out)

