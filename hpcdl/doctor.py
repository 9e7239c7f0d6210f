"""What this installation is: versions, Horovod's build, oneDNN, and the thread plan of a rank."""

from __future__ import annotations

import os
import platform
from typing import Any

from hpcdl.config import TuningConfig
from hpcdl.tuning import cores_per_rank, plan_threads, usable_cores


def report(tuning: TuningConfig | None = None, ranks_on_host: int = 1) -> dict[str, Any]:
    tuning = tuning or TuningConfig()
    cores, why = cores_per_rank(os.environ, usable_cores(), ranks_on_host)
    plan = plan_threads(tuning, cores, why)
    os.environ.update(plan.environment(tuning))  # before TensorFlow loads, as a worker does
    import h5py
    import numpy
    import tensorflow as tf

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "tensorflow": tf.__version__,
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "1",
        "usable_cores": usable_cores(),
        "intra_op_threads": plan.intra_op,
        "inter_op_threads": plan.inter_op,
        "threads_reason": plan.reason,
        "KMP_AFFINITY": os.environ.get("KMP_AFFINITY"),
        "KMP_BLOCKTIME": os.environ.get("KMP_BLOCKTIME"),
    }
    try:
        import horovod
        import horovod.tensorflow as hvd

        info.update({
            "horovod": horovod.__version__,
            "horovod_tensorflow": True,
            "horovod_gloo": bool(hvd.gloo_built()),
            "horovod_mpi": bool(hvd.mpi_built()),
        })
    except Exception as exc:  # a broken Horovod build is exactly what doctor must report
        info.update({"horovod": f"unusable: {exc}", "horovod_tensorflow": False})
    return info
