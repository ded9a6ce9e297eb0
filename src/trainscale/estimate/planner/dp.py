"""Data parallelism and ZeRO over the cp x dp replicas (CP ranks hold the same weights): the gradient reduction
and weight gathers of the critical stage, what of them the compute hides, and the optimizer step.

ZeRO stages (Rajbhandari et al. 2020, arXiv 1910.02054 Sec. 5; ``specs.Layout.zero``): 0 all-reduces the
gradients once per step; 1 reduce-scatters them once and all-gathers the updated weights; 2 reduce-scatters per
micro-batch; 3 also gathers the weights for each micro-batch's forward and again for its backward (FSDP
reshard_after_forward). With hybrid sharding (hsdp) the shards' gradients are also all-reduced over the replicas.

A MoE's routed experts are whole on each of the ep ranks that split them, which are any of a stage's tp x cp x dp
ranks (``rules.ep_divides``): their gradients are reduced, and their ZeRO state sharded, over the expert-data-parallel
group of the tp x cp x dp / ep ranks holding the same experts (Megatron-Core parallel_state.py:
expert_data_parallel_size = world / (expert TP x EP x PP), expert TP 1 here; its distributed optimizer shards expert
state over that group, in hsdp instances). The TP ranks are in it: each ran its own tokens/tp through the experts.
This runtime shards expert state over dp_shard x cp only and sums the TP ranks' expert gradients apart
(runtime/parallel/parallelize.py sum_moe_gradients_over_tp): the same bytes reduced, more held when tp > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainscale.estimate import comms, memory
from trainscale.estimate.planner.candidates import Candidates
from trainscale.estimate.planner.efficiencies import Efficiencies
from trainscale.estimate.planner.layer import LayerTime
from trainscale.estimate.planner.software import Software
from trainscale.estimate.planner.stages import Critical, StageParams


def n_shard(c: Candidates) -> Any:
    """The ranks one ZeRO shard group spans: cp x dp over the hsdp replica groups."""
    return c.cp * c.dp // c.hsdp


def n_expert_dp(c: Candidates) -> Any:
    """The expert-data-parallel group: the tp x cp x dp / ep ranks holding the same experts (Megatron-Core's
    expert_data_parallel_size with expert TP 1)."""
    return np.maximum(c.tp * c.cp * c.dp // c.ep, 1)


def n_shard_experts(c: Candidates) -> Any:
    """The ranks one EP rank's experts' ZeRO state is sharded over: the expert-data-parallel group over the hsdp
    replica groups (Megatron-Core: expert_data_parallel_size / num_distributed_optimizer_instances)."""
    return np.maximum(n_expert_dp(c) // c.hsdp, 1)


@dataclass(frozen=True)
class Collectives:
    """One step's DP collectives of the critical stage, each unhidden: reduce-scatter of the gradients,
    all-gather of the weights, all-reduce over the hsdp replicas, all-reduce of the whole gradients (ZeRO 0)."""

    rs: Any
    ag: Any
    ar_rep: Any
    ar: Any


def collectives(c: Candidates, topo: comms.Topology, sw: Software, s: StageParams) -> Collectives:
    tp, cp, dp, hsdp, world = c.tp, c.cp, c.dp, c.hsdp, c.world
    ns = n_shard(c)
    extent_dp = np.where(dp > 1, world, tp * cp)
    extent_shard = np.where(dp // hsdp > 1, tp * cp * c.pp * (dp // hsdp), tp * cp)
    bw_s, lat_s = comms.link(topo, ns, extent_shard)
    bw_r, lat_r = comms.link(topo, hsdp, world)
    bw_d, lat_d = comms.link(topo, cp * dp, extent_dp)
    p_crit = s.crit
    gb, wb = sw.grad_reduce_bytes * p_crit, memory.WEIGHT_BYTES * p_crit
    rs = comms.reduce_scatter_time(gb, ns, bw_s, lat_s)
    ag = comms.all_gather_time(wb, ns, bw_s, lat_s)
    ar_rep = comms.all_reduce_time(gb / ns, hsdp, bw_r, lat_r)
    ar = comms.all_reduce_time(gb, cp * dp, bw_d, lat_d)
    if not s.moe:
        return Collectives(rs, ag, ar_rep, ar)
    e_crit, ns_e, dp_e = s.e_crit, n_shard_experts(c), n_expert_dp(c)
    gb_e, wb_e = sw.grad_reduce_bytes * e_crit, memory.WEIGHT_BYTES * e_crit
    # the expert-DP ranks sit ep apart (EP ranks are neighbours, moe.py) over the stage's ranks, which pp interleaves
    bw_se, lat_se = comms.link(topo, ns_e, np.where(ns_e > 1, world // hsdp, 1))
    bw_de, lat_de = comms.link(topo, dp_e, np.where(dp_e > 1, world, 1))
    return Collectives(rs + comms.reduce_scatter_time(gb_e, ns_e, bw_se, lat_se),
                       ag + comms.all_gather_time(wb_e, ns_e, bw_se, lat_se),
                       ar_rep + comms.all_reduce_time(gb_e / ns_e, hsdp, bw_r, lat_r),
                       ar + comms.all_reduce_time(gb_e, dp_e, bw_de, lat_de))


def dp_exposed(c: Candidates, k: Critical, dense: LayerTime, moe: LayerTime, st_rc: Any, sw: Software,
               col: Collectives) -> tuple[Any, Any]:
    """(exposed, total) DP traffic of a step. A collective overlaps (sw.dp_overlap of) the compute it follows: the
    weight gathers the critical stage's forward, the gradient reductions its backward and recomputation; one that
    runs once per step also leaves one layer's bucket exposed (the first gather before any compute, the last
    reduce after all of it). ZeRO-3's backward gather and reduce-scatter share the same links at once. ZeRO-2's
    per-micro-batch reduce-scatter hides under ``zero2_window``."""
    win_f = k.n_dense * dense.fwd + k.n_moe * moe.fwd
    win_b = k.n_dense * dense.bwd + k.n_moe * moe.bwd + st_rc
    win_rs2 = zero2_window(c, win_f, win_b)
    ov, n_layers = sw.dp_overlap, k.layers
    zero, micro = c.zero, c.micro
    rs, ag, ar_rep, ar = col.rs, col.ag, col.ar_rep, col.ar

    def hidden(t: Any, window: Any, once: bool = False) -> Any:
        floor = t / np.maximum(n_layers, 1) if once else 0.0
        return np.maximum(floor, t - ov * window)

    exposed = np.select(
        [zero == 0, zero == 1, zero == 2],
        [hidden(ar, win_b, True),
         hidden(rs + ar_rep, win_b, True) + hidden(ag, win_f, True),
         micro * hidden(rs, win_rs2) + rs / np.maximum(n_layers, 1) + hidden(ar_rep, win_b, True)
         + hidden(ag, win_f, True)],
        micro * (hidden(ag, win_f) + hidden(ag + rs, win_b)) + hidden(ar_rep, win_b, True))
    total = np.select([zero == 0, zero == 1, zero == 2], [ar, rs + ag + ar_rep, micro * rs + ag + ar_rep],
                      micro * (2 * ag + rs) + ar_rep)
    return exposed, total


def zero2_window(c: Candidates, win_f: Any, win_b: Any) -> Any:
    """The compute one micro-batch's ZeRO-2 gradient reduce-scatter hides under on the critical stage. FSDP2 issues
    each layer group's reduce-scatter on its own stream and the compute stream waits for it only when the next
    group's reduce-scatter is issued (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward:
    ``current_stream().wait_event(comm_ctx.reduce_scatter_state.event)``) or at the step's last backward
    (_fsdp_state.py ``_root_post_backward_final_callback``, ``is_last_backward``): one reduce-scatter in flight,
    each overlapping the compute until the next backward chunk is done. Without a pipeline that is the
    micro-batch's own backward (its last group also reaches into the next forward: ignored). Under a pipeline
    schedule's steady 1F1B phase (Narayanan et al. 2021, arXiv 2104.04473 Fig. 4) a forward runs between two
    backward chunks on the stage, so each micro-batch's reduce-scatter overlaps one forward and one backward of
    the stage's layers; the last one of the step is exposed (``dp_exposed``'s once-per-step floor)."""
    return np.where(c.pp > 1, win_f + win_b, win_b)


def optimizer_time(c: Candidates, s: StageParams, eff: Efficiencies, sw: Software, hbm: float) -> Any:
    """Adam is memory-bound on this rank's shard of the state; fp32 grads are read at 4 bytes; a state of other than
    12 bytes per parameter (sw.optimizer_state_bytes) is read and written at its own size."""
    p_shard = s.crit / np.where(c.zero >= 1, n_shard(c), 1)
    if s.moe:
        p_shard = p_shard + s.e_crit / np.where(c.zero >= 1, n_shard_experts(c), 1)
    return (eff.optimizer_bytes_per_param + sw.grad_bytes - memory.GRAD_BYTES
            + 2 * (sw.optimizer_state_bytes - memory.ADAM_BYTES)) * p_shard / hbm
