"""Injected failures, to prove the job survives them.

Spec: ``KIND@step=N[,rank=R][,seconds=S]`` joined by ``;`` — e.g. ``crash@step=7,rank=1``.

  crash             the rank exits abruptly (os._exit) at the start of step N
  hang              the rank stops making progress (sleeps) at step N; the others' collectives time
                    out, the job fails, and torchrun restarts it
  slow              the rank sleeps S seconds (default 2) at step N: a straggler, no failure
  kill-during-save  rank 0 dies after the step-N checkpoint is written but before it is committed

A fault fires once per job: the restarted job (torchrun sets TORCHELASTIC_RESTART_COUNT, Slurm sets
SLURM_RESTART_COUNT on a requeue) sees that its restart count is above the fault's attempt (0, unless
``attempt=`` says otherwise).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from trainscale.errors import TrainscaleError

KINDS = ("crash", "hang", "slow", "kill-during-save")
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<args>.+)$")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    seconds: float = 2.0
    attempt: int = 0

    def __str__(self) -> str:
        return f"{self.kind}@step={self.step},rank={self.rank}"


def parse_faults(text: str | None, world: int | None = None) -> list[Fault]:
    """The faults of ``text``; with ``world``, each names an existing rank."""
    if not text:
        return []
    out = []
    for part in text.split(";"):
        part = part.strip()
        m = _SPEC.match(part)
        if not m or m.group("kind") not in KINDS:
            raise TrainscaleError(f"fault '{part}' is not understood; use KIND@step=N[,rank=R] with KIND one of "
                                  f"{', '.join(KINDS)}")
        kw: dict[str, float] = {}
        for item in m.group("args").split(","):
            key, _, val = item.partition("=")
            if key not in ("step", "rank", "seconds", "attempt") or not val:
                raise TrainscaleError(f"fault '{part}': '{item}' should be step=N, rank=R, seconds=S or attempt=A")
            try:
                kw[key] = float(val) if key == "seconds" else int(val)
            except ValueError:
                raise TrainscaleError(f"fault '{part}': {key} must be a number, not '{val}'") from None
        if "step" not in kw:
            raise TrainscaleError(f"fault '{part}' needs step=N")
        for key, lo, hi in (("step", 1, 1e9), ("rank", 0, 1e8), ("seconds", 0, 86_400), ("attempt", 0, 1000)):
            if key in kw and not lo <= kw[key] <= hi:  # also refuses nan (every comparison is false)
                raise TrainscaleError(f"fault '{part}': {key} must be from {lo:g} to {hi:g}, not {kw[key]}")
        out.append(Fault(m.group("kind"), **kw))  # type: ignore[arg-type]
        if world is not None and out[-1].rank >= world:
            raise TrainscaleError(f"fault '{part}' names rank {out[-1].rank}, but the job has {world} process(es)")
    return out


def restart_count() -> int:
    """torchrun's restarts of this job's workers inside one launch (one Slurm allocation)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def requeue_count() -> int:
    """Slurm's requeues of the batch job (SLURM_RESTART_COUNT, set by Slurm on a requeued job's start)."""
    try:
        return max(0, int(os.environ.get("SLURM_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def _active(f: Fault, step: int, rank: int) -> bool:
    return f.step == step and f.rank == rank and restart_count() + requeue_count() == f.attempt


def at_step(faults: list[Fault], step: int, rank: int, log=print) -> None:
    """Call at the start of each step on every rank."""
    for f in faults:
        if not _active(f, step, rank):
            continue
        if f.kind == "crash":
            log(f"[fault] {f}: rank {rank} crashes now")
            os._exit(13)
        if f.kind == "hang":
            log(f"[fault] {f}: rank {rank} hangs now")
            while True:
                time.sleep(3600)
        if f.kind == "slow":
            log(f"[fault] {f}: rank {rank} stalls {f.seconds:g} s")
            time.sleep(f.seconds)


def before_commit(faults: list[Fault], rank: int, log=print):
    """A CheckpointManager.before_commit hook for kill-during-save faults."""
    def hook(step: int) -> None:
        for f in faults:
            if f.kind == "kill-during-save" and _active(f, step, rank):
                log(f"[fault] {f}: rank {rank} dies with the step-{step} checkpoint written but not committed")
                os._exit(14)
    return hook
