"""RUN/metrics.jsonl and its company: the one reader of a run's metric rows (the console follower, goodput, the
report), and the one writer of a run's metrics (``MetricsLog``: the jsonl row, TensorBoard and the sinks, the
console line every ``log_every`` steps with its ETA).

A row is one JSON object a line. The writer appends whole lines; a kill can cut the last one short, so a reader
takes only complete, parseable lines and says where it stopped, and a follower calls again from there.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular

METRICS = "metrics.jsonl"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def read_rows(path: str | Path, offset: int = 0, strict: bool = False) -> tuple[list[dict[str, Any]], int]:
    """-> (the rows of the complete lines from byte ``offset``, the byte offset after the last complete line).

    A missing file is no rows (``offset`` back); a file shorter than ``offset`` was started anew (a fresh run
    truncated an old run's file) and is read from its start. A line that is not a JSON object is skipped, or with
    ``strict`` refused in one sentence unless it is the last line (the one a kill cuts short)."""
    path = Path(path)
    if not path.exists():
        return [], offset
    check_regular(path, "metrics file")
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < offset:
            offset = 0
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    lines = chunk[:end].splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif strict and (i < len(lines) - 1 or end < len(chunk)):
            raise TrainscaleError(f"{path} has a line that is not a JSON object (line {i + 1} from byte {offset})")
    return rows, offset + end


def run_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of a run folder's metrics.jsonl (one sentence if the folder has none)."""
    path = metrics_path(run_dir)
    if not path.exists():
        raise TrainscaleError(f"{run_dir} has no {METRICS}; is it a trainscale run folder?")
    return read_rows(path, strict=True)[0]


class Eta:
    """Seconds to a run's last step: the mean of this attempt's last ``window`` step times x the steps left; the
    attempt's first step (compilation, allocator warm-up) counts only while it is the only one. A bounded window,
    so a step costs the same whatever the run's length."""

    def __init__(self, window: int = 20) -> None:
        self.first: float | None = None
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, step_time: float, remaining: int) -> float | None:
        """Count one more step of ``step_time`` seconds -> the ETA with ``remaining`` steps left."""
        if self.first is None:
            self.first = step_time
        else:
            self.recent.append(step_time)
        times = self.recent or [self.first]
        return sum(times) / len(times) * remaining if remaining >= 0 else None


class MetricsLog:
    """Where one attempt's metrics go. Every rank keeps its step rows and losses (the run's result); rank 0's
    run folder also gets each row in metrics.jsonl (``folder``: runtime/job/runfolder.RunFolder, None elsewhere),
    TensorBoard and the sinks get them (``tb``: runtime/job/tblog.MetricLog or None), and the console a line every
    ``log_every`` steps and at the last one (``log``: a no-op off rank 0)."""

    def __init__(self, folder, tb, log: Callable[[str], None], log_every: int, total: int) -> None:
        self.folder, self.tb, self.log = folder, tb, log
        self.log_every, self.total = log_every, total
        self.rows: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.eta = Eta()
        self.start = time.perf_counter()

    def seconds(self) -> float:
        """Seconds since the attempt's loop started."""
        return time.perf_counter() - self.start

    def record(self, row: dict[str, Any]) -> None:
        """A row in metrics.jsonl only (attempt start, resume, final held-out loss)."""
        if self.folder is not None:
            self.folder.log(row)

    def step(self, row: dict[str, Any]) -> None:
        """A training step's row (runtime/train.py), completed with its clocks, attempt and ETA, then written."""
        from trainscale.runtime.job.faults import requeue_count, restart_count
        from trainscale.units import duration_text

        step = int(row["step"])
        row["time"] = self.seconds()
        row["wall"] = time.time()  # seconds since the epoch: restarts and requeues line up across attempts
        row["attempt"] = restart_count()
        row["requeue"] = requeue_count()
        row["eta_s"] = self.eta.add(row["step_time_s"], self.total - step)
        self.losses.append(row["loss"])
        self.rows.append(row)
        self.record(row)
        if self.tb is not None:
            self.tb.step(row)
        if step % self.log_every == 0 or step == self.total:
            self.log(f"step {step:5d}/{self.total}  loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                     f"{row['flops_per_s'] / 1e9:.2f} GFLOP/s  MFU {row['mfu']:.1%} ({row['flop_convention']})  "
                     f"lr {row['lr']:.2e}  ETA {duration_text(row['eta_s'])}")

    def eval(self, row: dict[str, Any], line: str) -> None:
        """A held-out evaluation's row (an ``eval`` event) and its console line."""
        self.record(row)
        if self.tb is not None:
            self.tb.eval(row)
        self.log(line)

    def checkpoint(self, step: int, save_s: float) -> None:
        """A committed save: TensorBoard's events up to it reach the disk, and its row."""
        from trainscale.runtime.job.faults import restart_count

        if self.tb is not None:
            self.tb.flush()
        self.record({"event": "checkpoint", "step": step, "save_s": save_s, "attempt": restart_count()})

    def summary(self, values: dict[str, Any] | None, step: int) -> None:
        """The attempt's end: metrics.jsonl closes; a finished run (``values``: its held-out losses) adds its
        goodput row (runtime/job/runfolder.py) and TensorBoard summary; TensorBoard and the sinks close."""
        if self.folder is not None:
            self.folder.close()
        if values is not None and self.folder is not None:
            g = self.folder.goodput(self.log)
            if self.tb is not None:
                self.tb.summary({**g, **values}, step)
        if self.tb is not None:
            self.tb.close()
