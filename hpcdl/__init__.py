"""hpcdl: hybrid synchronous/asynchronous deep learning on SLURM clusters."""
__version__ = "0.1.0"
