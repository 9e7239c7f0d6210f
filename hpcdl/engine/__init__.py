"""The training engine: one synchronous group's loop (`train`), its layers (`nn`), optimizers
(`optim`), the training step every caller shares (`step`), FLOP counting (`flops`) and the CPU
tuning a rank applies before TensorFlow loads (`tuning`).

It knows nothing of SLURM, of run directories or of how its processes were started: callers pass
in the initialised Horovod module, the paths to write and the exchange (`GroupSync`). Importing
this package does not import TensorFlow (`tuning` must run first).
"""
