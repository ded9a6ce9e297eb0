"""Step time and memory of a parallel layout: compute, communication, pipeline bubble, optimizer.

``evaluate`` takes numpy arrays (one entry per layout) so that the planner scores a whole search
space in one pass; one layout is the same call with arrays of length one. The model, with
Korthikanti et al. 2022 (arXiv 2205.05198) symbols where they apply:

  step = m · t_stage · (1 + bubble) + exposed pipeline p2p + exposed DP/ZeRO traffic + optimizer
  t_stage = layers on the slowest stage x (compute + recompute + exposed TP + exposed CP) [+ head]

Compute runs each GEMM at min(achievable FLOP/s, arithmetic intensity x HBM bandwidth) (roofline)
and the attention core (FlashAttention, causal) at its own achievable fraction of peak.

``evaluate`` composes the parts, each its own module of estimate/planner/: ``candidates`` (the layouts as arrays
and the named codes of their choices), ``efficiencies`` (the planner's constants), ``layer`` (one decoder layer:
GEMMs, attention, element-wise work, TP/CP traffic, recomputation, the head), ``moe`` (experts and their
all-to-all), ``stages`` (the critical stage, the pipeline, parameters per stage), ``dp`` (DP/ZeRO traffic and the
optimizer), ``stage_memory`` (memory on every stage); utilisation is here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.estimate import comms, flops
from trainscale.estimate.flops import matmul_params
from trainscale.estimate.planner import dp, layer, moe, stage_memory, stages
from trainscale.estimate.planner.candidates import RECOMPUTE, SELECTIVE, Candidates, candidates, per_mode
from trainscale.estimate.planner.efficiencies import Efficiencies
from trainscale.estimate.planner.layer import LayerTime, ffn_gemm_shapes, full_gemm_shapes
from trainscale.estimate.planner.software import Software, load_software
from trainscale.specs import GPUSpec, ModelSpec


def layer_times(m: ModelSpec, c: Candidates, r: layer.Rates, topo: comms.Topology, eff: Efficiencies,
                sw: Software, seq: int) -> tuple[LayerTime, LayerTime, Any, Any]:
    """(a dense layer, a MoE layer (none for a dense model), the exposed TP and CP traffic of either), each with
    its recomputation."""
    g = layer.dense_gemms(m, c, r, sw)
    dense = layer.dense_layer(m, c, r, eff, sw, seq, g)
    tp_x, cp_x = layer.tp_cp_exposed(m, c, topo, eff, sw, seq, r)
    if not (m.is_moe or m.attention == "mla"):
        return replace(dense, rc=layer.recompute_time(c, dense, sw)), layer.NO_LAYER, tp_x, cp_x
    knobs = layer.recompute_knobs(m, c, r, sw, g)
    dense_rc = layer.recompute_time(c, dense, sw, np.where(c.full, 0.0, knobs))
    moe_lay = moe.moe_layer(m, c, r, topo, eff, sw, g, dense, knobs) if m.is_moe else layer.NO_LAYER
    return replace(dense, rc=dense_rc), moe_lay, tp_x, cp_x


def recompute_flops_per_token(m: ModelSpec, c: Candidates, sw: Software, seq: int) -> Any:
    """FLOPs per token the recomputation adds (HFU's numerator over MFU's): the mode's forward again
    (``flops.recompute_flops_per_token``, causal halving; selective's attention core not where
    sw.recompute_attention_core is false), the GEMMs selective recompute redoes, the MLA up-projections under
    sw.recompute_mla_up; 2 FLOPs per weight per token, every layer; full recompute with early stop
    (sw.recompute_early_stop) skips each dense layer's w2."""
    n_mm, L = matmul_params(m), m.n_layers
    rpt = per_mode(lambda mode: np.full(c.rc.shape, flops.recompute_flops_per_token(m, n_mm, seq, mode, causal=True)),
                   c.rc, RECOMPUTE)
    sel_params = sum(int(np.prod(sh)) for name, sh in full_gemm_shapes(m).items() if name in sw.selective_gemms)
    rpt = rpt + np.where(c.rc == SELECTIVE, 2.0 * sel_params * L, 0.0)
    if not sw.recompute_attention_core:  # the selective mode's attention core saved, not redone
        rpt = rpt - np.where(c.rc == SELECTIVE, flops.recompute_flops_per_token(m, n_mm, seq, "selective", True), 0.0)
    if sw.recompute_early_stop:
        w2 = int(np.prod(ffn_gemm_shapes(m, 1)["w2"]))
        rpt = rpt - np.where(c.full, 2.0 * w2 * (L - m.n_moe_layers), 0.0)
    if (m.is_moe or m.attention == "mla") and sw.recompute_mla_up:
        up_params = sum(int(np.prod(sh)) for name, sh in full_gemm_shapes(m).items() if name in ("wq_b", "wkv_b"))
        rpt = rpt + np.where(c.full, 0.0, 2.0 * up_params * L)
    return rpt


def utilisation(m: ModelSpec, c: Candidates, sw: Software, seq: int, global_seqs: int, step: Any,
                peak: float) -> dict[str, Any]:
    """Tokens/s, and MFU under the one FLOP convention (``flops.FLOP_CONVENTION``: 6N + 12·L·H·Q·T attention
    halved for causal masking); HFU adds the recomputed FLOPs."""
    fpt = flops.training_flops_per_token(m, seq)
    tps = float(global_seqs) * seq / step
    mfu = flops.mfu(tps, fpt, c.world, peak)
    hfu = flops.hfu(tps, fpt, recompute_flops_per_token(m, c, sw, seq), c.world, peak)
    return {"tokens_per_s": tps, "mfu": mfu, "hfu": hfu, "tflops_per_gpu": mfu * peak / 1e12,
            "hw_tflops_per_gpu": hfu * peak / 1e12}


def memory_capacity(gpu: GPUSpec, eff: Efficiencies) -> float:
    """Bytes a layout may use per GPU: what the driver reports (``GPUSpec.capacity_bytes``: torch sees 79.2 GiB of
    an "80 GB" H100) less the planner's reserve (CUDA context, NCCL buffers: catalog/planner.toml)."""
    return gpu.capacity_bytes - eff.memory_reserve_bytes


@dataclass(frozen=True)
class StepParts:
    """What ``evaluate`` composes a step from, arrays over the layouts: the candidates and rates, one dense and one
    MoE layer (with their recomputation), the exposed TP and CP traffic per layer, the output head, the critical
    stage and its time per micro-batch, the pipeline, the exposed point-to-point and DP traffic (each DP collective
    apart, ``dp.dp_parts``) and the optimizer. ``breakdown`` reads a step's kernels from it."""

    c: Candidates
    r: layer.Rates
    dense: LayerTime
    moe: LayerTime
    tp_x: Any
    cp_x: Any
    t_head: Any
    d: stages.DenseLayers
    k: stages.Critical
    st: stages.StageTime
    t_pipe: Any
    p2p_x: Any
    params: stages.StageParams
    dp_parts: dict[str, dp.DPPart]
    dp_x: Any
    dp_traffic: Any
    t_opt: Any

    @property
    def step(self) -> Any:
        """m · t_stage · (1 + bubble) + exposed pipeline p2p + exposed DP/ZeRO traffic + optimizer."""
        return self.t_pipe + self.p2p_x + self.dp_x + self.t_opt


def step_parts(m: ModelSpec, gpu: GPUSpec, topo: comms.Topology, eff: Efficiencies, seq: int, global_seqs: int,
               cfg: dict[str, Any], sw: Software | None = None) -> StepParts:
    """The parts of every layout's step (``StepParts``), as ``evaluate`` adds them up."""
    sw = load_software(sw)
    if sw.precision == "fp8" and not gpu.peak_fp8_flops:
        raise TrainscaleError(f"{gpu.name} has no FP8 tensor cores (catalog/gpus.toml gives it no FP8 peak), so FP8 "
                              "training cannot be planned on it; use --precision bf16")
    c = candidates(m, cfg, seq, global_seqs)
    r = layer.rates(gpu, eff, sw)
    dense, moe_lay, tp_x, cp_x = layer_times(m, c, r, topo, eff, sw, seq)
    t_head = layer.head_time(m, c, r)
    d = stages.dense_layers(m, c)
    k = stages.critical_stage(m, c, d, stages.exposed_layer_time(dense, tp_x, cp_x),
                              stages.exposed_layer_time(moe_lay, tp_x, cp_x), t_head, sw.pipeline == "dualpipe")
    params = stages.stage_params(m, c, d, sw)
    t_params = stages.param_pass_time(c, params, sw, r.hbm, dp.n_shard(c), dp.n_shard_experts(c))
    st = stages.stage_time(c, k, dense, moe_lay, tp_x, cp_x, sw, t_params)
    t_pipe = stages.pipeline_step(c, st.total, sw)
    p2p_x = stages.p2p_exposed(m, c, topo, eff)
    parts = dp.dp_parts(c, k, dense, moe_lay, st.rc, sw, dp.collectives(c, topo, sw, params))
    dp_x, dp_traffic = dp.dp_sum(parts)
    return StepParts(c, r, dense, moe_lay, tp_x, cp_x, t_head, d, k, st, t_pipe, p2p_x, params, parts, dp_x,
                     dp_traffic, dp.optimizer_time(c, params, eff, sw, r.hbm))


def evaluate(m: ModelSpec, gpu: GPUSpec, topo: comms.Topology, eff: Efficiencies, seq: int, global_seqs: int,
             cfg: dict[str, Any], sw: Software | None = None) -> dict[str, np.ndarray]:
    """Step time, memory and utilization of every layout in ``cfg`` (arrays: tp cp pp dp mb v schedule
    recompute zero hsdp sp, and ep for a MoE; schedule and recompute as indices into SCHEDULE and RECOMPUTE) under
    software ``sw``. A MoE adds its experts and their all-to-all per MoE layer (``moe``); expert weights and their
    state split over EP and then over the ranks that share them (ZeRO over dp / (hsdp x ep) x cp, ``dp``)."""
    sw = load_software(sw)
    sp = step_parts(m, gpu, topo, eff, seq, global_seqs, cfg, sw)
    c, r, dense, moe_lay, d, k, st, params = sp.c, sp.r, sp.dense, sp.moe, sp.d, sp.k, sp.st, sp.params
    t_pipe, p2p_x, dp_x, dp_traffic, t_opt, step = sp.t_pipe, sp.p2p_x, sp.dp_x, sp.dp_traffic, sp.t_opt, sp.step
    lm = stage_memory.layer_activations(m, c, eff, sw, seq)
    heavy, first_total, heaviest_stage = stage_memory.heaviest(m, c, sw, lm, stage_memory.buffers(m, c, sw, seq),
                                                               d, params)
    capacity = memory_capacity(gpu, eff)
    micro, n_moe = c.micro, k.n_moe
    return {
        "world": c.world, "micro_batches": micro, "layers_first_stage": c.place["first"],
        "layers_max_stage": c.place["max"], "balanced_ends": c.place["balanced"] & (c.pp > 1),
        "bubble_fraction": stages.bubble(c, sw),
        "step_time_s": step, "t_compute": micro * st.compute, "t_recompute": micro * st.rc,
        "t_tp_comm": micro * st.tp, "t_cp_comm": micro * st.cp, "t_bubble": t_pipe - micro * st.total,
        "t_pp_p2p": p2p_x, "t_dp_comm": dp_x, "t_optimizer": t_opt, "dp_traffic_s": dp_traffic,
        "t_ep_comm": micro * st.a2a, "a2a_per_layer_s": moe_lay.a2a + np.zeros(c.tp.shape),
        "ep_in_scale_up": (comms.in_scale_up(topo, moe.ep_span(c)) | (c.ep == 1)),
        "t_gemm": micro * k.n_dense * (dense.mm_f + dense.mm_b) + micro * n_moe * (moe_lay.mm_f + moe_lay.mm_b),
        "t_attention": micro * k.layers * dense.attn,
        "t_elementwise": micro * k.n_dense * dense.ew + micro * n_moe * moe_lay.ew,
        "tp_in_scale_up": comms.in_scale_up(topo, c.tp) | (c.tp == 1),
        "mem_weights": heavy["w"], "mem_gradients": heavy["g"], "mem_optimizer": heavy["o"],
        "mem_activations": heavy["a"], "mem_buffers": heavy["b"], "mem_total": heavy["t"],
        "mem_first_stage": first_total, "heaviest_stage": heaviest_stage,
        "fits": heavy["t"] <= capacity, "headroom": capacity - heavy["t"],
        **utilisation(m, c, sw, seq, global_seqs, step, r.peak), "params_per_gpu": params.crit + params.e_crit,
    }

