"""A mixture-of-experts layer on one GPU, per micro-batch, for every candidate layout at once: the router, the
shared expert, this rank's routed experts, the token permutes, and the dispatch/combine all-to-all over the
expert-parallel group.

Per MoE layer (``m.is_moe``): the router GEMM, the shared expert (TP-split like a dense FFN) and the routed experts
of this rank (n_experts / ep of them, whole: not TP-split), which compute the tokens/tp of this rank's sequence
shard times top-k times the load imbalance (the busiest EP rank sets the pace); the dispatch and combine
all-to-all (``comms.all_to_all_time``, 2 forward + 2 backward) over the EP group.

The EP group is ep of a pipeline stage's tp x cp x dp ranks (``rules.ep_divides``), neighbouring ones: Megatron-Core
orders its expert rank grid tp-cp-ep-dp-pp with expert TP 1 (megatron/core/parallel_state.py
initialize_model_parallel, RankGenerator over (etp, ep, edp, pp)), so an EP group is ep consecutive ranks, inside one
scale-up domain first, and DeepSeek-V3's EP64 spans 8 nodes of 8 (arXiv 2412.19437 Sec. 3.2). This runtime places
its EP ranks among the data-parallel ones, tp x cp apart (``placement.mesh_sizes``): the same ranks when tp x cp = 1.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from trainscale.estimate import comms
from trainscale.estimate.planner.candidates import Candidates
from trainscale.estimate.planner.efficiencies import Efficiencies
from trainscale.estimate.planner.layer import (
    ACT_BYTES,
    Gemms,
    LayerTime,
    Rates,
    ffn_gemm_shapes,
    gemm_train_time,
    hidden_tokens,
    recompute_time,
    up_projections,
)
from trainscale.estimate.planner.software import Software
from trainscale.specs import ModelSpec

FP8_BYTES = 1  # an FP8 (e4m3) activation: DeepSeek-V3 (arXiv 2412.19437) Sec. 3.3.4 dispatches tokens in FP8
PERMUTE_PASSES = 4  # a MoE layer's token permute and unpermute/combine: a gather each, one read + one write of the
#                     routed rows (Megatron-Core moe_utils.permute / unpermute), forward


def imbalance(m: ModelSpec, eff: Efficiencies) -> float:
    """The busiest EP rank's routed tokens over the mean: the model's capacity factor, else the planner's."""
    return m.capacity_factor if m.capacity_factor > 0 else eff.moe_imbalance


def routed_rows(m: ModelSpec, c: Candidates, eff: Efficiencies) -> Any:
    """Routed token copies on the busiest EP rank: each TP rank routes its own sequence shard (tokens / tp); the
    experts are whole on every TP rank."""
    return c.tokens / c.tp * m.experts_per_token * imbalance(m, eff)


def act_elements(m: ModelSpec, c: Candidates, eff: Efficiencies) -> Any:
    """Token rows x width through a MoE layer's MLP activation on one rank: the shared expert's (TP-split) and the
    routed experts'."""
    return c.tokens * m.d_ff_shared / c.tp + routed_rows(m, c, eff) * m.expert_width


def moe_gemms(m: ModelSpec, c: Candidates, r: Rates, eff: Efficiencies, g: Gemms) -> tuple[Any, Any]:
    """(forward, backward) of a MoE layer's GEMMs: the attention projections (``g``), the router (bf16, as
    DeepSeek-V3 keeps the gating), the shared expert (TP-split), and the routed experts as one grouped GEMM of
    n_local experts, each a GEMM of its rows (tile/wave quantization per expert), one launch."""
    tok_moe = c.tokens / c.tp
    n_local = m.n_experts / c.ep  # experts per EP rank
    rows_e = routed_rows(m, c, eff) / n_local
    rf, rb = gemm_train_time(tok_moe, m.d_model, m.n_experts, r.f_mm, r.hbm, r.sms, r.gap)
    t_f, t_b = g.att_f + rf, g.att_b + rb
    if m.d_ff_shared:
        for k_in, n_out in ffn_gemm_shapes(m, c.tp, m.d_ff_shared).values():
            f, b = gemm_train_time(c.tokens, k_in, n_out, r.f_lay, r.hbm, r.sms, r.gap)
            t_f, t_b = t_f + f, t_b + b
    for k_in, n_out in ffn_gemm_shapes(m, 1, m.expert_width).values():
        f, b = gemm_train_time(rows_e, k_in, n_out, r.f_lay, r.hbm, r.sms, 0.0)
        t_f, t_b = t_f + n_local * f + r.gap, t_b + n_local * b + 2 * r.gap
    return t_f, t_b


def ep_local(c: Candidates, domain: int) -> Any:
    """EP ranks inside one scale-up domain of ``domain`` GPUs: ep neighbouring ranks, aligned to multiples of ep,
    share gcd(ep, domain) GPUs with each domain they touch (all ep when ep divides it, the domain when it divides
    ep)."""
    return np.gcd(c.ep, domain)


def ep_span(c: Candidates) -> Any:
    """The ranks an EP group spans: ep neighbouring ranks (the placement above)."""
    return c.ep


def a2a_bytes(m: ModelSpec, c: Candidates, eff: Efficiencies, sw: Software) -> tuple[Any, Any]:
    """(dispatch, combine) bytes one all-to-all sends from the busiest rank: its tokens/tp x top-k copies x d_model
    x imbalance, FP8 dispatch under fp8 (DeepSeek-V3 Sec. 3.3.4), bf16 combine."""
    copy = c.tokens / c.tp * m.experts_per_token * m.d_model * imbalance(m, eff)
    return copy * (FP8_BYTES if sw.precision == "fp8" else ACT_BYTES), copy * ACT_BYTES


def all_to_all(m: ModelSpec, c: Candidates, topo: comms.Topology, eff: Efficiencies, sw: Software) -> Any:
    """A MoE layer's dispatch (FP8 under fp8, DeepSeek-V3 Sec. 3.3.4) and combine (bf16) forward, their transposes
    backward, the dispatch and combine again under full recompute; the busiest rank receives imbalance x the mean.
    EP ranks are neighbours (``ep_local``): those inside the scale-up domain talk over it, the rest over the network.
    Each rank dispatches its own tokens/tp (sequence parallelism: Megatron-Core requires it for MoE with TP)."""
    k_top = m.experts_per_token
    n_local = ep_local(c, topo.scale_up_domain)
    nodes = c.ep / n_local
    off = (c.ep - n_local) / np.maximum(c.ep, 1)  # share of a token's k copies bound off the node
    if sw.moe_node_limit:
        # node-limited routing: at most M target nodes per token, one copy each over the network, forwarded
        # inside the node on NVLink (DeepSeek-V3 Sec. 2.1.2, 3.2.2); as a share of the k copies
        off = np.minimum(off, np.minimum(sw.moe_node_limit, nodes) * (nodes - 1) / np.maximum(nodes, 1) / k_top)
    disp_bytes, comb_bytes = a2a_bytes(m, c, eff, sw)
    disp = comms.all_to_all_time(disp_bytes, c.ep, n_local, topo, off)
    comb = comms.all_to_all_time(comb_bytes, c.ep, n_local, topo, off)
    a2a_f, a2a_b = disp + comb, disp + comb
    return a2a_f + a2a_b + c.full * a2a_f


def moe_layer(m: ModelSpec, c: Candidates, r: Rates, topo: comms.Topology, eff: Efficiencies, sw: Software,
              g: Gemms, dense: LayerTime, knobs: Any) -> LayerTime:
    """One MoE layer: its GEMMs (``moe_gemms``), the attention core of ``dense``, the element-wise work with the
    permutes, its recomputation (``knobs``: the MLA/norm knobs of ``layer.recompute_knobs``, plus a MoE SwiGLU's
    output recomputed from its inputs, the forward activation pass, under sw.recompute_swiglu_output), and the
    all-to-all the layer's compute does not hide (sw.a2a_overlap of it at most)."""
    mm_f, mm_b = moe_gemms(m, c, r, eff, g)
    ups, rows, act = up_projections(m), routed_rows(m, c, eff), act_elements(m, c, eff)
    ew_f = ACT_BYTES * (sw.elementwise_passes * hidden_tokens(c) * m.d_model + sw.mlp_act_passes * act * ups / 2
                        + PERMUTE_PASSES * rows * m.d_model) / r.hbm
    lay = LayerTime(mm_f, mm_b, dense.attn, dense.attn_f, ew_f, 3 * ew_f, g.att_sel)
    if sw.recompute_swiglu_output:
        knobs = knobs + ACT_BYTES * sw.mlp_act_passes * act * ups / 2 / r.hbm
    a2a = all_to_all(m, c, topo, eff, sw)
    return replace(lay, rc=recompute_time(c, lay, sw, np.where(c.full, 0.0, knobs)), a2a=a2a,
                   a2a_x=np.maximum(a2a - sw.a2a_overlap * lay.compute, 0.0))
