"""The Slurm batch script for a training job: one task per node, each running torchrun with a c10d
rendezvous on the first node of the allocation (torchrun's documented multi-node pattern).

What the script guarantees (each point is a failure seen under a real Slurm 22.05):
- the log goes to a folder that exists when ``sbatch`` opens it (``#SBATCH --output`` is opened by
  slurmd before the script runs, so it cannot point into a folder that only the script creates);
  ``--open-mode=append`` keeps the log of every requeue;
- the job is requeueable and always starts trainscale with ``--resume``: the first run starts fresh
  (no checkpoint yet), a requeued one continues from the newest good checkpoint and appends to the
  run's metrics; ``SLURM_RESTART_COUNT`` tells the trainer that this start is a restart;
- ``srun`` gets ``--cpus-per-task`` itself (Slurm >= 22.05 no longer passes sbatch's value to steps);
- ``--signal=B:USR1@N``: N seconds before the time limit the batch shell asks the trainer (through a
  request file in the run folder) to write a checkpoint at the next step;
- every value that reaches a shell line goes through one helper, :func:`sh` (``shlex.quote``), and reaches
  srun byte-for-byte as one argument, unexpanded; ``--setup`` is the one shell line by design, run by ``eval``
  so it cannot join the lines after it; the ``#SBATCH`` values match Slurm's syntaxes; the whole script is
  checked with ``bash -n`` (a failure is trainscale's bug: one sentence, exit 1).

Imports no torch: ``trainscale launch --slurm`` stays fast.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.specs import Layout

SAVE_REQUEST = ".save-request"  # the file the batch shell touches on the early signal (runtime/train.py reads it)
SAVE_REQUEST_ENV = "TRAINSCALE_SAVE_REQUEST"  # where the trainer looks for it; set only by the batch script

# Slurm's own syntaxes: names ([A-Za-z0-9._-]), time limits (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]),
# memory (a number with an optional K/M/G/T unit). Anything else is refused before a script is written.
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE)$")
_MEM = re.compile(r"^\d+[KMGT]?$")
# what sbatch reads on a #SBATCH line up to the first blank or '#' (it is a bash comment, so quoting it would not help)
_DIRECTIVE = re.compile(r"^[^\s\"'#\\]+$")
_LINE_BREAKS = "\n\r\0"


@dataclass(frozen=True)
class SlurmJob:
    """What ``trainscale launch --slurm`` asks of Slurm (sbatch options), and of each node (torchrun)."""

    config: str
    layout: str
    out: str
    nodes: int
    procs_per_node: int
    gpus: bool = True  # False: the processes are CPU processes, no GPU is requested
    job_name: str = "trainscale"
    partition: str | None = None
    account: str | None = None
    time_limit: str = "24:00:00"
    cpus_per_proc: int = 8
    mem: str | None = None  # per node, Slurm syntax (e.g. 480G); None: the partition's default
    setup: str | None = None  # a shell line run before training, e.g. "source /shared/venv/bin/activate"
    python: str = sys.executable
    steps: int | None = None
    inject: str | None = None  # faults to inject (runtime/job/faults.py), to prove the job survives them
    max_restarts: int = 3
    signal_before_s: int = 120  # 0: no early signal
    log_dir: str = "."
    port: int = 29500

    def check(self) -> None:
        """One sentence for the first value that Slurm or the shell would misread."""
        world = Layout.parse(self.layout).world_size
        if self.nodes <= 0 or self.procs_per_node <= 0:
            raise TrainscaleError("--nodes and --gpus-per-node must be positive")
        if self.nodes * self.procs_per_node != world:
            raise TrainscaleError(f"layout {self.layout} needs {world} processes, but {self.nodes} node(s) x "
                                  f"{self.procs_per_node} per node = {self.nodes * self.procs_per_node}")
        for what, val in (("job name", self.job_name), ("--partition", self.partition),
                          ("--account", self.account)):
            if val is not None and not _NAME.match(val):
                raise TrainscaleError(f"{what} {val!r} is not a Slurm name (letters, digits, '.', '_', '-')")
        if not _TIME.match(self.time_limit):
            raise TrainscaleError(f"--time {self.time_limit!r} is not a Slurm time limit "
                                  "(e.g. 90, 04:00:00, 2-00:00:00)")
        if self.mem is not None and not _MEM.match(self.mem):
            raise TrainscaleError(f"--mem {self.mem!r} is not a Slurm memory size (e.g. 480G)")
        if not 1 <= self.cpus_per_proc <= 1024:
            raise TrainscaleError("--cpus-per-gpu must be between 1 and 1024")
        if not 0 <= self.max_restarts <= 100:
            raise TrainscaleError("--max-restarts must be between 0 and 100")
        if not 0 <= self.signal_before_s <= 86400:
            raise TrainscaleError("--signal-before must be between 0 and 86400 seconds")
        if self.inject:
            from trainscale.runtime.job.faults import parse_faults

            parse_faults(self.inject)
        if self.steps is not None and not 0 < self.steps < 10**9:
            raise TrainscaleError("--steps must be a positive number below 1e9")
        for what, val in (("config path", self.config), ("--out", self.out), ("log folder", self.log_dir),
                          ("python", self.python), ("--setup", self.setup), ("--inject", self.inject)):
            if val is not None and any(c in str(val) for c in _LINE_BREAKS):
                raise TrainscaleError(f"{what} contains a line break; it would add lines to the batch script")
        if any(c in str(self.log_dir) for c in "%"):
            raise TrainscaleError("the log folder may not contain '%' (Slurm expands it in --output)")
        if not _DIRECTIVE.match(str(self.log_dir)):
            raise TrainscaleError(f"the script's folder {self.log_dir!r} holds a space, quote, '#' or backslash, "
                                  "which sbatch misreads in its #SBATCH --output line; write the script elsewhere")
        if not self.python or self.python.startswith("-"):
            raise TrainscaleError(f"--python {self.python!r} must be a path or a command name (srun would read a "
                                  "leading '-' as its own option)")
        if not str(self.out):
            raise TrainscaleError("--out is empty; give the run folder on the cluster")
        if self.setup is not None:
            check_setup(self.setup)




@dataclass(frozen=True)
class Var:
    """A variable that the script or Slurm sets (never a user's value): written ``"$NAME"``, then ``suffix`` quoted."""

    name: str
    suffix: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise ValueError(f"not a shell variable name: {self.name!r}")


def sh(value: object) -> str:
    """The one way a value enters a shell line of the script: one word, exactly ``value`` once bash has read it
    (``shlex.quote``), or a :class:`Var` expanded in double quotes. A line break cannot be quoted into one line."""
    if isinstance(value, Var):
        return f'"${value.name}"' + (sh(value.suffix) if value.suffix else "")
    text = str(value)
    if any(c in text for c in _LINE_BREAKS):
        raise TrainscaleError(f"{text[:40]!r} contains a line break; it would add lines to the batch script")
    return shlex.quote(text)


def shell_line(*words: object) -> str:
    """A command line of the script: each word through :func:`sh`."""
    return " ".join(sh(w) for w in words)


def _directive(option: str, value: object) -> str:
    """A ``#SBATCH --option=value`` line; ``check()`` has matched the value to Slurm's syntax already."""
    text = str(value)
    if not _DIRECTIVE.match(text):
        raise TrainscaleError(f"#SBATCH --{option} {text!r} holds a blank, quote, '#' or backslash")
    return f"#SBATCH --{option}={text}"


def bash_syntax_error(text: str) -> str | None:
    """What ``bash -n`` says about ``text`` (None: it parses; also None where this machine has no bash)."""
    bash = shutil.which("bash")
    if bash is None:
        return None
    try:
        p = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "bash -n did not finish in 30 s"
    if p.returncode == 0:
        return None
    return " ".join(p.stderr.split())[:300] or f"bash -n exited with {p.returncode}"


def check_setup(setup: str) -> None:
    """``--setup`` is shell by design (the user's own line, run with ``eval``); it must at least parse."""
    why = bash_syntax_error(setup)
    if why:
        raise TrainscaleError(f"--setup {setup[:60]!r} is not a shell line bash can parse: {why}")


def check_script(script: str | Path) -> None:
    """``bash -n`` on the written script. Every value was quoted by :func:`sh`, so a failure is trainscale's bug."""
    text = Path(script).read_text() if isinstance(script, Path) else script
    why = bash_syntax_error(text)
    if why:
        raise JobFailed(f"bug in trainscale: the batch script it wrote does not parse ({why}); please report it")


def _train_command(job: SlurmJob) -> list[object]:
    """torchrun on this node, then the trainer; string values as ``--opt=value`` so none can pass for an option."""
    cmd: list[object] = [
        job.python, "-m", "torch.distributed.run",
        "--nnodes", Var("SLURM_NNODES"), "--nproc-per-node", job.procs_per_node,
        "--rdzv-id", Var("SLURM_JOB_ID"), "--rdzv-backend", "c10d", "--rdzv-endpoint", Var("head", f":{job.port}"),
        "--max-restarts", job.max_restarts,
        "-m", "trainscale.runtime.train", f"--config={job.config}", f"--layout={job.layout}", f"--out={job.out}",
        "--resume"]
    if job.steps is not None:
        cmd += ["--steps", job.steps]
    if job.inject:
        cmd.append(f"--inject={job.inject}")
    return cmd


def _directives(job: SlurmJob, cpus: int) -> list[str]:
    log = f"{job.log_dir.rstrip('/') or '/'}/{job.job_name}-%j.out"
    lines = ["#!/bin/bash", _directive("job-name", job.job_name), _directive("nodes", job.nodes),
             "#SBATCH --ntasks-per-node=1", _directive("cpus-per-task", cpus)]
    if job.gpus:
        lines.append(_directive("gpus-per-node", job.procs_per_node))
    if job.mem:
        lines.append(_directive("mem", job.mem))
    lines += [_directive("time", job.time_limit), _directive("output", log), "#SBATCH --open-mode=append",
              "#SBATCH --requeue"]
    if job.signal_before_s:
        lines.append(_directive("signal", f"B:USR1@{job.signal_before_s}"))
    if job.partition:
        lines.append(_directive("partition", job.partition))
    if job.account:
        lines.append(_directive("account", job.account))
    return lines


def sbatch_script(job: SlurmJob) -> str:
    """The batch script as text (bash). Every value goes through :func:`sh` (or :func:`_directive` for the
    ``#SBATCH`` lines, which bash reads as comments); ``--setup`` is the one shell line, run by ``eval``."""
    job.check()
    cpus = job.cpus_per_proc * job.procs_per_node
    lines = _directives(job, cpus) + [
        "",
        "# written by `trainscale launch --slurm`; safe to requeue (scontrol requeue): it always resumes",
        "set -uo pipefail",
    ]
    if job.setup:
        # the user's own shell line (--setup), run in this shell; eval keeps it from joining the lines below
        lines.append(shell_line("eval", job.setup))
    lines += [
        shell_line("mkdir", "-p", "--", job.out),
        "export " + sh(f"{SAVE_REQUEST_ENV}={Path(job.out) / SAVE_REQUEST}"),
        "export " + sh(f"OMP_NUM_THREADS={job.cpus_per_proc}"),
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "[slurm] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}"',
        # the early signal reaches this shell only; the trainer polls the request file at each step
        "trap " + sh(f'echo "[slurm] time limit near: asking for a checkpoint"; touch "${SAVE_REQUEST_ENV}"') + " USR1",
        shell_line("srun", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1") + " \\",
        "  " + shell_line(*_train_command(job)) + " &",
        "pid=$!",
        "# a trapped signal interrupts `wait`: wait again until srun itself has ended",
        'while true; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done',
        'echo "[slurm] training ended with exit code $rc"',
        'exit "$rc"',
        "",
    ]
    text = "\n".join(lines)
    check_script(text)
    return text
