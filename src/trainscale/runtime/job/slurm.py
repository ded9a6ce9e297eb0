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
- every value that reaches the script is checked: no newline or shell metacharacter can add a line.

Imports no torch: ``trainscale launch --slurm`` stays fast.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import TrainscaleError
from trainscale.specs import Layout

SAVE_REQUEST = ".save-request"  # the file the batch shell touches on the early signal (runtime/train.py reads it)
SAVE_REQUEST_ENV = "TRAINSCALE_SAVE_REQUEST"  # where the trainer looks for it; set only by the batch script

# Slurm's own syntaxes: names ([A-Za-z0-9._-]), time limits (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]),
# memory (a number with an optional K/M/G/T unit). Anything else is refused before a script is written.
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE)$")
_MEM = re.compile(r"^\d+[KMGT]?$")


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
            if val is not None and any(c in str(val) for c in "\n\r\0"):
                raise TrainscaleError(f"{what} contains a line break; it would add lines to the batch script")
        if any(c in str(self.log_dir) for c in "%"):
            raise TrainscaleError("the log folder may not contain '%' (Slurm expands it in --output)")


def sbatch_script(job: SlurmJob) -> str:
    """The batch script as text (bash). Values are shell-quoted; ``job.check()`` has refused line breaks."""
    job.check()
    q = shlex.quote
    out = str(job.out)
    train = [job.python, "-m", "torch.distributed.run",
             "--nnodes", "$SLURM_NNODES", "--nproc-per-node", str(job.procs_per_node),
             "--rdzv-id", "$SLURM_JOB_ID", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"$head:{job.port}",
             "--max-restarts", str(job.max_restarts),
             "-m", "trainscale.runtime.train", "--config", str(job.config), "--layout", job.layout, "--out", out,
             "--resume"]
    if job.steps is not None:
        train += ["--steps", str(job.steps)]
    if job.inject:
        train += ["--inject", job.inject]
    # $-variables stay unquoted-expandable inside double quotes; everything else is single-quoted
    cmd = " ".join(f'"{a}"' if a.startswith("$") else q(a) for a in train)
    cpus = job.cpus_per_proc * job.procs_per_node
    log = f"{job.log_dir.rstrip('/') or '/'}/{job.job_name}-%j.out"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={cpus}",
    ]
    if job.gpus:
        lines.append(f"#SBATCH --gpus-per-node={job.procs_per_node}")
    if job.mem:
        lines.append(f"#SBATCH --mem={job.mem}")
    lines += [f"#SBATCH --time={job.time_limit}", f"#SBATCH --output={log}", "#SBATCH --open-mode=append",
              "#SBATCH --requeue"]
    if job.signal_before_s:
        lines.append(f"#SBATCH --signal=B:USR1@{job.signal_before_s}")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        lines.append(f"#SBATCH --account={job.account}")
    lines += [
        "",
        "# written by `trainscale launch --slurm`; safe to requeue (scontrol requeue): it always resumes",
        "set -uo pipefail",
    ]
    if job.setup:
        lines.append(job.setup)
    lines += [
        f"mkdir -p {q(out)}",
        f"export {SAVE_REQUEST_ENV}={q(str(Path(out) / SAVE_REQUEST))}",
        f"export OMP_NUM_THREADS={job.cpus_per_proc}",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "[slurm] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}"',
        # the early signal reaches this shell only; the trainer polls the request file at each step
        f'trap \'echo "[slurm] time limit near: asking for a checkpoint"; touch "${SAVE_REQUEST_ENV}"\' USR1',
        f"srun --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1 \\",
        f"  {cmd} &",
        "pid=$!",
        "# a trapped signal interrupts `wait`: wait again until srun itself has ended",
        'while true; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done',
        'echo "[slurm] training ended with exit code $rc"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)
