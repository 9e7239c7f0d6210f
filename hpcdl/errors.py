"""The error every layer raises for input the user can fix (a job field, a data file, a plugin):
the CLI prints its message as one line and exits 2. A leaf: it imports nothing of hpcdl."""


class JobError(ValueError):
    """A job file, override or input that cannot be used; the message names the field."""


class NonFiniteLoss(ValueError):
    """A group's loss or a gradient turned NaN or Inf; the step was not applied, so its weights and
    newest checkpoint are the last finite ones. No restart can mend it: the same data and weights
    give the same step."""
