"""RUN/metrics.jsonl and its company: the one reader of a run's metric rows (the console follower, goodput, the
report), and the one writer of a run's metrics (``MetricsLog``: the jsonl row, TensorBoard and the sinks, the
console line every ``log_every`` steps with its ETA).

A row is one JSON object a line. The writer appends whole lines; a kill can cut the last one short, so a reader
takes only complete, parseable lines and says where it stopped, and a follower calls again from there.

No host sync on a step that does not log: a step's row may hold values still on the device (``Deferred``: the loss,
the gradient norm, the MoE numbers, a CUDA step's clock). ``MetricsLog`` keeps such rows pending and reads all their
device values in one transfer at the next row it must write: every ``read_every`` steps (the logging steps,
``[run] log_every``), at the last step, before any other row (an evaluation, a checkpoint, so the file keeps its
order) and at the attempt's end. metrics.jsonl still gets one row per step with the same fields and values; it
gets them in batches. A process killed between two logging steps loses those steps' rows (``log_every = 1``, the
default, reads every step).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular

if TYPE_CHECKING:  # the readers (console follower, report) start without torch
    import torch

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


class Deferred:
    """A row's value still on the device: ``tensor`` (None: nothing to read, ``convert`` needs no argument) is read
    back with every other pending value in one transfer, then ``convert``(its host value: a float for one element,
    else nested lists of floats, float64) is the row's value."""

    __slots__ = ("tensor", "convert")

    def __init__(self, tensor: torch.Tensor | None, convert: Callable[..., Any] = float) -> None:
        self.tensor, self.convert = (None if tensor is None else tensor.detach()), convert


def _nested(flat: list[float], shape: tuple[int, ...]) -> list[Any]:
    """``flat`` (row-major) as nested lists of ``shape``, as ``Tensor.tolist`` gives them."""
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def read_deferred(values: list[Deferred]) -> list[Any]:
    """The host values of ``values``, one device-to-host copy per device (one in a run): each flattened to
    float64 (exact for the float32 and float64 values and the counts it carries), concatenated, copied back."""
    import torch

    out: list[Any] = [None] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if v.tensor is not None:
            by_device.setdefault(v.tensor.device, []).append(i)
    for idx in by_device.values():
        flat = torch.cat([values[i].tensor.reshape(-1).to(torch.float64) for i in idx]).cpu().tolist()
        at = 0
        for i in idx:
            t = values[i].tensor
            n = t.numel()
            out[i] = values[i].convert(flat[at] if n == 1 else _nested(flat[at:at + n], tuple(t.shape)))
            at += n
    for i, v in enumerate(values):  # after the copies: what they waited for (a step's CUDA events) is done
        if v.tensor is None:
            out[i] = v.convert()
    return out


class MetricsLog:
    """Where one attempt's metrics go. Every rank keeps its step rows and losses (the run's result); rank 0's
    run folder also gets each row in metrics.jsonl (``folder``: runtime/job/runfolder.RunFolder, None elsewhere),
    TensorBoard and the sinks get them (``tb``: runtime/job/tblog.MetricLog or None), and the console a line every
    ``log_every`` steps and at the last one (``log``: a no-op off rank 0).

    A step row's ``Deferred`` values are read back every ``read_every`` steps (default ``log_every``; the same
    on every rank), at the last step and before any other row (see the module's docstring); ``complete(row)``
    then fills in what follows from them (runtime/train.py: throughput from the step time)."""

    def __init__(self, folder, tb, log: Callable[[str], None], log_every: int, total: int,
                 read_every: int | None = None, complete: Callable[[dict[str, Any]], None] | None = None,
                 beats=None) -> None:
        self.folder, self.tb, self.log = folder, tb, log
        self.beats = beats  # runtime/job/ranks.RankBeats (every rank's own time; stragglers named on rank 0)
        self.log_every, self.total = log_every, total
        self.read_every = read_every or log_every
        self.complete = complete
        self.pending: list[dict[str, Any]] = []  # step rows whose device values are not read yet
        self.rows: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.eta = Eta()
        self.start = time.perf_counter()

    def seconds(self) -> float:
        """Seconds since the attempt's loop started."""
        return time.perf_counter() - self.start

    def record(self, row: dict[str, Any]) -> None:
        """A row in metrics.jsonl only (attempt start, resume, final held-out loss), after the pending step rows."""
        self.flush()
        if self.folder is not None:
            self.folder.log(row)

    def step(self, row: dict[str, Any]) -> None:
        """A training step's row (runtime/train.py), completed with its clocks and attempt now, its device values,
        throughput and ETA when read back (``flush``: every ``read_every`` steps and at the last one)."""
        from trainscale.runtime.job.faults import requeue_count, restart_count

        step = int(row["step"])
        row["time"] = self.seconds()
        row["wall"] = time.time()  # seconds since the epoch: restarts and requeues line up across attempts
        row["attempt"] = restart_count()
        row["requeue"] = requeue_count()
        row["eta_s"] = None
        self.pending.append(row)
        if step % self.read_every == 0 or step % self.log_every == 0 or step == self.total:
            self.flush()

    def flush(self) -> None:
        """Read every pending step row's device values (one transfer), complete the rows and write them in order:
        metrics.jsonl, TensorBoard and the sinks, the console line of a logging step."""
        from trainscale.units import duration_text

        if not self.pending:
            return
        rows, self.pending = self.pending, []
        where = [(row, key) for row in rows for key, v in row.items() if isinstance(v, Deferred)]
        for (row, key), value in zip(where, read_deferred([row[key] for row, key in where]), strict=True):
            row[key] = value
        for row in rows:
            step = int(row["step"])
            if self.complete is not None:
                self.complete(row)
            row["eta_s"] = self.eta.add(row["step_time_s"], self.total - step)
            self.losses.append(row["loss"])
            self.rows.append(row)
            if self.folder is not None:
                self.folder.log(row)
            if self.tb is not None:
                self.tb.step(row)
            if step % self.log_every == 0 or step == self.total:
                self.log(f"step {step:5d}/{self.total}  loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                         f"{row['flops_per_s'] / 1e9:.2f} GFLOP/s  MFU {row['mfu']:.1%} ({row['flop_convention']})  "
                         f"lr {row['lr']:.2e}  ETA {duration_text(row['eta_s'])}")
        if self.beats is not None:
            self.beats.write(rows)
            for verdict in self.beats.judge():
                if self.folder is not None:
                    self.folder.log(verdict)
                if self.tb is not None:
                    self.tb.straggler(verdict)

    def eval(self, row: dict[str, Any], line: str) -> None:
        """A held-out evaluation's row (an ``eval`` event) and its console line."""
        self.record(row)  # after the pending step rows
        if self.tb is not None:
            self.tb.eval(row)
        self.log(line)

    def checkpoint(self, step: int, save_s: float) -> None:
        """A committed save: TensorBoard's events up to it reach the disk, and its row."""
        from trainscale.runtime.job.faults import restart_count

        self.flush()
        if self.tb is not None:
            self.tb.flush()
        self.record({"event": "checkpoint", "step": step, "save_s": save_s, "attempt": restart_count()})

    def summary(self, values: dict[str, Any] | None, step: int) -> None:
        """The attempt's end: metrics.jsonl closes; a finished run (``values``: its held-out losses) adds its
        goodput row (runtime/job/runfolder.py) and TensorBoard summary; TensorBoard and the sinks close."""
        self.flush()
        if self.folder is not None:
            self.folder.close()
        if values is not None and self.folder is not None:
            g = self.folder.goodput(self.log)
            if self.tb is not None:
                self.tb.summary({**g, **values}, step)
        if self.tb is not None:
            self.tb.close()
