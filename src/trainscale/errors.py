"""The one error type a user sees: a clear sentence, exit code 2 at the CLI."""


class TrainscaleError(ValueError):
    """Bad input (unknown name, bad value, impossible layout, corrupt file). Message is one sentence."""
