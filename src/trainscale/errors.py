"""The errors a user sees: a clear sentence; exit code 2 for bad input, 1 for a failed job."""


class TrainscaleError(ValueError):
    """Bad input (unknown name, bad value, impossible layout, corrupt file). Message is one sentence."""


class JobFailed(TrainscaleError):
    """A job that started failed (disk full, a rank died for good): one sentence, exit code 1."""
