"""Pipeline parallelism: where the layers go, how long the bubble is, what crosses between stages.

Scalars or numpy arrays throughout (the planner evaluates many layouts at once).
"""

from __future__ import annotations

from typing import Any, get_args

import numpy as np

from trainscale import placement
from trainscale.specs import Schedule

SCHEDULE: tuple[str, ...] = get_args(Schedule)  # a layout's schedule as a number: its index here
GPIPE, ONE_F_ONE_B, INTERLEAVED = (SCHEDULE.index(s) for s in ("gpipe", "1f1b", "interleaved"))


def bubble_fraction(p: Any, m: Any, v: Any = 1) -> Any:
    """Idle time / ideal time: (p-1)/m for GPipe and 1F1B (Huang et al. 2019 arXiv 1811.06965 Sec. 2.2;
    Narayanan et al. 2021 arXiv 2104.04473 Sec. 2.2.1), (p-1)/(v·m) for interleaved 1F1B with v
    virtual stages per GPU (Narayanan et al. 2021 Sec. 2.2.2). Pass v = 1 for GPipe and 1F1B."""
    p, m, v = (np.asarray(x, dtype=float) for x in (p, m, v))
    return (p - 1) / (v * m)


def layer_placement(n_layers: int, p: Any, v: Any) -> dict[str, Any]:
    """Layers per pipeline rank for p ranks of v stages each: the cut of ``trainscale.placement`` (the
    one the runtime runs), vectorised.

    The planner searches the balanced cuts (``valid``): the L layers split evenly into p·v stages, or
    -- as Llama 3 does (arXiv 2407.21783 Sec. 3.3.2, "we reduce one Transformer layer each from the first
    and the last stages") -- L + 2 slots split evenly and the first and last stage give one slot each
    to the embedding and the output head (``balanced``). Returns ``valid``, ``balanced``, ``per_chunk``
    (layers on the longest stage) and the layers on the first pipeline rank, on the fullest one and on
    the last one (which also runs the output head); ``base``/``extra`` give the cut itself (p·v stages of
    ``base`` layers, ``extra`` of them one longer).
    """
    c = placement.rank_layer_counts(n_layers, p, v)
    return {"valid": c["even"] | c["llama3"], "per_chunk": c["per_stage"], "first": c["first"], "max": c["max"],
            "last": c["last"], "balanced": c["llama3"], "base": c["base"], "extra": c["extra"]}


def pipeline_time(stage_time: Any, m: Any, p: Any, v: Any = 1) -> Any:
    """One step of m micro-batches through the slowest stage: m · t_stage · (1 + bubble) (Narayanan 2021 Eq. 1)."""
    return np.asarray(m) * stage_time * (1 + bubble_fraction(p, m, v))


def dualpipe_bubble_fraction(p: Any, m: Any) -> Any:
    """DualPipe's idle time over the ideal (DeepSeek-V3, arXiv 2412.19437 Table 2): a bubble of
    (PP/2 - 1)(F&B + B - 3W), F&B a forward and a backward chunk run together, W the weight-gradient part of B.
    With F = 1/3, B = 2/3 and W = 1/3 of a micro-batch's stage time t (backward = 2 x forward, half of it the
    weight gradients), F&B = t and the bubble is (PP/2 - 1) x 2t/3, over m x t of work."""
    p, m = (np.asarray(x, dtype=float) for x in (p, m))
    return np.maximum(p / 2 - 1, 0) * (2.0 / 3.0) / m


def in_flight(sched: Any, pp: Any, v: Any, micro: Any, r: Any) -> Any:
    """Micro-batches (in units of a whole stage's layers) whose activations stage r holds at its peak; ``sched``
    is an index into ``SCHEDULE``. One function for the planner (planner/stage_memory.py) and the runtime's rank
    model (measured/rank.py).

    GPipe keeps all m; 1F1B keeps p - r on stage r (Narayanan et al. 2021 Sec. 2.2.1); interleaved 1F1B runs
    Megatron's warm-up of (p - r - 1) x 2 + (v - 1) x p chunk forwards, plus the one in flight, each chunk
    1/v of the stage (Megatron-LM schedules.py forward_backward_pipelining_with_interleaving)."""
    sched, pp, v, micro, r = (np.asarray(x) for x in (sched, pp, v, micro, r))
    one_f = np.minimum(pp - r, micro)
    chunks = np.minimum((pp - r - 1) * 2 + (v - 1) * pp + 1, micro * v)
    return np.select([sched == GPIPE, sched == INTERLEAVED], [micro, chunks / np.maximum(v, 1)], one_f)
