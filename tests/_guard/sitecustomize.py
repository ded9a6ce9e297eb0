"""The fast loop's guard against training processes, in the test process and in every Python process it starts.

tests/conftest.py installs it for a test not marked ``dist`` or ``service`` and puts this folder first on the
PYTHONPATH of the processes the test starts, so Python imports this file at their start-up too (``site`` imports
``sitecustomize``); it does nothing in a process whose environment does not name a report file (``GUARD_ENV``).
Once installed, starting a training process writes one line to the report file and raises ``TrainingRefused``:
a subprocess whose command runs torchrun, ``trainscale.runtime.train``, the torchrun wrapper
``trainscale.runtime.job.launch`` or the probe ``trainscale.runtime.probe.compare``, or any ``multiprocessing``
process (how torch.multiprocessing's spawn and start_processes start their workers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

GUARD_ENV = "TRAINSCALE_TEST_NO_TRAINING"
TRAINING = re.compile(r"(?:^|[\s/'\"])torchrun(?:$|[\s'\"])|torch\.distributed\.run\b|"
                      r"trainscale\.runtime\.(?:train|job\.launch|probe\.compare)\b")


class TrainingRefused(BaseException):
    """Raised where a guarded process would start a training process (a BaseException: ``except Exception`` in the
    code under test does not swallow it)."""


def _command(args) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        return " ".join(os.fsdecode(args).split())
    return " ".join(" ".join(os.fsdecode(a).split()) for a in args)


def _refuse(report: str, what: str) -> None:
    with open(report, "a") as f:
        f.write(f"{what} (in process {os.getpid()})\n")
    raise TrainingRefused(f"this test is not marked dist but started a training process: {what}")


def install(report: str) -> Callable[[], None]:
    """Refuse training processes in this process from now on (report them to ``report``); -> a function that
    undoes it."""
    import subprocess
    from multiprocessing.process import BaseProcess

    guard_dir = os.path.dirname(os.path.abspath(__file__))
    execute_child, start = subprocess.Popen._execute_child, BaseProcess.start

    def guarded_execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest):
        command = _command(args)
        if TRAINING.search(command):
            _refuse(report, f"a subprocess `{command[:300]}`")
        if env is not None and GUARD_ENV not in env and all(isinstance(k, str) for k in env):
            path = env.get("PYTHONPATH")
            env = {**env, GUARD_ENV: report, "PYTHONPATH": guard_dir + (os.pathsep + path if path else "")}
        return execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)

    def guarded_start(self):
        _refuse(report, f"a multiprocessing process (target {getattr(self, '_target', None)!r})")
        return start(self)

    subprocess.Popen._execute_child = guarded_execute_child
    BaseProcess.start = guarded_start

    def undo() -> None:
        subprocess.Popen._execute_child = execute_child
        BaseProcess.start = start

    return undo


if os.environ.get(GUARD_ENV):
    install(os.environ[GUARD_ENV])
