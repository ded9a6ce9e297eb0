"""The errors a user sees: a clear sentence; exit code 2 for bad input, 1 for a failed job."""


class TrainscaleError(ValueError):
    """Bad input (unknown name, bad value, impossible layout, corrupt file). Message is one sentence."""


class JobFailed(TrainscaleError):
    """A job that started failed (disk full, a rank died for good): one sentence, exit code 1."""


class FieldError(TrainscaleError):
    """Bad input named by the field it was given as (``seq must be positive, not 0``): estimate/ knows its
    parameters, not the flags a command took them from; the command line names the flag instead (``--seq``,
    commands/_common.flag)."""

    def __init__(self, field: str, rest: str) -> None:
        self.field, self.rest = field, rest
        super().__init__(f"{field} {rest}")

    def named(self, name: str) -> str:
        """The sentence with the field called ``name``."""
        return f"{name} {self.rest}"
