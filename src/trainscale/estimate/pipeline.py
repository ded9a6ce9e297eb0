"""Pipeline parallelism: where the layers go, how long the bubble is, what crosses between stages.

Scalars or numpy arrays throughout (the planner evaluates many layouts at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def bubble_fraction(p: Any, m: Any, v: Any = 1) -> Any:
    """Idle time / ideal time: (p-1)/m for GPipe and 1F1B (Huang et al. 2019 arXiv 1811.06965 Sec. 2.2;
    Narayanan et al. 2021 arXiv 2104.04473 Sec. 2.2.1), (p-1)/(v·m) for interleaved 1F1B with v
    virtual stages per GPU (Narayanan et al. 2021 Sec. 2.2.2). Pass v = 1 for GPipe and 1F1B."""
    p, m, v = (np.asarray(x, dtype=float) for x in (p, m, v))
    return (p - 1) / (v * m)


def layer_placement(n_layers: int, p: Any, v: Any) -> dict[str, Any]:
    """Layers per pipeline stage for p stages of v chunks each.

    Either the L layers split evenly into p·v chunks, or — as Llama 3 does (arXiv 2407.21783
    Sec. 3.3.2, "we reduce one Transformer layer each from the first and the last stages") — L + 2
    slots split evenly and the first and last chunk give one slot each to the embedding and the
    output head. Returns ``valid`` and the layers on the first stage, on the fullest stage, and on
    the last stage (which also runs the output head).
    """
    p, v = np.asarray(p), np.asarray(v)
    chunks = p * v
    even = n_layers % chunks == 0
    llama = ~even & (p > 1) & ((n_layers + 2) % chunks == 0)
    k = np.where(even, n_layers // chunks, (n_layers + 2) // chunks)  # layers (slots) per chunk
    full = v * k
    edge = np.where(even, full, full - 1)
    first = np.where(p > 1, edge, n_layers)
    fullest = np.where(p > 1, np.where(even | (p > 2), full, edge), n_layers)  # p = 2 has no middle stage
    return {"valid": even | llama, "per_chunk": k, "first": first, "max": fullest, "last": first,
            "balanced": llama}


def pipeline_time(stage_time: Any, m: Any, p: Any, v: Any = 1) -> Any:
    """One step of m micro-batches through the slowest stage: m · t_stage · (1 + bubble) (Narayanan 2021 Eq. 1)."""
    return np.asarray(m) * stage_time * (1 + bubble_fraction(p, m, v))


def fill_drain_hops(p: Any) -> Any:
    """Pipeline hops on the critical path that no steady-state compute hides: p-1 to fill, p-1 to drain."""
    return 2 * (np.asarray(p) - 1)
