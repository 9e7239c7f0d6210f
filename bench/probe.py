"""A measuring process for bench.harness.Probe (`python -m bench.probe`): started once, then driven
by JSON commands on stdin.

Keeping the process alive lets the bench interleave measurements of several configurations (each in
its own process, since oneDNN and the thread pools are fixed when TensorFlow loads) round by round,
so that the noise of a shared machine hits all of them alike. Replies are single lines on stdout
starting with "@@ "; anything else there (library chatter) is ignored by the harness.

Roles:

* ``--role numpy``: sgemm with numpy (OpenBLAS), large square float32 matrices. OPENBLAS_CORETYPE
  is set from /proc/cpuinfo unless already set (OpenBLAS 0.3.23 misdetects Sapphire Rapids under
  KVM as 'Prescott', SSE3 only, and runs ~7x slower); the kernel in use is reported.
* ``--role tf``: TensorFlow set up exactly as a rank would be (hpcdl.engine.tuning's plan for the given
  [tuning] values, applied before TensorFlow loads; --precision bfloat16 is the job option, i.e.
  oneDNN's BF16 fpmath mode on the unchanged float32 model), the HEP network of the paper
  (HepCNN(HepModelConfig()), 5 convolutions of 128 3×3 filters) at --image², and the engine's
  training step: the workload's loss, gradient tape, hpcdl.engine.optim's Adam. No Horovod (one rank's
  allreduce is a copy); `make bench`'s sustained figure comes from a real `hpcdl submit` run.
  Also: TensorFlow's own matmul (float32 / bfloat16), and the step with precision
  "mixed_bfloat16": the same model and variables computing in bfloat16 (the engine's
  tuning.precision = "mixed_bfloat16"), beside the fpmath mode of the --precision process.
* ``--role eval``: score snapshots (TF checkpoints or exchange weight files) of a HEP model on an
  HDF5 file; used by the hybrid section for AUC against wall time.

Commands (one JSON object a line): {"op": "sgemm", "n": 4096, "reps": 2}, {"op": "matmul",
"dtype": "float32"}, {"op": "setup", "batches": [32]}, {"op": "step", "batch": 32, "precision":
"float32", "n": 1}, {"op": "auc", "snapshots": [...]}, {"op": "info"}, {"op": "quit"}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path


def reply(obj) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed(fn, cmd) -> list[float]:
    """Seconds per call, `reps` samples; each sample repeats the call for at least `min_seconds`
    (so a peak is measured over the same time scale as the training step it is compared with,
    not over one short burst)."""
    out = []
    for _ in range(int(cmd.get("reps", 2))):
        calls, t = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t
            if elapsed >= float(cmd.get("min_seconds", 0.0)):
                break
        out.append(elapsed / calls)
    return out


# -- numpy ------------------------------------------------------------------------------------


class NumpyProbe:
    def __init__(self, args):
        from hpcdl.engine.tuning import openblas_coretype, read_cpuinfo

        self.coretype_set = "OPENBLAS_CORETYPE" in os.environ
        if not self.coretype_set and not args.no_coretype:
            core = openblas_coretype(read_cpuinfo())
            if core:
                os.environ["OPENBLAS_CORETYPE"] = core
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
        import numpy as np

        from hpcdl.commands.doctor import openblas_core_in_use

        self.np = np
        self.core = openblas_core_in_use()
        self.mats = {}

    def info(self, _cmd):
        return {"role": "numpy", "openblas_core": self.core,
                "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
                "threads": os.environ.get("OPENBLAS_NUM_THREADS"), "rss_mb": rss_mb()}

    def sgemm(self, cmd):
        np = self.np
        n = int(cmd.get("n", 4096))
        if n not in self.mats:
            rng = np.random.default_rng(0)
            a = rng.standard_normal((n, n), dtype=np.float32)
            b = rng.standard_normal((n, n), dtype=np.float32)
            c = np.empty((n, n), np.float32)
            np.matmul(a, b, out=c)  # warm-up: threads started, pages touched
            self.mats = {n: (a, b, c)}
        a, b, c = self.mats[n]
        return {"n": n, "flops": 2.0 * n ** 3,
                "seconds": timed(lambda: np.matmul(a, b, out=c), cmd)}


# -- TensorFlow -------------------------------------------------------------------------------


class TfProbe:
    def __init__(self, args):
        from hpcdl.config import TuningConfig
        from hpcdl.engine.tuning import cores_per_rank, plan_threads, read_cpuinfo, usable_cores

        tuning = TuningConfig(intra_op_threads=args.intra, inter_op_threads=args.inter,
                              onednn=bool(args.onednn), precision=args.precision,
                              conv_weight_grad=args.conv_weight_grad)
        cores, why = cores_per_rank(None, usable_cores(), 1)
        self.plan = plan_threads(tuning, cores, why, cpu=read_cpuinfo())
        os.environ.update(self.plan.environment())
        for item in args.env:  # extra variables for a tuning experiment
            key, _, value = item.partition("=")
            os.environ[key] = value
        self.extra_env = list(args.env)
        self.cores = usable_cores()  # CPU share of a step: CPU seconds / (wall × these)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        from hpcdl.engine.tuning import configure_tensorflow, onednn_enabled

        configure_tensorflow(self.plan)
        self.tf = tf
        self.onednn_active = onednn_enabled()
        self.image = args.image
        self.steps = {}
        self.batches = {}
        self.model = None

    def info(self, _cmd):
        return {"role": "tf", "intra_op": self.plan.intra_op, "inter_op": self.plan.inter_op,
                "onednn": self.plan.onednn, "onednn_active": self.onednn_active,
                "precision": self.plan.precision, "plan": self.plan.describe(), "env": self.extra_env,
                "tf": self.tf.__version__, "image": self.image, "rss_mb": rss_mb(),
                "flops_per_example": self._model().flops().training}

    def _model(self):
        if self.model is None:
            from hpcdl.engine.optim import make_optimizer
            from hpcdl.workloads.hep.config import HepModelConfig
            from hpcdl.workloads.hep.model import HepCNN

            self.model = HepCNN(HepModelConfig(), (self.image, self.image, 3), seed=0)
            self.variables = [v for _, v in self.model.named_variables()]
            self.optimizer = make_optimizer("adam", self.variables, 1e-3)
        return self.model

    def _batch(self, batch: int):
        if batch not in self.batches:
            import numpy as np

            rng = np.random.default_rng(batch)
            self.batches[batch] = (
                rng.random((batch, self.image, self.image, 3), dtype=np.float32),
                (np.arange(batch) % 2).astype(np.int32),
                np.ones(batch, np.float32),
            )
        return self.batches[batch]

    def _step_fn(self, precision: str):
        if precision in self.steps:
            return self.steps[precision]
        tf = self.tf
        model = self._model()
        from hpcdl.engine.step import make_train_step
        from hpcdl.engine.tuning import compute_dtype
        from hpcdl.workloads.hep.workload import WORKLOAD

        variables, optimizer = self.variables, self.optimizer
        if precision == "mixed_bfloat16":
            # the engine's mixed precision model: the same layers and variables, computing in bfloat16
            model = copy.copy(model)
            model.compute_dtype = tf.as_dtype(compute_dtype(precision))
        # the engine's step, minus Horovod (see the module docstring)
        step = make_train_step(lambda batch: WORKLOAD.loss(model, batch, training=True), variables, optimizer)
        train_step = lambda batch: step(batch)[0]  # noqa: E731

        self.steps[precision] = train_step
        return train_step

    def setup(self, cmd):
        """Trace and run one step per (batch, precision): tracing and oneDNN's primitive
        creation are paid here, not in the timed steps."""
        out = {}
        for batch in cmd.get("batches", [32]):
            for precision in cmd.get("precisions", ["float32"]):
                t = time.perf_counter()
                self._step_fn(precision)(self._batch(batch)).numpy()
                out[f"{precision}/{batch}"] = time.perf_counter() - t
        return {"first_step_seconds": out, "rss_mb": rss_mb()}

    def step(self, cmd):
        batch, precision = int(cmd.get("batch", 32)), cmd.get("precision", "float32")
        fn, data = self._step_fn(precision), self._batch(batch)
        times, shares = [], []
        for _ in range(int(cmd.get("n", 1))):
            c, t = cpu_seconds(), time.perf_counter()
            fn(data).numpy()
            wall = time.perf_counter() - t
            times.append(wall)
            shares.append((cpu_seconds() - c) / (wall * self.cores))
        return {"batch": batch, "precision": precision, "seconds": times, "cpu_share": shares,
                "flops": float(self._model().flops().training * batch)}

    def matmul(self, cmd):
        tf = self.tf
        n, dtype = int(cmd.get("n", 4096)), cmd.get("dtype", "float32")
        key = ("mm", n, dtype)
        if key not in self.steps:
            a = tf.random.stateless_normal((n, n), seed=(1, 2), dtype=tf.float32)
            b = tf.random.stateless_normal((n, n), seed=(3, 4), dtype=tf.float32)
            a, b = tf.cast(a, dtype), tf.cast(b, dtype)
            fn = tf.function(lambda: tf.reduce_sum(tf.cast(tf.linalg.matmul(a, b)[:1, :1], tf.float32)))
            fn().numpy()
            self.steps[key] = fn
        fn = self.steps[key]
        return {"n": n, "dtype": dtype, "flops": 2.0 * n ** 3, "seconds": timed(lambda: fn().numpy(), cmd)}

    def auc(self, cmd):
        """AUCs of snapshots: [{"path": ckpt prefix or .hx file}, ...] on cmd["data"]."""
        import numpy as np

        from hpcdl.exchange import read_file
        from hpcdl.workloads.hep import metrics
        from hpcdl.workloads.hep.config import HepModelConfig
        from hpcdl.workloads.hep.model import HepCNN
        from hpcdl.workloads.hep.workload import WORKLOAD

        tf = self.tf
        model = HepCNN(HepModelConfig(**cmd["model"]), tuple(cmd["input_shape"]), seed=0)
        variables = dict(model.named_variables())
        out = []
        signer = None
        if cmd.get("run_dir"):  # exchange files are signed with the run's key
            from hpcdl.rundir.runs import RunDir

            signer = RunDir(Path(cmd["run_dir"])).signer()
        for path in cmd["snapshots"]:
            if path.endswith(".hx"):
                _header, tensors = read_file(Path(path), run_id=None, signer=signer)
                for name, var in variables.items():
                    var.assign(tensors[name])
            else:
                tf.train.Checkpoint(model=model).restore(path).expect_partial()
            parts = [WORKLOAD.scores(model, cmd["stats"], Path(d), batch_size=600) for d in cmd["data"]]
            s = {k: np.concatenate([p[k] for p in parts]) for k in ("score", "y", "w")}
            r = metrics.evaluate_scores(s["score"], s["y"], s["w"])
            # the validation loss as bench.emulated_race scores it: the workload's own, on the
            # first loss_events examples of the first file
            loss = WORKLOAD.validate(model, cmd["stats"], Path(cmd["data"][0]), cmd.get("loss_events", 1024))["loss"]
            out.append({"path": path, "auc_weighted": r.auc_weighted, "auc_unweighted": r.auc_unweighted,
                        "loss": loss})
        return {"results": out}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["numpy", "tf", "eval"], required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="numpy: BLAS threads")
    parser.add_argument("--no-coretype", action="store_true", help="numpy: keep OpenBLAS's own CPU detection")
    parser.add_argument("--intra", type=int, default=0, help="tf: tuning.intra_op_threads (0: derive)")
    parser.add_argument("--inter", type=int, default=0, help="tf: tuning.inter_op_threads (0: derive)")
    parser.add_argument("--onednn", type=int, default=1)
    parser.add_argument("--precision", default="float32", help="tf: tuning.precision")
    parser.add_argument("--conv-weight-grad", default="auto", help="tf: tuning.conv_weight_grad")
    parser.add_argument("--env", action="append", default=[], help="tf: KEY=VALUE set before TensorFlow loads")
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--cpus", default="", help="tf: run on these CPUs only (a rank's share: 0,1)")
    args = parser.parse_args()
    if args.cpus:  # before the plan, which counts the CPUs this process may use
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    probe = NumpyProbe(args) if args.role == "numpy" else TfProbe(args)
    reply({"ready": True, **probe.info({})})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        try:
            reply({"ok": True, **getattr(probe, op)(cmd)})
        except Exception as exc:  # reported to the harness, which decides
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
