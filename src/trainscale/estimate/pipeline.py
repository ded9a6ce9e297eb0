"""Pipeline parallelism: where the layers go, how long the bubble is, what crosses between stages.

Scalars or numpy arrays throughout (the planner evaluates many layouts at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainscale import placement


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
