"""The training engine: one synchronous group's loop (`train`), its layers (`nn`), optimizers
(`optim`), the training step every caller shares (`step`), FLOP counting (`flops`) and the CPU
tuning a rank applies before TensorFlow loads (`tuning`).

It knows nothing of SLURM, of run directories, of the job file or of any one workload: callers
pass in what the group trains (`GroupTask`: the train settings and the workload's model, batches
and loss, bound), the group's `Collective`, the checkpoint directory, what records the group's
progress (`Recorder`, `StepLog`) and the exchange (`GroupSync`). Importing
this package does not import TensorFlow (`tuning` must run first).
"""

# The engine's choices, declared here so that a job's validation and the CLI read them without
# loading TensorFlow; each name is implemented where its reference points (hpcdl.registry).
TRAIN_OPTIMIZERS = {"adam": "hpcdl.engine.optim:Adam", "sgd": "hpcdl.engine.optim:SGD"}

