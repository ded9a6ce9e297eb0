"""The learning-rate schedule of a run, and how a resumed run keeps it.

``[train] schedule`` (every one warms up linearly from lr / warmup to ``lr`` over the first ``warmup`` steps;
update s, 0-based, uses ``lr_at(s)``; the floor is reached at the horizon, after its last update):

    cosine    half a cosine from lr to min_lr_ratio x lr (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle; the
              Chinchilla / Llama recipe, Hoffmann et al. 2022) -- the default
    linear    a straight line from lr to min_lr_ratio x lr
    wsd       warmup-stable-decay (Hu et al. 2024, MiniCPM, arXiv 2404.06395 Sec. 4): lr until the last
              ``decay_fraction`` of the steps (MiniCPM: a decay over ~10% of the tokens suffices), then down to
              min_lr_ratio x lr; MiniCPM leaves the decreasing function open (its runs decay exponentially), here it
              is linear, the shape of Hagele et al. 2024 (arXiv 2405.18392) "linear cooldown"
    constant  lr

The **horizon** (the schedule's length) is ``train.steps`` when the run started; every checkpoint records it with
the run's **total** (the step the run is to reach). A resumed run keeps both whatever ``--steps`` says: fewer
steps stop the run early on the same schedule (a later ``--resume`` goes on to the total), so the learning rate
of every step is the uninterrupted run's. Going past the total is explicit (``--extend``): where the steps run so
far had the same learning rates under the longer horizon (still in warmup, WSD's stable phase, a constant
schedule) the schedule is laid out again for the new total -- a WSD run extended in its stable phase decays at the
new end, exactly as if it had been started for that long; otherwise the recorded schedule runs to its end and
the extra steps train at its final learning rate.

Imports no torch: ``trainscale train --resume`` checks a continuation before it starts anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainscale.errors import TrainscaleError


def wsd_decay_start(t: Any, horizon: int) -> int:
    """The first update of WSD's decay: the last ``decay_fraction`` of the horizon (never inside the warmup)."""
    decay = max(1, round(t.decay_fraction * horizon))
    return max(t.warmup, horizon - decay)


def _falling(step: int, start: int, end: int) -> float:
    """How far update ``step`` is along a fall that starts at update ``start`` and ends at ``end``: 0..1."""
    return min(1.0, max(0.0, (step - start) / max(1, end - start)))


def lr_at(step: int, cfg: Any, horizon: int | None = None) -> float:
    """The learning rate of update ``step`` (0-based) for ``cfg.train`` (or a TrainSection), over ``horizon``
    steps (default: train.steps). Past the horizon: the schedule's final learning rate."""
    t = getattr(cfg, "train", cfg)
    horizon = t.steps if horizon is None else horizon
    if t.warmup and step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    floor = t.min_lr_ratio
    kind = getattr(t, "schedule", "cosine")
    if kind == "constant":
        return t.lr
    if kind == "cosine":
        p = _falling(step, t.warmup, horizon)
        return t.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))
    start = t.warmup if kind == "linear" else wsd_decay_start(t, horizon)
    return t.lr * (floor + (1 - floor) * (1 - _falling(step, start, horizon)))


def fixed_steps(t: Any, horizon: int) -> float:
    """How many first updates have a learning rate that does not depend on the horizon (the warmup and the first
    update at the peak; WSD: up to and including the decay's first update, still at the peak)."""
    kind = getattr(t, "schedule", "cosine")
    if kind == "constant":
        return math.inf
    if kind == "wsd":
        return wsd_decay_start(t, horizon) + 1
    return t.warmup + 1


@dataclass(frozen=True)
class Horizon:
    """A run's schedule length and the step it is to reach (total >= schedule_steps after an ``--extend``)."""

    schedule_steps: int
    total: int

    def extras(self) -> dict[str, int]:
        return {"horizon": self.schedule_steps, "total": self.total}


def recorded(extras: dict[str, Any], default: int, where: str) -> Horizon:
    """The horizon a checkpoint's extras record; ``default`` (the config's steps) for a checkpoint written before
    horizons were recorded."""
    got = [extras.get("horizon", default), extras.get("total", extras.get("horizon", default))]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in got):
        raise TrainscaleError(f"checkpoint extras in {where} record a malformed schedule ({got}); it was not "
                              "written by trainscale")
    return Horizon(got[0], max(got))


def _final_lr(t: Any, horizon: int) -> float:
    return lr_at(horizon, t, horizon)


def continuation(t: Any, step: int, rec: Horizon, steps: int | None, extend: bool, where: str) -> tuple[Horizon, int]:
    """A run resumed after update ``step``, whose checkpoint recorded ``rec``, asked for ``steps`` (None: its
    recorded total) -> (its horizon from now on, the step this attempt stops at); refused in one sentence when it
    already got there or when going past the total needs ``--extend``. ``t``: the config's train section."""
    want = rec.total if steps is None else steps
    if step >= want:
        if step >= rec.total:
            raise TrainscaleError(f"the run in {where} already reached step {step} of {rec.total}; train further with "
                                  f"--resume --steps N --extend (N > {step}), or train into a fresh folder")
        raise TrainscaleError(f"the run in {where} already reached step {step}, past --steps {want}; ask for more "
                              f"(its total is {rec.total}; past it with --extend)")
    if want <= rec.total:
        return rec, want
    same = step <= min(fixed_steps(t, rec.schedule_steps), fixed_steps(t, want))
    if not extend:
        then = (f"the schedule is laid out again for {want} steps: the {step} steps so far had the same learning rates"
                if same else f"steps {max(step, rec.schedule_steps) + 1}..{want} train at the schedule's final "
                f"learning rate, {_final_lr(t, rec.schedule_steps):.3g}")
        raise TrainscaleError(f"--steps {want}: the run in {where} was laid out for {rec.total} steps and its "
                              f"learning-rate schedule ends at step {rec.schedule_steps}; going past it is explicit: "
                              f"add --extend ({then}), or resume with --steps {rec.total} or fewer")
    return Horizon(want if same else rec.schedule_steps, want), want
