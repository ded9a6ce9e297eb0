"""The candidate layouts the step-time model scores at once: one numpy entry per layout, and the named integer
codes its arrays hold for the layout's choices.

The codes are positions in the ``specs`` literals (``specs.Schedule``, ``specs.Recompute``), so a name and its
number cannot drift apart: ``SCHEDULE[GPIPE] == "gpipe"``. A ZeRO stage is its own number (Rajbhandari et al.
2020 Sec. 5, ``specs.Layout.zero``) and needs no code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.estimate.pipeline import GPIPE as GPIPE  # cfg["schedule"] holds an index into SCHEDULE
from trainscale.estimate.pipeline import INTERLEAVED as INTERLEAVED
from trainscale.estimate.pipeline import ONE_F_ONE_B as ONE_F_ONE_B
from trainscale.estimate.pipeline import SCHEDULE as SCHEDULE
from trainscale.estimate.pipeline import layer_placement
from trainscale.specs import ModelSpec, Recompute

RECOMPUTE: tuple[str, ...] = get_args(Recompute)  # cfg["recompute"] holds an index into it
NO_RECOMPUTE, SELECTIVE, FULL = (RECOMPUTE.index(r) for r in ("none", "selective", "full"))


def per_mode(fn: Any, codes: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Evaluate ``fn(name)`` once per discrete choice present and pick each row's value."""
    out = np.zeros(codes.shape, dtype=float)
    for i, name in enumerate(names):
        sel = codes == i
        if sel.any():
            out = np.where(sel, fn(name), out)
    return out


@dataclass(frozen=True)
class Candidates:
    """The layouts of ``cfg`` as int64 arrays (``sched`` and ``rc`` in the codes above), with what follows from
    them for one model, sequence length and global batch."""

    tp: np.ndarray
    cp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    mb: np.ndarray
    v: np.ndarray
    sched: np.ndarray
    rc: np.ndarray
    zero: np.ndarray
    hsdp: np.ndarray
    ep: np.ndarray
    first: np.ndarray  # decoder layers the layout puts on the first pipeline rank (0: the policy's cut)
    last: np.ndarray  # ... on the last pipeline rank (0: the policy's cut)
    sp: np.ndarray  # sequence parallelism, only where tp > 1
    world: np.ndarray  # tp x cp x pp x dp
    micro: np.ndarray  # micro-batches per step through each pipeline
    ve: np.ndarray  # chunks per pipeline rank: v under the interleaved schedule, else 1
    place: dict[str, Any]  # layers per pipeline rank (pipeline.layer_placement)
    tokens: np.ndarray  # tokens of its sequence shard a rank computes per micro-batch

    @property
    def full(self) -> np.ndarray:
        return self.rc == FULL


def explicit_cut(place: dict[str, Any], n_layers: int, pp: Any, ve: Any, first: Any, last: Any) -> dict[str, Any]:
    """``place`` (``pipeline.layer_placement``) where a layout gives its own cut: ``first`` layers on pipeline rank
    0 and ``last`` on rank pp - 1 when set (> 0), the rest evenly over the other ranks, each rank's count split
    evenly over its ve chunks (Megatron-Core's num_layers_in_first/last_pipeline_stage,
    megatron/core/transformer/transformer_block.py get_num_layers_to_build; ``rules.uneven_cut`` keeps it whole).
    ``max`` is the fullest rank (the critical stage's count); where an end rank is the longer one, the planner's
    memory counts rank 1 as holding that many (it errs high)."""
    own = (first > 0) | (last > 0)
    if not np.any(own):
        return place
    ranks = pp - (first > 0) - (last > 0)
    per = np.where(ranks > 0, (n_layers - first - last) // np.maximum(ranks, 1), 0)
    n_first, n_last = np.where(first > 0, first, per), np.where(last > 0, last, per)
    n_max = np.maximum(np.maximum(n_first, n_last), per)
    out = {"first": n_first, "last": n_last, "max": n_max, "per_chunk": -(-n_max // ve), "base": n_first // ve,
           "extra": np.zeros_like(per), "balanced": np.zeros(np.shape(own), dtype=bool),
           "valid": np.ones(np.shape(own), dtype=bool)}
    return {k: np.where(own, out[k], place[k]) if k in out else place[k] for k in place}


def with_mtp(place: dict[str, Any], mtp: int, pp: Any) -> dict[str, Any]:
    """``place`` with the model's ``mtp`` multi-token-prediction blocks counted as layers of the last pipeline rank
    (and of the only one without a pipeline), where Megatron-Core puts them (multi_token_prediction.py
    mtp_on_this_rank: "all of MTP layers on the last pipeline stage")."""
    if not mtp:
        return place
    last = place["last"] + mtp
    return {**place, "last": last, "first": place["first"] + np.where(pp > 1, 0, mtp),
            "max": np.maximum(place["max"] + np.where(pp > 1, 0, mtp), last)}


def candidates(m: ModelSpec, cfg: dict[str, Any], seq: int, global_seqs: int) -> Candidates:
    """``cfg``'s arrays (tp cp pp dp mb v schedule recompute zero hsdp sp, and ep for a MoE, first/last for a cut the
    layout gives) read as ``Candidates``."""
    tp, cp, pp, dp, mb, v, sched, rc, zero, hsdp = (np.asarray(cfg[k], dtype=np.int64) for k in (
        "tp", "cp", "pp", "dp", "mb", "v", "schedule", "recompute", "zero", "hsdp"))
    ep = np.asarray(cfg["ep"], dtype=np.int64) if "ep" in cfg else np.ones_like(tp)
    if not m.is_moe and np.any(ep > 1):
        raise TrainscaleError(f"expert parallelism (ep{int(np.max(ep))}) needs a mixture-of-experts model, and "
                              f"{m.name} is dense")
    first, last = (np.asarray(cfg[k], dtype=np.int64) if k in cfg else np.zeros_like(tp) for k in ("first", "last"))
    sp = np.asarray(cfg["sp"], dtype=bool) & (tp > 1)
    ve = np.where(sched == INTERLEAVED, v, 1)
    place = with_mtp(explicit_cut(layer_placement(m.n_layers, pp, ve), m.n_layers, pp, ve, first, last), m.mtp_layers,
                     pp)
    return Candidates(tp=tp, cp=cp, pp=pp, dp=dp, mb=mb, v=v, sched=sched, rc=rc, zero=zero, hsdp=hsdp, ep=ep,
                      first=first, last=last, sp=sp, world=tp * cp * pp * dp, micro=global_seqs // (dp * mb), ve=ve,
                      place=place, tokens=mb * seq / cp)

