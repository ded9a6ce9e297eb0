"""The pipeline: which layers each stage holds, the critical (slowest) stage and its time per micro-batch, the
step through the pipeline with its bubble and point-to-point traffic, and the parameters every stage holds.

A MoE's layers are unequal: its ``first_dense_layers`` sit on the first pipeline rank (those of its first stage),
the rank after it any left over (exact for v = 1; with v > 1 the dense layers past the first stage are counted as
MoE ones, the heavier kind). Multi-token-prediction blocks (``ModelSpec.mtp_layers``) are layers of the last rank
(``candidates.with_mtp``), of the kind of the model's last layer, with their projection, a copy of the shared
embedding (Megatron-Core builds one on the stage that runs MTP) and one more output head and loss each. A cut the
layout gives (firstN / lastN) is ``candidates.explicit_cut``'s. Arrays over the candidates
(``candidates.Candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from trainscale.estimate import comms, memory
from trainscale.estimate.params import (
    embedding_params,
    expert_tensors,
    head_params,
    layer_params,
    layer_tensors,
    mtp_block_extra,
    numel,
)
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
    fd, L, place, pp = m.first_dense_layers, m.n_layers + m.mtp_layers, c.place, c.pp  # MTP blocks follow layer L
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


def critical_stage(m: ModelSpec, c: Candidates, d: DenseLayers, t_dense: Any, t_moe: Any, t_head: Any,
                   dual: bool = False) -> Critical:
    """The slowest stage from the layer times ``t_dense``, ``t_moe`` (``exposed_layer_time``): the fullest one,
    or the last one if the output head tips it over; with a MoE's dense layers, the slowest of the first, the
    fullest and the last. Each MTP module runs the output head again (its M_k projection, 2d x d per token, is
    left out of the time: 1.5 % of DeepSeek-V3's MTP block). ``dual`` (DualPipe): pipeline rank r runs stage r of
    one direction and stage pp - 1 - r of the other, so the end ranks pair the first stage with the last ("the
    shallowest layers (including the embedding layer) and deepest layers (including the output head) ... on the
    same PP rank", DeepSeek-V3 Sec. 2.2): a rank's time per micro-batch is the mean of its two stages'."""
    place, pp = c.place, c.pp
    t_head = t_head * (1 + m.mtp_layers)
    if not m.is_moe and not dual:
        last_slower = place["last"] * t_dense + t_head > place["max"] * t_dense
        return Critical(np.where(last_slower, place["last"], place["max"]), 0, np.where(last_slower, t_head, 0.0))
    n_first, n_mid, n_last = (np.asarray(place[k]) + 0.0 for k in ("first", "max", "last"))
    d_first, d_mid, d_last = (np.asarray(x) + 0.0 for x in (d.first, d.mid, d.last))
    h_first, h_last = np.where(pp > 1, 0.0, t_head), t_head + 0.0
    if dual:
        ends = [np.where(pp > 1, (a + b) / 2, a) for a, b in ((n_first, n_last), (d_first, d_last), (h_first, h_last))]
        n_first, d_first, h_first = ends
        n_last, d_last, h_last = ends
    cand_t = np.stack([d_first * t_dense + (n_first - d_first) * t_moe + h_first,
                       d_mid * t_dense + (n_mid - d_mid) * t_moe,
                       d_last * t_dense + (n_last - d_last) * t_moe + h_last])
    crit = np.argmax(cand_t, axis=0)
    n_all = np.choose(crit, [n_first, n_mid, n_last])
    n_dense = np.choose(crit, [d_first, d_mid, d_last])
    return Critical(n_dense, n_all - n_dense, np.choose(crit, [h_first, np.zeros_like(h_last), h_last]))


@dataclass(frozen=True)
class StageTime:
    """The critical stage's time per micro-batch, by part; ``param_passes`` (``param_pass_time``) is part of
    ``compute``, kept apart for ``plan --explain-step``."""

    compute: Any
    rc: Any
    tp: Any
    cp: Any
    a2a: Any
    param_passes: Any = 0.0

    @property
    def total(self) -> Any:
        return self.compute + self.rc + self.tp + self.cp + self.a2a


def stage_time(c: Candidates, k: Critical, dense: LayerTime, moe: LayerTime, tp_x: Any, cp_x: Any,
               sw: Software, t_params: Any = 0.0) -> StageTime:
    """Its layers' times on the critical stage; each chunk pass of a micro-batch also pays the software's fixed
    dispatch cost (``fixed_time``), and each micro-batch its passes over the stage's parameters ``t_params``
    (``param_pass_time``)."""
    return StageTime(k.n_dense * dense.compute + k.n_moe * moe.compute + k.head + fixed_time(c, sw) + t_params,
                     k.n_dense * dense.rc + k.n_moe * moe.rc, k.layers * tp_x, k.layers * cp_x, k.n_moe * moe.a2a_x,
                     t_params)


def fixed_time(c: Candidates, sw: Software) -> Any:
    """The software's fixed dispatch cost of a micro-batch on a stage: one per chunk pass (ve of them)."""
    return c.ve * sw.microbatch_overhead_s


def param_pass_time(c: Candidates, s: StageParams, sw: Software, hbm: float, shard: Any,
                    shard_experts: Any = 1) -> Any:
    """HBM time per micro-batch of the software's passes over the critical stage's parameters outside the layers'
    kernels: ``sw.microbatch_grad_bytes`` per parameter the rank holds unsharded in the micro-batch (the stage's, split
    over TP; a MoE's experts over EP), ``sw.microbatch_shard_bytes`` per parameter of its ZeRO shard (over ``shard``
    ranks, experts over ``shard_experts``: ``dp.n_shard``, ``dp.n_shard_experts``; all of them under ZeRO-0).
    FSDP1's gradient cast, divides and accumulation and its low-precision shard copies (catalog/software.toml,
    llm-foundry), memory-bound: bytes over the GPU's HBM bandwidth, on the critical path."""
    full = s.crit + s.e_crit
    zero = c.zero >= 1
    sharded = s.crit / np.where(zero, shard, 1) + s.e_crit / np.where(zero, shard_experts, 1)
    return (sw.microbatch_grad_bytes * full + sw.microbatch_shard_bytes * sharded) / hbm


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
    # the next stage lies past the smallest block holding whole TP x CP groups and whole EP groups (moe.py)
    bw_pp, lat_pp = comms.link(topo, c.pp, np.lcm(c.tp * c.cp, c.ep) * c.pp, collective=False)
    t_p2p = comms.p2p_time(p2p_bytes(m, c), bw_pp, lat_pp)
    hops, steady = p2p_sends(c)
    return np.where(c.pp > 1, (hops + (1 - eff.p2p_overlap) * steady) * t_p2p, 0.0)


def p2p_bytes(m: ModelSpec, c: Candidates) -> Any:
    """One pipeline send: a micro-batch's activations at a chunk boundary, sharded over TP."""
    return layer_bytes(m, c) / c.tp


def p2p_sends(c: Candidates) -> tuple[Any, Any]:
    """(exposed, overlappable) sends on the critical path of a step: the pp x v - 1 chunk boundaries a micro-batch
    crosses to fill the pipeline and as many to drain it; a send forward and one backward per micro-batch and chunk
    in the steady state."""
    return 2 * (c.pp * c.ve - 1), 2 * c.micro * c.ve


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
    fp8_first: Any = 0.0  # of ``first`` ... ``e_last``, the GEMM weights kept in FP8 (software fp8_weights), per rank
    fp8_mid: Any = 0.0
    fp8_last: Any = 0.0
    e_fp8_share: float = 0.0  # the share of the routed experts' parameters that are FP8 GEMM weights

    @property
    def gather_bytes(self) -> Any:
        """The bytes of the most any stage's ZeRO weight all-gather moves per rank: 2 a weight (bf16), 1 an FP8 one
        (NeMo's distributed Adam all-gathers Transformer Engine's FP8 weights as uint8: nemo/core/optim/
        distributed_adam.py MegatronDistributedFusedAdam.init_params, param_sync_dtype=torch.uint8)."""
        def g(p: Any, f: Any) -> Any:
            return memory.WEIGHT_BYTES * p - (memory.WEIGHT_BYTES - 1) * f

        first, mid, last = g(self.first, self.fp8_first), g(self.mid, self.fp8_mid), g(self.last, self.fp8_last)
        return np.where(self.pp > 1, np.maximum(mid, np.maximum(first, last)), first)

    @property
    def e_gather_bytes(self) -> Any:
        """As ``gather_bytes``, the routed experts' all-gather (``e_crit``'s parameters)."""
        return (memory.WEIGHT_BYTES - (memory.WEIGHT_BYTES - 1) * self.e_fp8_share) * self.e_crit

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
    embedding (and one for MTP). DualPipe holds every stage's parameters twice (DeepSeek-V3 Table 2: "Parameter
    2x"): rank r those of stages r and pp - 1 - r, the end ranks the first and the last stage with the embedding
    and head together (Sec. 2.2), which the MTP module shares there without a copy."""
    place, pp, tp, ep = c.place, c.pp, c.tp, c.ep
    emb, mtp_x = embedding_params(m), m.mtp_layers * mtp_block_extra(m) if m.mtp_layers else 0
    head = head_params(m) + mtp_x  # the MTP modules' norms and projections sit with the head
    tied_copy = emb if (m.tied_embeddings or m.mtp_layers) else 0  # a tied head's, or MTP's, copy of the embedding
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
    if sw.fp8_weights:
        s = with_fp8_weights(m, c, d, s)
    if sw.pipeline == "dualpipe":  # rank r holds stages r and pp - 1 - r: the end ranks the first and the last
        def two(a: Any, b: Any) -> Any:
            return np.where(pp > 1, a + b, a)

        ends, e_ends = two(s.first, s.last), two(s.e_first, s.e_last)
        if m.mtp_layers:  # the MTP's embedding is the first stage's, on the same rank (Sec. 2.2)
            ends = ends - np.where(pp > 1, emb / tp, 0.0) * (not m.tied_embeddings)
        f_ends = two(s.fp8_first, s.fp8_last)
        s = StageParams(m.is_moe, pp, ends, two(s.mid, s.mid), ends, e_ends, two(s.e_mid, s.e_mid), e_ends,
                        f_ends, two(s.fp8_mid, s.fp8_mid), f_ends, s.e_fp8_share)
    return s


def gemm_weights(tensors: list[tuple[str, tuple[int, ...]]]) -> int:
    """The parameters of a list of tensors that Transformer Engine's linears hold: two-dimensional weights (no norm
    gains, no biases) other than a MoE's router and shared-expert gate (Megatron-Core runs those as plain bf16
    GEMMs), and the routed experts stacked [E, out, in] (TE's grouped linears)."""
    return numel([t for t in tensors if len(t[1]) >= 2 and "router" not in t[0] and "shared_gate" not in t[0]])


def with_fp8_weights(m: ModelSpec, c: Candidates, d: DenseLayers, s: StageParams) -> StageParams:
    """``s`` with each stage's decoder-layer GEMM weights (split over TP, a MoE's routed experts over EP) counted as
    kept in FP8 (Transformer Engine's fp8_model_init, NeMo's fp8_params); the embedding, the output head and the
    norms stay bf16 (TE builds only its Linear / LayerNormLinear / LayerNormMLP weights as Float8Tensor)."""
    place, tp = c.place, c.tp
    if not m.is_moe:
        lin = gemm_weights(layer_tensors(m, 0))
        return replace(s, fp8_first=place["first"] * lin / tp, fp8_mid=place["max"] * lin / tp,
                       fp8_last=place["last"] * lin / tp)
    last = m.n_layers - 1
    lin_d = gemm_weights(layer_tensors(m, 0)) if m.first_dense_layers else 0
    experts = expert_tensors(m, last)
    lin_m = gemm_weights(layer_tensors(m, last)) - gemm_weights(experts)
    n1 = np.where(c.pp > 2, place["max"], place["last"])
    return replace(s, fp8_first=(d.first * lin_d + (place["first"] - d.first) * lin_m) / tp,
                   fp8_mid=(d.second * lin_d + (n1 - d.second) * lin_m) / tp,
                   fp8_last=(d.last * lin_d + (place["last"] - d.last) * lin_m) / tp,
                   e_fp8_share=gemm_weights(experts) / max(numel(experts), 1))


def moe_layer_params(m: ModelSpec) -> tuple[int, int, int]:
    """(a leading dense layer, a MoE layer's routed experts, the rest of a MoE layer) in parameters."""
    lp_e = numel(expert_tensors(m, m.n_layers - 1))
    return (layer_params(m, 0) if m.first_dense_layers else 0), lp_e, layer_params(m, m.n_layers - 1) - lp_e

