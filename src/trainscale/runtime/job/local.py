"""A training job on this machine (or this machine's part of a multi-node job), started and followed.

``run_local`` holds the run folder's lock (one machine), names the run, starts torchrun with its log beside the
run folder's files, follows rank 0's metrics.jsonl (``metrics.read_rows``) until the job ends, stops it when a rank
records a deterministic error (a restart would only repeat it), and turns a failure into one sentence: the
rank's recorded error (exit 2 for bad input, 1 for a failed job), else the last failure in the log. What the
command shows (a progress bar, the console lines) it passes in as ``on_row``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.runtime.config import TrainConfig
from trainscale.runtime.job import runfolder
from trainscale.runtime.job.metrics import metrics_path, read_rows

Row = dict[str, Any]
Status = Callable[[str], AbstractContextManager[Any]]


def _quiet(_what: str) -> AbstractContextManager[Any]:
    return nullcontext()


def job_env(cfg: TrainConfig, status: Status = _quiet) -> dict[str, str]:
    """The environment of a job's ranks (train, compare): the corpus tokenised and the CPU peak measured here,
    once, before the ranks start. ``status(what)`` wraps each slow part (a spinner, for a person)."""
    import torch

    from trainscale.runtime import measure
    from trainscale.runtime.data.corpus import corpus_for

    with status("preparing the corpus and tokenizer (cached after the first run)"):
        corpus_for(cfg)
    env = dict(os.environ)
    if not torch.cuda.is_available():
        with status("measuring this CPU's matmul peak (once)"):
            env["TRAINSCALE_CPU_PEAK"] = repr(measure.cpu_peak_flops(remeasure=True))
    env.setdefault("PYTHONUNBUFFERED", "1")
    from trainscale.runtime.job.slurm import NCCL_DEFAULTS

    for key, value in NCCL_DEFAULTS:  # as the Slurm script exports them: NCCL errors end the rank, no holes
        env.setdefault(key, value)
    return env


@dataclass(frozen=True)
class LocalRun:
    """What a finished job left: the step rows followed (those with a loss) and this machine's log."""

    rows: list[Row]
    log: Path


def run_local(cmd: list[str], cfg: TrainConfig, run_dir: Path, *, resume: bool, multi_node: bool,
              status: Status = _quiet,
              watch: Callable[[], AbstractContextManager[Callable[[Row], None]]] | None = None) -> LocalRun:
    """Run the torchrun command ``cmd`` for ``cfg`` into ``run_dir`` and follow it to its end (JobFailed or
    TrainscaleError, one sentence, when it fails). One machine: this process holds the run folder's lock for the
    whole job (restarts included) and names the run; on several machines rank 0 of the job does both (the folder
    may be shared). ``watch()`` is entered while the job runs and gives the callback each new row goes to."""
    lock = runfolder.RunLock(run_dir).acquire() if not multi_node else None
    # the ranks' one-sentence error goes outside the run folder: a full disk there must not swallow it
    err_dir = Path(tempfile.mkdtemp(prefix="trainscale-job-"))
    try:
        err_file = err_dir / runfolder.ERROR
        run_id = None
        if lock is not None:
            run_id = runfolder.claim(run_dir, runfolder.checkpoint_root(run_dir, cfg.checkpoint.dir), cfg, resume)
        env = job_env(cfg, status)
        if run_id is not None:
            env[runfolder.ENV_RUN_ID] = run_id
            env[runfolder.ENV_ERROR_FILE] = str(err_file)
        if not multi_node:  # this invocation is one launch of the job (goodput leaves out the time between)
            env[runfolder.ENV_LAUNCH] = uuid.uuid4().hex
        if "trainscale.runtime.job.launch" in cmd:  # our torchrun wrapper ends with this process (PDEATHSIG)
            env[runfolder.ENV_PARENT] = str(os.getpid())
        else:
            env.pop(runfolder.ENV_PARENT, None)
        run_dir.mkdir(parents=True, exist_ok=True)
        # every node keeps its own log: in a shared run folder the nodes would otherwise overwrite one file
        log_path = run_dir / (f"train-{socket.gethostname()}-{os.getpid()}.log" if multi_node else "train.log")
        metrics = metrics_path(run_dir)
        if metrics.exists() and not resume and not multi_node:  # rank 0's node truncates it (runtime/train.py)
            metrics.unlink()
        with open(log_path, "w") as log, (watch or _no_watch)() as on_row:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                rows = follow(proc, metrics, on_row, error_file=err_file if lock is not None else None)
            except BaseException:
                stop(proc)
                raise
        if proc.returncode != 0 or err_file.exists():
            raise_failure(err_file, log_path, proc.returncode)
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)
        if lock is not None:
            lock.release()
    return LocalRun(rows=rows, log=log_path)


@contextmanager
def _no_watch() -> Iterator[Callable[[Row], None]]:
    yield lambda row: None


def follow(proc: subprocess.Popen, metrics: Path, on_row: Callable[[Row], None],
           error_file: Path | None = None) -> list[Row]:
    """Tail rank 0's metrics.jsonl, each new row to ``on_row``, until the job ends (or a rank records a
    deterministic error, which a restart would only repeat: then the job is stopped); -> the rows with a loss."""
    rows: list[Row] = []
    pos = metrics.stat().st_size if metrics.exists() else 0  # a resumed run's earlier lines are not news
    while True:
        done = proc.poll() is not None
        new, pos = read_rows(metrics, pos)
        for row in new:
            on_row(row)
            if "loss" in row:
                rows.append(row)
        if done:
            break
        if error_file is not None and error_file.exists():
            stop(proc)
            break
        time.sleep(0.2)
    return rows


def stop(proc: subprocess.Popen) -> None:
    """End the torchrun agent (it stops its ranks on SIGTERM), then make sure."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def raise_failure(err_file: Path, log_path: Path, code: int) -> None:
    """The one sentence that failed the job: a rank's recorded error (exit 2 for bad input such as a refused
    checkpoint, 1 for a failed job such as a full disk), else the last rank failure in the log."""
    from trainscale.safeio import read_json_object

    if err_file.exists():
        try:
            got = read_json_object(err_file, "error record")
        except TrainscaleError:
            got = {}
        if isinstance(got.get("error"), str):
            if got.get("exit") == 1:
                raise JobFailed(got["error"])
            raise TrainscaleError(got["error"])
    lines = log_path.read_text(errors="replace").splitlines()
    err = next((ln for ln in reversed(lines) if "trainscale: error:" in ln), None)
    if err:
        raise JobFailed(err.split("trainscale: error:", 1)[1].strip())
    if any("RendezvousTimeoutError" in ln for ln in lines):
        raise JobFailed(f"the other machines did not join the rendezvous in time (--rdzv-timeout); the whole log is "
                        f"{log_path}")
    cause = next((ln.split("failed: ", 1)[1] for ln in reversed(lines)
                  if "trainscale: rank" in ln and "failed: " in ln), None)
    raise JobFailed(f"training failed (exit {code}{'; ' + cause if cause else ''}); the whole log is {log_path}")
