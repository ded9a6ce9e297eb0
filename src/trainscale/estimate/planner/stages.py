"""The pipeline: which layers each stage holds, the critical (slowest) stage and its time per micro-batch, the
step through the pipeline with its bubble and point-to-point traffic, and the parameters every stage holds.

A MoE's layers are unequal: its ``first_dense_layers`` sit on the first pipeline rank (those of its first stage),
the rank after it any left over (exact for v = 1; with v > 1 the dense layers past the first stage are counted as
MoE ones, the heavier kind). Arrays over the candidates (``candidates.Candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainscale.estimate import comms
from trainscale.estimate.params import embedding_params, expert_tensors, head_params, layer_params, numel
from trainscale.estimate.pipeline import bubble_fraction, dualpipe_bubble_fraction, pipeline_time
from trainscale.estimate.planner.candidates import Candidates
from trainscale.estimate.planner.efficiencies import Efficiencies
from trainscale.estimate.planner.layer import LayerTime, layer_bytes
from trainscale.estimate.planner.software import Software
from trainscale.specs import ModelSpec


@dataclass(frozen=True)
class DenseLayers:
    """How many of a MoE's leading dense layers sit on the first pipeline rank, the fullest one, the last one,
    and the second one (the fullest from rank 1 on, as memory counts it); all 0 for a dense model."""

    first: Any = 0
    mid: Any = 0
    last: Any = 0
    second: Any = 0


def dense_layers(m: ModelSpec, c: Candidates) -> DenseLayers:
    if not m.is_moe:
        return DenseLayers()
    fd, L, place, pp = m.first_dense_layers, m.n_layers, c.place, c.pp
    chunks = pp * c.ve
    stage0 = np.where(chunks > 1, place["base"] + (place["extra"] == chunks - 1), L)
    first = np.minimum(fd, stage0)
    n1 = np.where(pp > 2, place["max"], place["last"])
    return DenseLayers(first=first, mid=np.where(pp > 1, np.clip(fd - place["first"], 0, place["max"]), first),
                       last=np.where(pp > 1, np.clip(fd - (L - place["last"]), 0, place["last"]), first),
                       second=np.where(pp > 1, np.clip(fd - place["first"], 0, n1), 0))


# ----------------------------------------------------------------------------- the critical stage


LAST = 2  # critical_stage weighs the first, the fullest and the last stage, in this order


@dataclass(frozen=True)
class Critical:
    """The slowest stage: its dense and MoE layers and the output head's time if it runs there."""

    n_dense: Any
    n_moe: Any
    head: Any

    @property
    def layers(self) -> Any:
        return self.n_dense + self.n_moe


def exposed_layer_time(lay: LayerTime, tp_x: Any, cp_x: Any) -> Any:
    """A layer's time on the critical path: compute, recompute, and the traffic its compute does not hide."""
    return lay.compute + lay.rc + tp_x + cp_x + lay.a2a_x


def critical_stage(m: ModelSpec, c: Candidates, d: DenseLayers, t_dense: Any, t_moe: Any, t_head: Any) -> Critical:
    """The slowest stage from the layer times ``t_dense``, ``t_moe`` (``exposed_layer_time``): the fullest one,
    or the last one if the output head tips it over; with a MoE's dense layers, the slowest of the first, the
    fullest and the last."""
    place, pp = c.place, c.pp
    if not m.is_moe:
        last_slower = place["last"] * t_dense + t_head > place["max"] * t_dense
        return Critical(np.where(last_slower, place["last"], place["max"]), 0, np.where(last_slower, t_head, 0.0))
    cand_t = np.stack([d.first * t_dense + (place["first"] - d.first) * t_moe + np.where(pp > 1, 0.0, t_head),
                       d.mid * t_dense + (place["max"] - d.mid) * t_moe,
                       d.last * t_dense + (place["last"] - d.last) * t_moe + t_head])
    crit = np.argmax(cand_t, axis=0)
    n_all = np.choose(crit, [place["first"], place["max"], place["last"]])
    n_dense = np.choose(crit, [d.first, d.mid, d.last])
    return Critical(n_dense, n_all - n_dense, np.where((crit == LAST) | (pp == 1), t_head, 0.0))


@dataclass(frozen=True)
class StageTime:
    """The critical stage's time per micro-batch, by part."""

    compute: Any
    rc: Any
    tp: Any
    cp: Any
    a2a: Any

    @property
    def total(self) -> Any:
        return self.compute + self.rc + self.tp + self.cp + self.a2a


def stage_time(c: Candidates, k: Critical, dense: LayerTime, moe: LayerTime, tp_x: Any, cp_x: Any,
               sw: Software) -> StageTime:
    """Its layers' times on the critical stage; each chunk pass of a micro-batch also pays the software's fixed
    dispatch cost."""
    t_fixed = c.ve * sw.microbatch_overhead_s
    return StageTime(k.n_dense * dense.compute + k.n_moe * moe.compute + k.head + t_fixed,
                     k.n_dense * dense.rc + k.n_moe * moe.rc, k.layers * tp_x, k.layers * cp_x, k.n_moe * moe.a2a_x)


# ----------------------------------------------------------------------------- the pipeline


def bubble(c: Candidates, sw: Software) -> Any:
    """Idle over ideal time of the schedule (``pipeline.bubble_fraction``, DualPipe's own), 0 without a pipeline."""
    return np.where(c.pp > 1, dualpipe_bubble_fraction(c.pp, c.micro) if sw.pipeline == "dualpipe"
                    else bubble_fraction(c.pp, c.micro, c.ve), 0.0)


def pipeline_step(c: Candidates, t_stage: Any, sw: Software) -> Any:
    """m micro-batches through the critical stage with the schedule's bubble (``pipeline.pipeline_time``;
    DualPipe's bubble, DeepSeek-V3 Table 2, with a pipeline)."""
    if sw.pipeline == "dualpipe":
        return np.where(c.pp > 1, c.micro * t_stage * (1 + dualpipe_bubble_fraction(c.pp, c.micro)),
                        pipeline_time(t_stage, c.micro, c.pp, c.ve))
    return pipeline_time(t_stage, c.micro, c.pp, c.ve)


def p2p_exposed(m: ModelSpec, c: Candidates, topo: comms.Topology, eff: Efficiencies) -> Any:
    """Pipeline point to point: activations sharded over TP (sequence parallel / scatter-gather, Narayanan 2021
    Sec. 4.1), async in steady state, exposed in fill and drain: a micro-batch crosses p x v - 1 chunk boundaries
    to fill the pipeline and as many to drain it."""
    bw_pp, lat_pp = comms.link(topo, c.pp, c.tp * c.cp * c.ep * c.pp, collective=False)  # EP ranks sit inside pp
    t_p2p = comms.p2p_time(layer_bytes(m, c) / c.tp, bw_pp, lat_pp)
    hops = 2 * (c.pp * c.ve - 1)
    return np.where(c.pp > 1, (hops + (1 - eff.p2p_overlap) * 2 * c.micro * c.ve) * t_p2p, 0.0)


# ----------------------------------------------------------------------------- parameters per stage


@dataclass(frozen=True)
class StageParams:
    """Parameters per rank on the first stage, the second (the fullest from rank 1 on) and the last: those split
    over TP (``first``, ``mid``, ``last``) and a MoE's routed experts split over EP (``e_first`` ...)."""

    moe: bool
    pp: Any
    first: Any
    mid: Any
    last: Any
    e_first: Any = 0.0
    e_mid: Any = 0.0
    e_last: Any = 0.0

    @property
    def crit(self) -> Any:
        """The most any stage holds, split over TP."""
        return np.where(self.pp > 1, np.maximum(self.mid, np.maximum(self.first, self.last)), self.first)

    @property
    def e_crit(self) -> Any:
        """The most routed-expert parameters any stage holds per rank (0 for a dense model)."""
        return np.where(self.pp > 1, np.maximum(self.e_mid, np.maximum(self.e_first, self.e_last)), self.e_first) \
            + 0.0


def stage_params(m: ModelSpec, c: Candidates, d: DenseLayers, sw: Software) -> StageParams:
    """A layer's attention, norms (and a MoE layer's router and shared expert) split over TP, its routed experts
    whole over EP; the embedding on the first stage, the head on the last, which also keeps its own copy of a tied
    embedding. DualPipe holds every stage's parameters twice (DeepSeek-V3 Table 2: "Parameter 2x")."""
    place, pp, tp, ep = c.place, c.pp, c.tp, c.ep
    emb, head = embedding_params(m), head_params(m)
    tied_copy = emb if m.tied_embeddings else 0
    ends = np.where(pp > 1, emb, emb + head)
    if not m.is_moe:
        lp = layer_params(m)
        s = StageParams(m.is_moe, pp, (place["first"] * lp + ends) / tp, place["max"] * lp / tp,
                        (place["last"] * lp + head + tied_copy) / tp)
    else:
        lp_d, lp_e, lp_m = moe_layer_params(m)
        n1 = np.where(pp > 2, place["max"], place["last"])
        s = StageParams(m.is_moe, pp, (d.first * lp_d + (place["first"] - d.first) * lp_m + ends) / tp,
                        (d.second * lp_d + (n1 - d.second) * lp_m) / tp,
                        (d.last * lp_d + (place["last"] - d.last) * lp_m + head + tied_copy) / tp,
                        (place["first"] - d.first) * lp_e / ep, (n1 - d.second) * lp_e / ep,
                        (place["last"] - d.last) * lp_e / ep)
    if sw.pipeline == "dualpipe":
        dual = np.where(pp > 1, 2.0, 1.0)
        s = StageParams(m.is_moe, pp, s.first * dual, s.mid * dual, s.last * dual, s.e_first * dual, s.e_mid * dual,
                        s.e_last * dual)
    return s


def moe_layer_params(m: ModelSpec) -> tuple[int, int, int]:
    """(a leading dense layer, a MoE layer's routed experts, the rest of a MoE layer) in parameters."""
    lp_e = numel(expert_tensors(m, m.n_layers - 1))
    return (layer_params(m, 0) if m.first_dense_layers else 0), lp_e, layer_params(m, m.n_layers - 1) - lp_e

