"""What this installation is: versions, Horovod's build, oneDNN, the CPU, and the thread plan of a
rank — each setting with the reason it was chosen."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, get_args

from hpcdl.config import Controller, TuningConfig
from hpcdl.errors import JobError
from hpcdl.engine.tuning import (
    CpuInfo,
    ThreadPlan,
    affinity_cores,
    cgroup_cpu_quota,
    loaded_openmp_runtimes,
    onednn_enabled,
    onednn_isa_cap,
    openblas_coretype,
    plan_for_this_process,
    read_cpuinfo,
    usable_cores,
)


@dataclass(frozen=True)
class RankSetup:
    """Where a rank on this host would run and the thread plan it would get."""

    cpu: CpuInfo
    mask: int
    quota: float | None
    usable: int
    ranks_on_host: int
    plan: ThreadPlan

    @classmethod
    def here(cls, tuning: TuningConfig | None = None, ranks_on_host: int = 1,
             cpus_per_task: int | None = None) -> "RankSetup":
        """`tuning`: a job's `[tuning]` section (default: the defaults); `ranks_on_host`: how many
        ranks would share this host."""
        cpu, mask, quota = read_cpuinfo(), affinity_cores(), cgroup_cpu_quota()
        plan = plan_for_this_process(tuning or TuningConfig(), ranks_on_host, cpus_per_task=cpus_per_task)
        usable = usable_cores(mask, quota)
        return cls(cpu, mask, quota, usable, ranks_on_host, plan)


def report_here() -> dict[str, Any]:
    """`hpcdl doctor`: this process set up as a rank would be, before TensorFlow loads, then
    reported."""
    setup = RankSetup.here()
    os.environ.update(setup.plan.environment())
    return report(setup)


def report(setup: RankSetup) -> dict[str, Any]:
    """A flat, ordered dict (rendered as a two-column table by the CLI, or as JSON).

    Call it with the plan's environment in effect (``os.environ.update(setup.plan.environment())``
    before TensorFlow loads, as a worker does): what oneDNN and OpenMP report depends on it.
    """
    cpu, mask, quota, usable, plan = setup.cpu, setup.mask, setup.quota, setup.usable, setup.plan
    import h5py
    import numpy
    import tensorflow as tf

    omp = loaded_openmp_runtimes()
    onednn_live = onednn_enabled()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "tensorflow": tf.__version__,
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "cpu_model": cpu.model,
        "cpu_vector_isa": cpu.vector_isa,
        "cpu_bfloat16": bf16_label(cpu),
        "onednn_max_cpu_isa": (f"{onednn_isa_cap(os.environ)}: the CPU rules read the flags it leaves"
                               if onednn_isa_cap(os.environ) else "not set"),
        "usable_cores": usable,
        "usable_cores_why": (f"affinity mask {mask} CPUs" +
                             (f", cgroup quota {quota:g} CPUs" if quota is not None else ", no cgroup quota")),
        "ranks_on_host": setup.ranks_on_host,
        "intra_op_threads": plan.intra_op,
        "intra_op_why": plan.why("intra_op"),
        "inter_op_threads": plan.inter_op,
        "inter_op_why": plan.why("inter_op"),
        "onednn": plan.onednn,
        "onednn_why": plan.why("onednn"),
        "onednn_active": onednn_live,
        "data_format": "NHWC (hpcdl's layers; oneDNN's native CPU input layout)",
        "precision": plan.precision,
        "precision_why": plan.why("precision"),
        "conv_weight_grad": plan.conv_weight_grad,
        "conv_weight_grad_why": plan.why("conv_weight_grad"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "KMP_AFFINITY": os.environ.get("KMP_AFFINITY"),
        "KMP_AFFINITY_why": plan.why("kmp_affinity"),
        "KMP_BLOCKTIME": os.environ.get("KMP_BLOCKTIME"),
        "openmp_runtime": (", ".join(omp) if omp else
                           "none loaded (oneDNN runs on TensorFlow's thread pool: OMP_*/KMP_* "
                           "only reach OpenMP-linked libraries)"),
    }
    return {**info, **_numpy_blas(cpu), **_collectives()}


def _collectives() -> dict[str, Any]:
    """How Horovod was built (a broken build is exactly what doctor must report), whether mpi4py
    loads an MPI, the MPI launcher the local backend would use, and so which run.controller
    values this installation can run, with why not for the others."""
    from hpcdl.process.launch import find_mpi_launcher, mpi4py_problem
    from hpcdl.schedulers.select import choose_controller

    info: dict[str, Any] = {}
    why_not: dict[str, str] = {}
    try:
        import horovod
        import horovod.tensorflow as hvd

        info.update({
            "horovod": horovod.__version__,
            "horovod_tensorflow": True,
            "horovod_gloo": bool(hvd.gloo_built()),
            "horovod_mpi": bool(hvd.mpi_built()),
        })
        if not hvd.gloo_built():
            why_not["gloo"] = "Horovod was built without Gloo"
        if not hvd.mpi_built():
            why_not["mpi"] = "Horovod was built without MPI (`make install MPI=1`)"
    except Exception as exc:
        info.update({"horovod": f"unusable: {exc}", "horovod_tensorflow": False})
        why_not["gloo"] = why_not["mpi"] = f"Horovod does not load ({exc})"
    problem = mpi4py_problem(sys.executable)
    info["mpi4py"] = problem or "loads an MPI library"
    if problem:
        why_not["mpi4py"] = f"mpi4py cannot load MPI: {problem}"
    launcher = find_mpi_launcher()
    info["mpi_launcher"] = (f"{launcher.path} ({'Open MPI' if launcher.open_mpi else 'not Open MPI'})" if launcher
                            else "none (the local backend's MPI-launched controllers need mpirun)")
    if launcher is None:
        for name in ("mpi", "mpi4py"):
            why_not.setdefault(name, "no mpirun or mpiexec for the local backend (SLURM's srun --mpi may still start it)")
    info["controllers"] = ", ".join(c for c in get_args(Controller) if c != "auto" and c not in why_not) or "none"
    try:
        info["controller_auto"] = choose_controller()[0]
    except JobError as exc:
        info["controller_auto"] = f"none: {exc}"
    info.update({f"controller_{name}_why_not": why for name, why in why_not.items()})
    return info


def bf16_label(cpu) -> str:
    """The CPU's bfloat16 unit as doctor and the bench name it, with the flags it comes from."""
    if cpu.bf16:
        return f"{cpu.bf16_unit} ({', '.join(cpu.bf16_flags)})"
    return ("none (no avx512_bf16 / amx_bf16 in /proc/cpuinfo: bfloat16 would be emulated; "
            "tuning.precision = mixed_bfloat16 is refused)")


def _numpy_blas(cpu) -> dict[str, Any]:
    """numpy's OpenBLAS kernel family, and a hint when its runtime detection fell back."""
    core = openblas_core_in_use()
    if core is None:
        return {}
    out: dict[str, Any] = {"numpy_openblas_core": core}
    best = openblas_coretype(cpu)
    if best and core.lower() in ("prescott", "core2", "nehalem", "atom", "barcelona", "katmai"):
        out["numpy_openblas_hint"] = (f"OpenBLAS did not recognise this CPU; export "
                                      f"OPENBLAS_CORETYPE={best} for numpy's BLAS (TensorFlow does "
                                      f"not use it)")
    return out


def openblas_core_in_use() -> str | None:
    """The kernel family numpy's bundled OpenBLAS picked, e.g. 'Haswell' (None: not OpenBLAS)."""
    import ctypes
    import glob

    import numpy

    libs_dir = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    for lib in sorted(glob.glob(os.path.join(libs_dir, "libopenblas*.so*"))):
        try:
            so = ctypes.CDLL(lib)
        except OSError:
            continue
        for symbol in ("openblas_get_corename64_", "openblas_get_corename"):
            fn = getattr(so, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode(errors="replace")
    return None
