"""The errors hpcdl's layers raise for the CLI to report: `HpcdlError`'s message is one line, and
the CLI exits with its `exit_code` (2: input the user can fix, a job field, a data file, a run;
1: a failure of the system, such as the scheduler's). A leaf: it imports nothing of hpcdl."""


class HpcdlError(Exception):
    """An error the CLI prints as its one-line message, exiting with `exit_code`."""

    exit_code = 2


class JobError(HpcdlError, ValueError):
    """A job file, override or input that cannot be used; the message names the field."""


class NonFiniteLoss(ValueError):
    """A group's loss or a gradient turned NaN or Inf; the step was not applied, so its weights and
    newest checkpoint are the last finite ones. No restart can mend it: the same data and weights
    give the same step."""


class FinalSaveFailed(RuntimeError):
    """A group's last checkpoint or final state could not be written in train.final_save_retry_s."""
