"""CPU tuning for TensorFlow: threads, affinity, oneDNN and precision, decided before TensorFlow starts.

oneDNN reads `TF_ENABLE_ONEDNN_OPTS` once, when TensorFlow loads, so `ThreadPlan.environment()`
must be applied to `os.environ` before `import tensorflow`; the intra/inter-op pools are set right
after (`configure_tensorflow`). Every decision carries its reason, shown by `hpcdl doctor` and
written to each rank's log; every one can be overridden in the job's `[tuning]` section.

The rules (all pure functions below, tested in tests/engine/test_tuning.py):

* cores a rank owns: the CPUs its scheduler gave each task (`srun --cpus-per-task`, passed in by
  the caller), capped by the CPUs the process may run on; otherwise the usable CPUs (affinity mask, capped by a cgroup CPU
  quota) shared evenly by the ranks on this host, at least 1.
* intra-op threads = those cores (one op's parallel loops fill the rank's cores).
* inter-op threads: 2 when the rank owns 2 cores or more, else 1: independent ops of the backward
  pass (a layer's data and weight gradients) overlap; 2 was never slower than 1 where measured.
* intra-op threads below the rank's cores, and oneDNN off (Eigen), were both clearly slower.
* Data layout NHWC: hpcdl's layers are written NHWC, the layout oneDNN's CPU kernels take
  directly (they reorder to blocked formats internally); nothing to choose at run time.
* OpenMP variables: TensorFlow's pip wheels run oneDNN on TensorFlow's own thread pool and load no
  OpenMP runtime, so OMP_NUM_THREADS / KMP_* do not steer TensorFlow's kernels; they are still set
  (to the intra-op count) for OpenMP-linked libraries a rank may load (e.g. an MKL numpy, an
  Intel TensorFlow build). KMP_AFFINITY's pinning is switched off when several ranks share one CPU
  mask: "compact" would put every rank's threads on the same first cores.
* precision "mixed_bfloat16": Keras' mixed precision policy — the model computes in bfloat16
  (activations, convolutions, matmuls), weights, gradients' updates and the loss stay float32.
  Only on a CPU with a native bfloat16 unit (CpuInfo.bf16_unit); elsewhere the job is refused
  with one line at submit (local backend) and by each rank before TensorFlow loads.
* precision "bfloat16": float32 unless oneDNN is on and the CPU has native bfloat16
  arithmetic (AVX512_BF16 or AMX-BF16 in /proc/cpuinfo); otherwise the plan falls back to float32
  and says why. bfloat16 is oneDNN's "fpmath mode" (TF_SET_ONEDNN_FPMATH_MODE=BF16, and oneDNN's
  own ONEDNN_DEFAULT_FPMATH_MODE): tensors and variables stay float32, and oneDNN computes
  convolutions and matmuls from bfloat16-rounded inputs with float32 accumulation (on AMX tiles
  where there are some), so no model code changes. float32 sets the mode to STRICT, so a stray
  ONEDNN_DEFAULT_FPMATH_MODE in the user's environment cannot lower the precision unannounced.
* conv_weight_grad "auto": "gemm" where oneDNN runs AVX2 code (the CPU has AVX2 and no AVX-512,
  or ONEDNN_MAX_CPU_ISA caps it there: every rule reads the CPU as capped), else "tensorflow".
  This TensorFlow's oneDNN has its brgemm backward-weights convolution for AVX-512 and AMX only;
  on AVX2 it falls back to an older kernel that ran the large layers' weight gradient at half
  the forward's rate or less, and k² matmuls do better there (hpcdl.engine.nn says which
  layers). On AVX-512 and AMX oneDNN's own kernel is faster, so "gemm" is not chosen there.

The figures behind these rules, with the CPUs they were measured on, are in README's Figures and
bench/results/.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from hpcdl.config import TuningConfig

#: CPU flags (as /proc/cpuinfo spells them) that give native bfloat16 arithmetic.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

#: ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA before oneDNN 2) values: the flag prefixes each rules out.
_ISA_CAPS = {
    "SSE41": ("avx", "fma", "amx"), "AVX": ("avx2", "avx512", "fma", "amx"),
    "AVX2": ("avx512", "amx"), "AVX2_VNNI": ("avx512", "amx"), "AVX2_VNNI_2": ("avx512", "amx"),
    "AVX512_CORE": ("avx512_bf16", "avx512_fp16", "amx"),
    "AVX512_CORE_VNNI": ("avx512_bf16", "avx512_fp16", "amx"),
    "AVX512_CORE_BF16": ("avx512_fp16", "amx"), "AVX512_CORE_FP16": ("amx",), "AVX10_1_512": ("amx",),
}


# -- the CPU ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says about the first CPU: its model name and feature flags."""

    model: str = "unknown"
    flags: frozenset[str] = frozenset()

    @property
    def bf16_flags(self) -> tuple[str, ...]:
        return tuple(f for f in BF16_FLAGS if f in self.flags)

    @property
    def bf16(self) -> bool:
        """Native bfloat16 arithmetic (AVX512_BF16 dot products or AMX-BF16 tiles)."""
        return bool(self.bf16_flags)

    @property
    def bf16_unit(self) -> str:
        """The unit that does bfloat16 natively: 'AMX' (amx_bf16 tiles), 'AVX512_BF16' (dot
        products in AVX-512 registers), or 'none' (bfloat16 would be emulated in float32)."""
        if "amx_bf16" in self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512_BF16"
        return "none"

    @property
    def vector_isa(self) -> str:
        """The widest float SIMD the kernels can use: 'amx', 'avx512', 'avx2', 'sse'."""
        if "amx_tile" in self.flags and "amx_bf16" in self.flags:
            return "amx"
        if {"avx512f", "avx512bw", "avx512vl"} <= self.flags:
            return "avx512"
        if {"avx2", "fma"} <= self.flags:
            return "avx2"
        return "sse"


def parse_cpuinfo(text: str) -> CpuInfo:
    """The model name and flags of the first processor block of a /proc/cpuinfo text."""
    model, flags = "unknown", frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if model != "unknown" and flags:
                break  # end of the first processor block
            continue
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip() or "unknown"
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model=model, flags=flags)


def onednn_isa_cap(env: Mapping[str, str]) -> str:
    """The ISA oneDNN is capped to in `env` (ONEDNN_MAX_CPU_ISA), upper case; "" when not capped."""
    return (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def capped_cpu(cpu: CpuInfo, cap: str) -> CpuInfo:
    """The CPU as oneDNN uses it under ONEDNN_MAX_CPU_ISA=`cap`: the flags above the cap removed,
    so the rules (bfloat16, vector ISA, weight gradient) follow what the kernels will run."""
    ruled_out = _ISA_CAPS.get(cap, ())
    return CpuInfo(cpu.model, frozenset(f for f in cpu.flags if not f.startswith(ruled_out)))


def read_cpuinfo(path: str | os.PathLike[str] = "/proc/cpuinfo",
                 env: Mapping[str, str] | None = None) -> CpuInfo:
    """/proc/cpuinfo's first CPU as oneDNN will use it: capped by ONEDNN_MAX_CPU_ISA in `env`
    (default os.environ)."""
    try:
        cpu = parse_cpuinfo(Path(path).read_text(errors="replace"))
    except OSError:
        return CpuInfo()
    return capped_cpu(cpu, onednn_isa_cap(os.environ if env is None else env))


def openblas_coretype(cpu: CpuInfo) -> str | None:
    """The OpenBLAS kernel family for this CPU, for OPENBLAS_CORETYPE.

    OpenBLAS's runtime detection (DYNAMIC_ARCH) falls back to its oldest x86-64 kernels
    ('Prescott', SSE3) on CPUs newer than the build knows — numpy 1.26's OpenBLAS 0.3.23 does so
    on Sapphire Rapids under KVM and runs sgemm ~7x below what the CPU does. Forcing the newest
    family the flags allow fixes it. Only numpy uses OpenBLAS here (TensorFlow has oneDNN/Eigen).
    """
    if "avx512_bf16" in cpu.flags and {"avx512f", "avx512bw", "avx512vl"} <= cpu.flags:
        return "Cooperlake"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= cpu.flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= cpu.flags:
        return "Haswell"
    return None


# -- cores a rank owns -----------------------------------------------------------------------


def parse_cgroup_quota(cpu_max: str | None = None, cfs_quota_us: str | None = None,
                       cfs_period_us: str | None = None) -> float | None:
    """CPUs a cgroup CPU quota allows (cgroup v2 `cpu.max`, or v1 quota/period); None: no quota."""
    try:
        if cpu_max is not None:
            quota, _, period = cpu_max.strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or "100000")
        if cfs_quota_us is not None and cfs_period_us is not None:
            quota_v1 = int(cfs_quota_us.strip())
            return None if quota_v1 < 0 else quota_v1 / int(cfs_period_us.strip())
    except ValueError:
        return None
    return None


def cgroup_cpu_quota(root: str | os.PathLike[str] = "/sys/fs/cgroup") -> float | None:
    root = Path(root)

    def read(name: str) -> str | None:
        try:
            return (root / name).read_text()
        except OSError:
            return None

    v2 = read("cpu.max")
    if v2 is not None:
        return parse_cgroup_quota(cpu_max=v2)
    return parse_cgroup_quota(cfs_quota_us=read("cpu/cpu.cfs_quota_us") or read("cpu.cfs_quota_us"),
                              cfs_period_us=read("cpu/cpu.cfs_period_us") or read("cpu.cfs_period_us"))


def affinity_cores() -> int:
    """CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_cpulist(text: str) -> frozenset[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set of CPU numbers; "" is the empty set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def numa_domains(root: str | os.PathLike[str] = "/sys/devices/system/node") -> list[frozenset[int]]:
    """The CPUs of each NUMA node with CPUs, in node order ([] where the system does not say)."""
    domains = []
    for node in sorted(Path(root).glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            domains.append(cpus)
    return domains


def rank_layouts(cpus: list[int], domains: list[frozenset[int]]) -> dict[str, list[list[int]]]:
    """Ways to lay ranks on these CPUs, each a list of the CPU sets of its ranks: one rank on all
    of them, two ranks on halves, and one rank per NUMA domain (the CPUs of each domain that are
    in `cpus`) when they span more than one."""
    cpus = sorted(cpus)
    layouts = {f"1x{len(cpus)}": [cpus]}
    if len(cpus) >= 2:
        half = len(cpus) // 2
        layouts[f"2x{half}"] = [cpus[:half], cpus[half:2 * half]]
    per_domain = [sorted(set(cpus) & d) for d in domains]
    per_domain = [d for d in per_domain if d]
    if len(per_domain) > 1 and len({len(d) for d in per_domain}) == 1:
        layouts[f"{len(per_domain)}x{len(per_domain[0])} (a rank per NUMA domain)"] = per_domain
    return layouts


def usable_cores(affinity: int | None = None, quota: float | None = None) -> int:
    """CPUs this process can use: the affinity mask, capped by a cgroup CPU quota (at least 1).

    Called with no arguments it reads both from the system.
    """
    if affinity is None:
        affinity = affinity_cores()
        quota = cgroup_cpu_quota()
    cores = max(1, int(affinity))
    if quota is not None and quota > 0:
        cores = min(cores, max(1, int(quota)))  # a quota of 1.5 CPUs keeps 1 thread busy per core
    return cores


def cores_per_rank(cpus_per_task: int | None, usable: int, ranks_on_host: int) -> tuple[int, str]:
    """Cores this rank owns, and why.

    `usable`: CPUs this process may use (see `usable_cores`). `cpus_per_task`: the CPUs the
    scheduler gave this task alone (`srun --cpus-per-task=c`), capped by `usable`. Without it (the
    local backend, or a scheduler that gave no CPUs per task) the ranks on this host share `usable`
    evenly.
    """
    ranks = max(1, int(ranks_on_host))
    usable = max(1, int(usable))
    if cpus_per_task:
        if cpus_per_task > usable:
            return usable, f"{cpus_per_task} CPUs per task, but this process may use only {usable} CPUs"
        return cpus_per_task, f"{cpus_per_task} CPUs per task"
    share = max(1, usable // ranks)
    why = f"{usable} usable cores / {ranks} rank(s) on this host"
    if ranks > usable:
        why += f" (oversubscribed: {ranks} ranks share {usable} cores)"
    return share, why


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadPlan:
    """What one rank uses, and why (shown by `hpcdl doctor`, logged by each rank)."""

    cores: int
    intra_op: int
    inter_op: int
    onednn: bool
    precision: str = "float32"
    conv_weight_grad: str = "tensorflow"  # "tensorflow" or "gemm": see the module docstring
    kmp_blocktime: int = 0
    kmp_affinity: str = "granularity=fine,compact,1,0"
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def reason(self) -> str:
        """All reasons on one line: `intra_op: ...; inter_op: ...`."""
        return "; ".join(f"{k}: {v}" for k, v in self.reasons)

    def why(self, key: str) -> str:
        return dict(self.reasons).get(key, "")

    def environment(self) -> dict[str, str]:
        """Variables to put in os.environ before TensorFlow loads."""
        return {
            # Read by OpenMP runtimes and by OpenBLAS (numpy); TensorFlow's wheels load none.
            "OMP_NUM_THREADS": str(self.intra_op),
            "KMP_BLOCKTIME": str(self.kmp_blocktime),
            "KMP_AFFINITY": self.kmp_affinity,
            "TF_ENABLE_ONEDNN_OPTS": "1" if self.onednn else "0",
            # Read by TensorFlow when it creates its thread pools (configure_tensorflow sets the
            # same values through tf.config, which wins if TensorFlow was already imported).
            "TF_NUM_INTRAOP_THREADS": str(self.intra_op),
            "TF_NUM_INTEROP_THREADS": str(self.inter_op),
            # bfloat16: oneDNN rounds the inputs of convolutions/matmuls to bfloat16 (AMX), keeps
            # float32 accumulation, tensors and variables. TensorFlow reads the first variable when
            # it creates oneDNN primitives; oneDNN reads the second itself.
            "TF_SET_ONEDNN_FPMATH_MODE": "BF16" if self.precision == "bfloat16" else "",
            "ONEDNN_DEFAULT_FPMATH_MODE": "BF16" if self.precision == "bfloat16" else "STRICT",
            # TensorFlow's C++ INFO lines are noise on every rank of a thousand-node run.
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1"),
        }

    def describe(self) -> str:
        """One line for a rank's log."""
        return (f"threads: intra-op {self.intra_op}, inter-op {self.inter_op} on {self.cores} core(s); "
                f"oneDNN {'on' if self.onednn else 'off'}; {self.precision}; conv weight gradient "
                f"{self.conv_weight_grad}; KMP_AFFINITY="
                f"{self.kmp_affinity} — {self.reason}")


def _setting(tuning: TuningConfig, name: str) -> str:
    """`tuning.x = v`, marked as the default or as set by the job."""
    value = getattr(tuning, name)
    origin = "default" if value == getattr(TuningConfig(), name) else "job"
    shown = str(value).lower() if isinstance(value, bool) else value
    return f"{origin}: tuning.{name} = {shown}"


def plan_inter_op(tuning: TuningConfig, cores: int) -> tuple[int, str]:
    if tuning.inter_op_threads:
        return tuning.inter_op_threads, _setting(tuning, "inter_op_threads")
    if cores >= 2:
        return 2, "2 when a rank owns >= 2 cores (make bench, HEP step: up to 1.15x inter-op 1, never slower)"
    return 1, "1: the rank owns one core"


def plan_precision(tuning: TuningConfig, cpu: CpuInfo | None) -> tuple[str, str]:
    wanted = getattr(tuning, "precision", "float32")
    if wanted == "mixed_bfloat16":
        if cpu is None:
            return wanted, f"{_setting(tuning, 'precision')} (CPU not checked)"
        if cpu.bf16:
            return wanted, (f"{_setting(tuning, 'precision')}; the CPU's bfloat16 unit: {cpu.bf16_unit} "
                            "(bfloat16 activations, float32 weights and loss)")
        return "float32", f"refused: {precision_refusal(tuning, cpu)}"
    if wanted != "bfloat16":
        return "float32", _setting(tuning, "precision")
    if not tuning.onednn:
        return "float32", (f"{_setting(tuning, 'precision')}, but bfloat16 is oneDNN's fpmath mode "
                           "and tuning.onednn = false: float32")
    if cpu is None:
        return "bfloat16", f"{_setting(tuning, 'precision')} (CPU not checked)"
    if cpu.bf16:
        return "bfloat16", (f"{_setting(tuning, 'precision')}; the CPU has {', '.join(cpu.bf16_flags)}: "
                            "oneDNN fpmath mode BF16")
    return "float32", (f"{_setting(tuning, 'precision')}, but this CPU lacks AVX512_BF16/AMX-BF16 "
                       "(bfloat16 would be emulated, slower than float32): float32")


def plan_conv_weight_grad(tuning: TuningConfig, cpu: CpuInfo | None) -> tuple[str, str]:
    """"tensorflow" or "gemm" for the convolutions' weight gradient (see the module docstring)."""
    wanted = getattr(tuning, "conv_weight_grad", "auto")
    if wanted != "auto":
        return wanted, _setting(tuning, "conv_weight_grad")
    if not tuning.onednn:
        return "tensorflow", "auto: oneDNN off (measured only against oneDNN's kernel)"
    if cpu is None:
        return "tensorflow", "auto: CPU not checked"
    if cpu.vector_isa == "avx2":
        return "gemm", ("auto: AVX2 without AVX-512: oneDNN has no brgemm backward-weights kernel there, and "
                        "the large layers' weight gradient as matmuls made the HEP step 0.86x as "
                        "long on that code path (README Figures)")
    return "tensorflow", f"auto: {cpu.vector_isa}: oneDNN's backward-weights kernel is the faster one"


def precision_refusal(tuning: TuningConfig, cpu: CpuInfo) -> str | None:
    """One line why `tuning.precision` cannot run on `cpu`, or None.

    Only mixed_bfloat16 is refused: it changes the model's compute dtype, and without a native
    bfloat16 unit TensorFlow emulates every bfloat16 convolution in float32 at a fraction of the
    float32 speed (bench/results: 0.09x on an AVX2 EPYC). 'bfloat16' (oneDNN's fpmath mode)
    leaves the model float32 and falls back to exactly float32 instead (see plan_precision).
    """
    if tuning.precision != "mixed_bfloat16" or cpu.bf16:
        return None
    return (f"tuning.precision = mixed_bfloat16 needs native bfloat16 (AVX512_BF16 or AMX), and this "
            f"CPU ({cpu.model}, {cpu.vector_isa}) has neither: use float32")


def precision_policy(precision: str):
    """Keras' mixed precision policy for a `tuning.precision` value: its compute_dtype is what the
    model computes in, its variable_dtype what the weights (and so the optimizer and the exchange)
    keep. mixed_bfloat16: bfloat16 activations and matmuls, float32 master weights. 'bfloat16'
    (fpmath) and float32 keep a float32 model. Imports Keras (so TensorFlow)."""
    from keras import mixed_precision

    return mixed_precision.DTypePolicy("mixed_bfloat16" if precision == "mixed_bfloat16" else "float32")


def plan_affinity(tuning: TuningConfig, cores: int, mask: int, ranks_on_host: int) -> tuple[str, str]:
    """KMP_AFFINITY: the job's, unless ranks share one CPU mask (then pinning would stack them)."""
    if ranks_on_host > 1 and mask > cores and tuning.kmp_affinity not in ("", "disabled", "none"):
        return "disabled", (f"{ranks_on_host} ranks share one {mask}-CPU mask: '{tuning.kmp_affinity}' "
                            "would pin every rank's threads to the same first cores")
    return tuning.kmp_affinity, _setting(tuning, "kmp_affinity")


def plan_threads(tuning: TuningConfig, cores: int, why: str, *, ranks_on_host: int = 1,
                 mask: int | None = None, cpu: CpuInfo | None = None) -> ThreadPlan:
    """The plan of one rank owning `cores` cores (`why`: where that number came from).

    `mask`: CPUs in the process's affinity mask (default: `cores`); `cpu`: the CPU's flags, for
    the bfloat16 and weight-gradient rules (None: not checked).
    """
    cores = max(1, int(cores))
    if tuning.intra_op_threads:
        intra, intra_why = tuning.intra_op_threads, _setting(tuning, "intra_op_threads")
        if intra > cores:
            intra_why += f" (more than the {cores} core(s) this rank owns: oversubscribed)"
    else:
        intra, intra_why = cores, f"cores this rank owns: {why}"
    inter, inter_why = plan_inter_op(tuning, cores)
    precision, precision_why = plan_precision(tuning, cpu)
    weight_grad, weight_grad_why = plan_conv_weight_grad(tuning, cpu)
    affinity, affinity_why = plan_affinity(tuning, cores, mask if mask is not None else cores, ranks_on_host)
    onednn_why = _setting(tuning, "onednn") + (" (oneDNN kernels, TensorFlow's default on x86)"
                                               if tuning.onednn else " (Eigen kernels)")
    return ThreadPlan(
        cores=cores, intra_op=intra, inter_op=inter, onednn=tuning.onednn, precision=precision,
        conv_weight_grad=weight_grad, kmp_blocktime=tuning.kmp_blocktime, kmp_affinity=affinity,
        reasons=(("intra_op", intra_why), ("inter_op", inter_why), ("onednn", onednn_why),
                 ("precision", precision_why), ("conv_weight_grad", weight_grad_why),
                 ("kmp_affinity", affinity_why)),
    )


def plan_for_this_process(tuning: TuningConfig, ranks_on_host: int, env: Mapping[str, str] | None = None,
                          cpus_per_task: int | None = None) -> ThreadPlan:
    """The plan of a rank started here: reads the affinity mask, cgroup quota and /proc/cpuinfo."""
    env = os.environ if env is None else env
    mask = affinity_cores()
    usable = usable_cores(mask, cgroup_cpu_quota())
    cores, why = cores_per_rank(cpus_per_task, usable, ranks_on_host)
    return plan_threads(tuning, cores, why, ranks_on_host=ranks_on_host, mask=usable, cpu=read_cpuinfo(env=env))


def configure_tensorflow(plan: ThreadPlan) -> None:
    """After `import tensorflow`, before any op runs."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(plan.intra_op)
    tf.config.threading.set_inter_op_parallelism_threads(plan.inter_op)
    from hpcdl.engine import nn

    nn.set_conv_weight_grad(plan.conv_weight_grad)


def compute_dtype(precision: str) -> str:
    """The dtype a model computes in for a `tuning.precision` value (variables stay float32):
    bfloat16 for mixed_bfloat16 only; oneDNN's fpmath 'bfloat16' keeps float32 tensors. The same
    as precision_policy(precision).compute_dtype, without importing Keras."""
    return "bfloat16" if precision == "mixed_bfloat16" else "float32"


def onednn_enabled() -> bool | None:
    """Whether the loaded TensorFlow runs oneDNN kernels (None: cannot tell). Imports TensorFlow."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:
        return None


def loaded_openmp_runtimes() -> list[str]:
    """OpenMP runtimes mapped into this process (libgomp, libiomp5, libomp); Linux only."""
    names = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                base = os.path.basename(path)
                if base.startswith(("libgomp", "libiomp", "libomp")):
                    names.add(base)
    except OSError:
        pass
    return sorted(names)


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `tensorflow` once and loads it with file descriptor 2 on /dev/null: from 2.20 on
    TensorFlow logs through absl before absl is initialised, to stderr, whatever
    TF_CPP_MIN_LOG_LEVEL says (tensorflow/tensorflow#100442), and a CLI's one-line error must
    stay one line. Only the import is silenced; an import that fails still raises."""

    def find_spec(self, name, path, target=None):
        if name != "tensorflow" or getattr(self, "_finding", False):
            return None
        self._finding = True  # the search below passes through this finder again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        with stderr_silenced():
            module.__spec__.loader = self._loader
            self._loader.exec_module(module)


@contextlib.contextmanager
def stderr_silenced():
    """File descriptor 2 on /dev/null for the block: what TensorFlow's C++ side prints as its
    libraries load (also when they are loaded through ctypes)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def quiet_tensorflow_import() -> None:
    """Silence what TensorFlow prints while it loads, if it has not loaded yet and
    TF_CPP_MIN_LOG_LEVEL asks for less than INFO (the CLI's default)."""
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") in ("", "0"):
        return
    if not any(isinstance(f, _QuietTensorFlowImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorFlowImport())
