"""The Slurm batch script for a training job: one task per node, each running torchrun with a c10d
rendezvous on the first node of the allocation (torchrun's documented multi-node pattern).

What the script guarantees (each point is a failure seen under a real Slurm 22.05):
- the log goes to a folder that exists when ``sbatch`` opens it (``#SBATCH --output`` is opened by
  slurmd before the script runs, so it cannot point into a folder that only the script creates);
  ``--open-mode=append`` keeps the log of every requeue;
- the job is requeueable and always starts trainscale with ``--resume``: the first run starts fresh
  (no checkpoint yet), a requeued one continues from the newest good checkpoint and appends to the
  run's metrics; ``SLURM_RESTART_COUNT`` tells the trainer that this start is a restart;
- the job outlives its time limit: ``--signal=B:USR1@N`` makes the batch shell ask the trainer for a
  checkpoint; the trainer saves, ends this attempt cleanly (every rank exits 0: no torchrun traceback) and
  leaves a mark; the shell then requeues its own job (``scontrol requeue $SLURM_JOB_ID``), at most
  ``--max-resubmits`` times (``SLURM_RESTART_COUNT``). Slurm never requeues a job that reached its limit
  (TIMEOUT), so the job does it before. Requeue rather than a chained ``sbatch --dependency=afterany``: the job
  keeps its id, its log (``--open-mode=append``) and its restart count, and needs no path to its own script.
  Slurm holds a requeued job ``cred_expire`` seconds (slurm.conf AuthInfo, default 120) before it may start;
- it runs where ``launch`` ran (``--chdir`` and a ``cd`` that fails loudly), so relative paths in the config and
  ``--out`` keep their meaning;
- the rendezvous port is the job's own (:func:`rendezvous_port`), so two jobs sharing a node do not collide;
- the Python is found on the compute node (``--python``, else ``$TRAINSCALE_PYTHON``, else ``python3`` or
  ``python`` on ``$PATH``) and must import trainscale, else one line in the log and exit 1;
- NCCL defaults (:data:`NCCL_DEFAULTS`, where the environment sets none) and the user's ``--env KEY=VALUE``;
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

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.specs import Layout

SAVE_REQUEST = ".save-request"  # the file the batch shell touches on the early signal (runtime/train.py reads it)
SAVE_REQUEST_ENV = "TRAINSCALE_SAVE_REQUEST"  # where the trainer looks for it; set only by the batch script
STOPPED = ".stopped-for-requeue"  # the trainer's mark: this attempt ended after the early checkpoint, run unfinished
STOPPED_ENV = "TRAINSCALE_STOPPED"  # where the trainer leaves it; set only by the batch script
PYTHON_ENV = "TRAINSCALE_PYTHON"  # the Python on the compute node when --python is not given
# exit code of a job that checkpointed before its time limit but may not requeue again (--max-resubmits reached):
# EX_TEMPFAIL of sysexits.h, "a temporary failure ... the user is invited to retry"
EXIT_NOT_REQUEUED = 75
# Where the environment sets none (a site's own settings win), and --env overrides. PyTorch's ProcessGroupNCCL
# (docs: torch_nccl_environment_variables): TORCH_NCCL_ASYNC_ERROR_HANDLING=1 aborts the communicator and ends
# the process on an NCCL error or a collective timeout (default 3 ends it without the abort), so torchrun sees
# a failed rank and restarts instead of hanging. NCCL's NCCL_DEBUG=WARN prints NCCL's own warnings and errors
# (NCCL docs, Environment Variables), which are otherwise silent. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# (PyTorch "CUDA semantics", memory management; torchtitan's run_train.sh sets it) grows the caching allocator's
# segments instead of leaving holes between them: the fragmentation catalog/planner.toml's memory_reserve_bytes
# does not count. The same defaults for a local launch (runtime/job/local.job_env).
NCCL_DEFAULTS = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), ("NCCL_DEBUG", "WARN"),
                 ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
# the per-job rendezvous port: 20000 + job id mod 12768 stays in 20000..32767, below Linux's default ephemeral
# range 32768-60999 (ip_local_port_range, kernel Documentation/networking/ip-sysctl.rst), so no outgoing
# connection holds it; two jobs on one node collide only when their ids differ by a multiple of 12768
PORT_BASE, PORT_SPAN = 20000, 12768
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_RESERVED = ("SLURM_", SAVE_REQUEST_ENV, STOPPED_ENV)  # the script reads or sets these itself

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
    python: str | None = None  # None: found on the compute node ($TRAINSCALE_PYTHON, else python3/python on PATH)
    steps: int | None = None
    inject: str | None = None  # faults to inject (runtime/job/faults.py), to prove the job survives them
    max_restarts: int = 3
    signal_before_s: int = 120  # 0: no early signal
    log_dir: str = "."
    workdir: str | None = None  # absolute folder the job runs in (launch's own); None: where sbatch ran
    env: tuple[tuple[str, str], ...] = ()  # the user's --env KEY=VALUE, exported after NCCL_DEFAULTS
    max_resubmits: int = 30  # self-requeues before the time limit (30: a month of 24 h limits)

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
        if self.mem is not None and not _MEM.match(self.mem):
            raise TrainscaleError(f"--mem {self.mem!r} is not a Slurm memory size (e.g. 480G)")
        if not 1 <= self.cpus_per_proc <= 1024:
            raise TrainscaleError("--cpus-per-gpu must be between 1 and 1024")
        if not 0 <= self.max_restarts <= 100:
            raise TrainscaleError("--max-restarts must be between 0 and 100")
        if not 0 <= self.max_resubmits <= 10000:
            raise TrainscaleError("--max-resubmits must be between 0 and 10000")
        if not 0 <= self.signal_before_s <= 86400:
            raise TrainscaleError("--signal-before must be between 0 and 86400 seconds")
        limit = time_limit_s(self.time_limit)  # sbatch's forms, each field within its clock
        if self.signal_before_s and limit is not None and self.signal_before_s >= limit:
            raise TrainscaleError(f"--signal-before {self.signal_before_s} s is not below --time {self.time_limit} "
                                  f"({limit} s): every attempt would checkpoint and requeue as it starts")
        if self.inject:
            from trainscale.runtime.job.faults import parse_faults

            parse_faults(self.inject)
        if self.steps is not None and not 0 < self.steps < 10**9:
            raise TrainscaleError("--steps must be a positive number below 1e9")
        for what, val in (("config path", self.config), ("--out", self.out), ("log folder", self.log_dir),
                          ("python", self.python), ("--setup", self.setup), ("--inject", self.inject),
                          ("the launch folder", self.workdir)):
            if val is not None and any(c in str(val) for c in _LINE_BREAKS):
                raise TrainscaleError(f"{what} contains a line break; it would add lines to the batch script")
        if any(c in str(self.log_dir) for c in "%"):
            raise TrainscaleError("the log folder may not contain '%' (Slurm expands it in --output)")
        if not _DIRECTIVE.match(str(self.log_dir)):
            raise TrainscaleError(f"the script's folder {self.log_dir!r} holds a space, quote, '#' or backslash, "
                                  "which sbatch misreads in its #SBATCH --output line; write the script elsewhere")
        if self.workdir is not None and not Path(self.workdir).is_absolute():
            raise TrainscaleError(f"the job's folder {self.workdir!r} must be an absolute path")
        check_env(self.env)
        if self.python is not None and (not self.python or self.python.startswith("-")):
            raise TrainscaleError(f"--python {self.python!r} must be a path or a command name (srun would read a "
                                  "leading '-' as its own option)")
        if not str(self.out):
            raise TrainscaleError("--out is empty; give the run folder on the cluster")
        if self.setup is not None:
            check_setup(self.setup)


def time_limit_s(text: str) -> int | None:
    """A Slurm time limit in seconds (sbatch(1) --time: minutes, minutes:seconds, hours:minutes:seconds,
    days-hours, days-hours:minutes, days-hours:minutes:seconds); None for UNLIMITED/INFINITE and 0 (no limit). A
    form sbatch does not read or a field past its clock's range (99:99, 1-25) is refused in one sentence."""
    if text in ("UNLIMITED", "INFINITE"):
        return None
    if not _TIME.match(text):
        raise TrainscaleError(f"--time {text[:40]!r} is not a Slurm time limit (e.g. 90, 04:00:00, 2-00:00:00)")
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, sec = (parts + [0, 0])[:3]
        fields = (("hours", h, 24), ("minutes", m, 60), ("seconds", sec, 60))
        total = ((int(days) * 24 + h) * 60 + m) * 60 + sec
    elif len(parts) == 1:
        fields, total = (), parts[0] * 60
    elif len(parts) == 2:
        fields, total = (("seconds", parts[1], 60),), parts[0] * 60 + parts[1]
    else:
        fields = (("minutes", parts[1], 60), ("seconds", parts[2], 60))
        total = (parts[0] * 60 + parts[1]) * 60 + parts[2]
    for name, value, bound in fields:
        if value >= bound:
            raise TrainscaleError(f"--time {text!r} has {value} {name}; a Slurm time limit's {name} run 0..{bound - 1} "
                                  "(e.g. 90, 04:00:00, 2-00:00:00)")
    if total > 366 * 86400 * 100:
        raise TrainscaleError(f"--time {text!r} is longer than a job can run (give e.g. 04:00:00)")
    return total or None  # sbatch(1): "A time limit of zero requests that no time limit be imposed"


def parse_env(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``--env KEY=VALUE`` (repeated) -> ((KEY, VALUE), ...); one sentence for the first that is not one."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise TrainscaleError(f"--env {item!r} is not KEY=VALUE")
        out.append((key, value))
    check_env(out)
    return tuple(out)


def check_env(env: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> None:
    """A variable name (the value is any one line: it is quoted, never run), not one the script relies on."""
    for key, value in env:
        if not _ENV_NAME.match(key):
            raise TrainscaleError(f"--env {key!r} is not an environment variable name (letters, digits, '_')")
        if key.startswith(_ENV_RESERVED):
            raise TrainscaleError(f"--env {key} is set by Slurm or the batch script itself; it cannot be overridden")
        if any(c in value for c in _LINE_BREAKS):
            raise TrainscaleError(f"--env {key}: the value contains a line break; it would add lines to the script")


def rendezvous_port(job_id: int) -> int:
    """The job's rendezvous port (the script computes the same in bash): see PORT_BASE."""
    return PORT_BASE + job_id % PORT_SPAN


def stops_for_requeue(step: int, steps: int) -> bool:
    """After the early-signal checkpoint at ``step``: end this attempt, for the batch script to requeue the job?
    Only under a script that requeues (it sets STOPPED_ENV) and only if steps are left (a finished run must not
    resubmit)."""
    return step < steps and bool(os.environ.get(STOPPED_ENV))


def save_requested(device) -> bool:
    """True on every rank when the batch script asked for a checkpoint (it touches the request file on the signal
    before the time limit): rank 0 looks and removes it, everyone agrees (one all-reduce, on ``device``)."""
    import contextlib

    import torch
    import torch.distributed as dist

    path = os.environ.get(SAVE_REQUEST_ENV)
    if not path:
        return False
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    if dist.get_rank() == 0 and os.path.exists(path):
        flag += 1
        with contextlib.suppress(OSError):
            os.unlink(path)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def mark_stopped(step: int) -> None:
    """Rank 0, once the checkpoint is committed: tell the batch script that this attempt stopped for a requeue."""
    path = os.environ.get(STOPPED_ENV)
    if path:
        Path(path).write_text(f"{step}\n")


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
        Var("py"), "-m", "torch.distributed.run",
        "--nnodes", Var("SLURM_NNODES"), "--nproc-per-node", job.procs_per_node,
        "--rdzv-id", Var("SLURM_JOB_ID"), "--rdzv-backend", "c10d", "--rdzv-endpoint", Var("endpoint"),
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
    lines = ["#!/bin/bash", _directive("job-name", job.job_name)]
    if job.workdir and _DIRECTIVE.match(job.workdir):  # else only the script's own `cd` (sbatch would misread it)
        lines.append(_directive("chdir", job.workdir))
    lines += [_directive("nodes", job.nodes),
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


def _environment(job: SlurmJob) -> list[str]:
    """OMP threads and the NCCL defaults (the environment's own values win), then the user's --env (wins)."""
    lines = ["export " + sh(f"OMP_NUM_THREADS={job.cpus_per_proc}")]
    lines += [f'export {key}="${{{key}:-{value}}}"' for key, value in NCCL_DEFAULTS]  # constants, not user values
    lines += ["export " + sh(f"{key}={value}") for key, value in job.env]
    return lines


def _python(job: SlurmJob) -> list[str]:
    """``py``: --python as given, else found on this node; it must import trainscale (else one line, exit 1)."""
    if job.python is not None:
        lines = ["py=" + sh(job.python)]
    else:
        lines = [f'py="${{{PYTHON_ENV}:-}}"',
                 '[ -n "$py" ] || py=$(command -v python3 || command -v python || echo python3)']
    why = (f"give --python to trainscale launch, set {PYTHON_ENV}, or activate its environment in --setup")
    return lines + [
        "if ! \"$py\" -c 'import trainscale' >/dev/null 2>&1; then",
        f'  echo "[slurm] python $py on $(hostname) cannot import trainscale: {why}" >&2',
        "  exit 1",
        "fi",
    ]


def _requeue(job: SlurmJob) -> list[str]:
    """After srun: the trainer's mark means it checkpointed before the time limit and steps are left."""
    limit = job.max_resubmits
    return [
        'if [ "$rc" = 0 ] && [ -e "$' + STOPPED_ENV + '" ]; then',
        '  rm -f -- "$' + STOPPED_ENV + '"',
        f'  if [ "$restarts" -ge {limit} ]; then',
        f'    echo "[slurm] checkpointed before the time limit; not requeueing: $restarts of --max-resubmits {limit} '
        'done (sbatch this script again to continue)"',
        f"    exit {EXIT_NOT_REQUEUED}",
        "  fi",
        f'  echo "[slurm] checkpointed before the time limit: requeueing job $SLURM_JOB_ID '
        f'(resubmit $((restarts + 1)) of {limit})"',
        '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '  echo "[slurm] scontrol requeue failed: sbatch this script again to continue" >&2',
        "  exit 1",
        "fi",
    ]


def sbatch_script(job: SlurmJob) -> str:
    """The batch script as text (bash). Every value goes through :func:`sh` (or :func:`_directive` for the
    ``#SBATCH`` lines, which bash reads as comments); ``--setup`` is the one shell line, run by ``eval``."""
    job.check()
    cpus = job.cpus_per_proc * job.procs_per_node
    lines = _directives(job, cpus) + [
        "",
        "# written by `trainscale launch --slurm`; safe to requeue (scontrol requeue): it always resumes, and it",
        "# requeues itself after the checkpoint before its time limit",
        "set -uo pipefail",
    ]
    if job.workdir:
        lines.append("cd -- " + sh(job.workdir) + ' || { echo "[slurm] cannot enter the folder launch ran in" >&2; '
                     "exit 1; }")
    lines += _environment(job)
    if job.setup:
        # the user's own shell line (--setup), run in this shell; eval keeps it from joining the lines below
        lines.append(shell_line("eval", job.setup))
    lines += _python(job) + [
        shell_line("mkdir", "-p", "--", job.out),
        "export " + sh(f"{SAVE_REQUEST_ENV}={Path(job.out) / SAVE_REQUEST}"),
        "export " + sh(f"{STOPPED_ENV}={Path(job.out) / STOPPED}"),
        # a request or mark left by an earlier attempt would end this one at its first step
        f'rm -f -- "${SAVE_REQUEST_ENV}" "${STOPPED_ENV}"',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'endpoint="$head:$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"  # this job\'s own port (rendezvous_port)',
        'restarts="${SLURM_RESTART_COUNT:-0}"',
        'echo "[slurm] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart $restarts, rendezvous $endpoint, python $py"',
        # the early signal reaches this shell only; the trainer polls the request file at each step
        "trap " + sh(f'echo "[slurm] time limit near: asking for a checkpoint"; touch "${SAVE_REQUEST_ENV}"') + " USR1",
        shell_line("srun", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1") + " \\",
        "  " + shell_line(*_train_command(job)) + " &",
        "pid=$!",
        "# a trapped signal interrupts `wait`: wait again until srun itself has ended",
        'while true; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done',
        'echo "[slurm] training ended with exit code $rc"',
    ] + _requeue(job) + [
        'exit "$rc"',
        "",
    ]
    text = "\n".join(lines)
    check_script(text)
    return text
