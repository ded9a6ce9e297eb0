"""Each rank's own time per step, stragglers named against the plan, and the stacks of a step that hangs.

A rank's **own time** of a step is what it spends before it can meet its peers: from the start of its loop
iteration (the injected faults, the batch, the forward and backward passes) to its arrival at the step's gradient
synchronisation (runtime/train.py; the host's clock on CPU, two CUDA events on the GPU stream otherwise, read back
with the step's other values). In a synchronous step every rank ends together, so the step time cannot tell which
rank held the others up; the own time can: a straggler's is long, its peers' are not (they wait inside the
collective). Under FSDP, TP and pipelines ranks also meet inside the forward pass, so there a straggler's delay
shows in its peers' own time too, smaller; the slowest rank is still the one named.

``RankBeats``: every rank appends its step rows' own times and wall clock (its **heartbeat**) to
``RUN/ranks/rankNNNNN.jsonl`` (with a run folder per node, in its own node's: there rank 0 sees only its node's
ranks, and names no straggler among ranks it cannot see); rank 0 reads its peers' new lines at each of its own
logging read-backs and names a rank whose own time exceeds both the median of its peers' and the plan's
prediction for it (estimate/measured/rank.rank_step_time's compute part on this machine's hardware profile, when
one exists) by
``margin`` and by at least ``MIN_EXCESS_S``: a console line, a ``straggler`` row in metrics.jsonl and a
TensorBoard scalar.

``HangWatch``: around each loop iteration, Python's faulthandler is armed to write every thread's stack of this
rank into ``RUN/stacks/rankNNNNN.txt`` if the iteration runs past ``factor`` x its reference (the plan's
predicted step time, else the median of the steps so far) and at least ``floor_s``: a hung rank and the peers
waiting for it each leave their stacks in the run folder before the collective timeout ends the job. On CUDA the
NCCL flight recorder is switched on too (``nccl_recorder_env``: torch's ``TORCH_NCCL_*`` variables), dumped by
torch beside the stacks when a collective times out.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainscale.runtime.job.metrics import read_rows

MIN_EXCESS_S = 0.25  # a straggler costs its peers at least this much per step: below it, a busy host's noise
WINDOW = 20  # steps of own time kept for the hang reference
KEEP_STEPS = 1000  # steps rank 0 keeps waiting for every rank's heartbeat


def ranks_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ranks"


def stacks_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "stacks"


def nccl_recorder_env(run_dir: str | Path) -> dict[str, str]:
    """torch's NCCL flight recorder (ProcessGroupNCCL reads these when a NCCL group is made): a ring of the last
    collectives per rank, dumped into RUN/stacks/nccl_trace_rank_N when a collective times out."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(stacks_dir(run_dir) / "nccl_trace_rank_")}


def straggler_line(v: dict[str, Any]) -> str:
    """The console's sentence for a ``straggler`` row (rank 0's log, and `trainscale train` following the run)."""
    said = "no hardware profile to predict it" if v.get("predicted_s") is None else \
        f"{float(v['predicted_s']):.3g} s predicted for it"
    a, b = (int(x) for x in v["steps"])
    steps = f"steps {a}-{b}" if a != b else f"step {a}"
    return (f"[straggler] rank {int(v['rank'])} at {steps}: {float(v['own_s']):.3g} s of its own per step vs "
            f"{float(v['peers_s']):.3g} s on its peers (median) and {said}; margin {float(v['margin']):.0%}")


class RankBeats:
    """One rank's heartbeat file; on rank 0 also the judge of every rank's own time (see the module docstring).
    ``predicted``: each rank's predicted own seconds per step, or None (no hardware profile)."""

    def __init__(self, run_dir: Path, rank: int, world: int, margin: float, predicted: list[float] | None,
                 log: Callable[[str], None]) -> None:
        self.rank, self.world, self.margin, self.predicted, self.log = rank, world, margin, predicted, log
        folder = ranks_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank:05d}.jsonl"
        self.file = open(self.path, "a")  # noqa: SIM115 - appended to for the attempt's life
        self.peers = [folder / f"rank{r:05d}.jsonl" for r in range(world)]
        self.offsets = [0] * world
        self.own: dict[int, dict[int, float]] = {}  # step -> rank -> own seconds (rank 0)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Every rank, after its rows are read back: their own times and wall clocks, one line each."""
        for row in rows:
            if row.get("own_s") is not None:
                self.file.write(json.dumps({"step": row["step"], "wall": row["wall"], "own_s": row["own_s"]}) + "\n")
        self.file.flush()

    def judge(self) -> list[dict[str, Any]]:
        """Rank 0: the peers' new heartbeats -> a verdict per straggling rank over the steps every rank reported
        since the last call (``event: straggler`` rows, said on the console too)."""
        if self.rank != 0 or self.world < 2:
            return []
        for r, path in enumerate(self.peers):
            if path.exists():
                got, self.offsets[r] = read_rows(path, self.offsets[r])
                for row in got:
                    if isinstance(row.get("own_s"), (int, float)) and isinstance(row.get("step"), int):
                        self.own.setdefault(row["step"], {})[r] = float(row["own_s"])
        complete = sorted(s for s, by in self.own.items() if len(by) == self.world)
        if not complete:  # (a run folder per node: the peers' heartbeats are on their own nodes, never complete)
            for s in sorted(self.own)[:-KEEP_STEPS]:
                del self.own[s]
            return []
        window = [self.own.pop(s) for s in complete]
        for s in [s for s in self.own if s < complete[-1]]:  # a step a rank never reported (restarted)
            del self.own[s]
        mean = [statistics.fmean(by[r] for by in window) for r in range(self.world)]
        verdicts = []
        for r in range(self.world):
            peers = statistics.median(mean[q] for q in range(self.world) if q != r)
            bar = max((1 + self.margin) * peers, peers + MIN_EXCESS_S)
            predicted = None if self.predicted is None else self.predicted[r]
            if predicted is not None:
                bar = max(bar, (1 + self.margin) * predicted)
            if mean[r] > bar:
                verdicts.append({"event": "straggler", "rank": r, "steps": [complete[0], complete[-1]],
                                 "step": complete[-1], "own_s": mean[r], "peers_s": peers, "predicted_s": predicted,
                                 "margin": self.margin, "wall": time.time()})
        for v in verdicts:
            self.log(straggler_line(v))
        return verdicts

    def close(self) -> None:
        self.file.close()


class HangWatch:
    """Every thread's stack of this rank written to RUN/stacks/rankNNNNN.txt when a loop iteration runs past its
    limit (see the module docstring). ``predicted_s``: the plan's step time for this rank, or None."""

    def __init__(self, run_dir: Path, rank: int, factor: float, floor_s: float, predicted_s: float | None,
                 log: Callable[[str], None]) -> None:
        self.factor, self.floor_s, self.predicted_s, self.log = factor, floor_s, predicted_s, log
        folder = stacks_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank:05d}.txt"
        self.file = open(self.path, "a")  # noqa: SIM115 - faulthandler writes into its descriptor from a thread
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.armed: tuple[int, float, float] | None = None  # step, start, limit

    def limit(self) -> float | None:
        ref = self.predicted_s if self.predicted_s is not None else (
            statistics.median(self.times) if self.times else None)
        return None if ref is None else max(self.factor * ref, self.floor_s)

    def arm(self, step: int) -> None:
        """Before the iteration of ``step`` (not before the first step measured: it compiles, warms up)."""
        limit = self.limit()
        if limit is None:
            self.armed = (step, time.perf_counter(), 0.0)
            return
        self.file.seek(0, os.SEEK_END)
        self.size = self.file.tell()
        faulthandler.dump_traceback_later(limit, repeat=False, file=self.file, exit=False)
        self.armed = (step, time.perf_counter(), limit)

    def disarm(self) -> None:
        """After the iteration: the alarm off; its time kept; a dump that fired is said on the console."""
        if self.armed is None:
            return
        step, start, limit = self.armed
        self.armed = None
        seconds = time.perf_counter() - start
        if limit:
            faulthandler.cancel_dump_traceback_later()
            if self.path.stat().st_size > self.size:
                self.file.write(f"^ step {step} ran {seconds:.1f} s, over its {limit:.1f} s limit\n\n")
                self.file.flush()
                self.log(f"[hang] step {step} ran {seconds:.1f} s, over its {limit:.1f} s limit: every thread's "
                         f"stack is in {self.path}")
        self.times.append(seconds)

    def close(self) -> None:
        if self.armed is not None and self.armed[2]:
            faulthandler.cancel_dump_traceback_later()
        self.file.close()
