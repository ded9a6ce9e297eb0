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
    all-gather of the weights, all-reduce over the hsdp replicas, all-reduce of the whole gradients (ZeRO 0); and
    the bytes one call of each moves on this rank (its input: ``comms``' ring formulas take them so)."""

    rs: Any
    ag: Any
    ar_rep: Any
    ar: Any
    rs_bytes: Any = 0.0
    ag_bytes: Any = 0.0
    ar_rep_bytes: Any = 0.0
    ar_bytes: Any = 0.0


def collectives(c: Candidates, topo: comms.Topology, sw: Software, s: StageParams) -> Collectives:
    tp, cp, dp, hsdp, world = c.tp, c.cp, c.dp, c.hsdp, c.world
    ns = n_shard(c)
    extent_dp = np.where(dp > 1, world, tp * cp)
    extent_shard = np.where(dp // hsdp > 1, tp * cp * c.pp * (dp // hsdp), tp * cp)
    bw_s, lat_s = comms.link(topo, ns, extent_shard)
    bw_r, lat_r = comms.link(topo, hsdp, world)
    bw_d, lat_d = comms.link(topo, cp * dp, extent_dp)
    p_crit = s.crit
    gb, wb = sw.grad_reduce_bytes * p_crit, s.gather_bytes
    rs = comms.reduce_scatter_time(gb, ns, bw_s, lat_s)
    ag = comms.all_gather_time(wb, ns, bw_s, lat_s)
    ar_rep = comms.all_reduce_time(gb / ns, hsdp, bw_r, lat_r)
    ar = comms.all_reduce_time(gb, cp * dp, bw_d, lat_d)
    if not s.moe:
        return Collectives(rs, ag, ar_rep, ar, gb, wb, gb / ns, gb)
    e_crit, ns_e, dp_e = s.e_crit, n_shard_experts(c), n_expert_dp(c)
    gb_e, wb_e = sw.grad_reduce_bytes * e_crit, s.e_gather_bytes
    # the expert-DP ranks sit ep apart (EP ranks are neighbours, moe.py) over the stage's ranks, which pp interleaves
    bw_se, lat_se = comms.link(topo, ns_e, np.where(ns_e > 1, world // hsdp, 1))
    bw_de, lat_de = comms.link(topo, dp_e, np.where(dp_e > 1, world, 1))
    return Collectives(rs + comms.reduce_scatter_time(gb_e, ns_e, bw_se, lat_se),
                       ag + comms.all_gather_time(wb_e, ns_e, bw_se, lat_se),
                       ar_rep + comms.all_reduce_time(gb_e / ns_e, hsdp, bw_r, lat_r),
                       ar + comms.all_reduce_time(gb_e, dp_e, bw_de, lat_de),
                       gb + gb_e, wb + wb_e, gb / ns + gb_e / ns_e, gb + gb_e)


@dataclass(frozen=True)
class DPPart:
    """One DP collective over a step: the time the compute does not hide, its whole time, how many times it runs
    and the bytes of one call on this rank."""

    exposed: Any
    total: Any
    calls: Any
    bytes: Any


def dp_exposed(c: Candidates, k: Critical, dense: LayerTime, moe: LayerTime, st_rc: Any, sw: Software,
               col: Collectives) -> tuple[Any, Any]:
    """(exposed, total) DP traffic of a step: the sums of ``dp_parts``."""
    return dp_sum(dp_parts(c, k, dense, moe, st_rc, sw, col))


def dp_sum(parts: dict[str, DPPart]) -> tuple[Any, Any]:
    """(exposed, total) of the step's DP collectives."""
    return sum(p.exposed for p in parts.values()), sum(p.total for p in parts.values())


def _share(t: Any, a: Any, b: Any) -> Any:
    """a's part of ``t``, the exposed time of a and b run on the same links at once, in proportion to their times."""
    return np.where(a + b > 0, t * a / np.where(a + b > 0, a + b, 1.0), 0.0)


def dp_parts(c: Candidates, k: Critical, dense: LayerTime, moe: LayerTime, st_rc: Any, sw: Software,
             col: Collectives) -> dict[str, DPPart]:
    """Each DP collective of a step (``rs`` gradient reduce-scatter, ``ag`` weight all-gather, ``ar_rep`` hsdp
    all-reduce over the replicas, ``ar`` ZeRO-0 gradient all-reduce), exposed and whole. A collective overlaps
    (sw.dp_overlap of) the compute it follows: the weight gathers the critical stage's forward, the gradient
    reductions its backward and recomputation; one that runs once per step also leaves one layer's bucket exposed
    (the first gather before any compute, the last reduce after all of it). ZeRO-3's backward gather and
    reduce-scatter share the same links at once, as do ZeRO-1's reduce-scatter and hsdp all-reduce: what of the
    pair stays exposed is split between them in proportion to their times. ZeRO-2's per-micro-batch reduce-scatter
    hides under ``zero2_window``. Under the interleaved schedule a software with sw.dp_chunk_sync reduces (ZeRO 0
    and 1) chunk by chunk (``chunk_reduce``), and one with sw.dp_chunk_gather gathers the ZeRO-1 weights chunk by
    chunk (``chunk_gather``)."""
    win_f = k.n_dense * dense.fwd + k.n_moe * moe.fwd
    win_b = k.n_dense * dense.bwd + k.n_moe * moe.bwd + st_rc
    win_rs2 = zero2_window(c, win_f, win_b)
    ov, n_layers = sw.dp_overlap, k.layers
    zero, micro = c.zero, c.micro
    rs, ag, ar_rep, ar = col.rs, col.ag, col.ar_rep, col.ar

    def exposed(t: Any, window: Any, once: bool = False) -> Any:
        floor = t / np.maximum(n_layers, 1) if once else 0.0
        return np.maximum(floor, t - ov * window)

    z = [zero == 0, zero == 1, zero == 2]
    chunked = c.ve > 1  # the interleaved schedule's virtual chunks (candidates.ve)

    def reduce_once(t: Any) -> Any:
        if sw.dp_chunk_sync == "none":
            return exposed(t, win_b, True)
        return np.where(chunked, chunk_reduce(t, c, ov * win_b, k.layers, sw.dp_chunk_sync), exposed(t, win_b, True))

    rs_rep1 = reduce_once(rs + ar_rep)  # ZeRO-1's reduce-scatter and replica all-reduce together
    agrs3 = exposed(ag + rs, win_b)  # ZeRO-3's backward gather and reduce-scatter together
    ag_once = exposed(ag, win_f, True)
    if sw.dp_chunk_gather:
        ag_once = np.where(chunked & z[1], chunk_gather(ag, c, ov * win_f), ag_once)
    return {
        "ar": DPPart(np.where(z[0], reduce_once(ar), 0.0), np.where(z[0], ar, 0.0), np.where(z[0], 1, 0),
                     col.ar_bytes),
        "rs": DPPart(np.select(z, [0.0, _share(rs_rep1, rs, ar_rep), micro * exposed(rs, win_rs2)
                                   + rs / np.maximum(n_layers, 1)], micro * _share(agrs3, rs, ag)),
                     np.select(z, [0.0, rs, micro * rs], micro * rs), np.select(z, [0, 1, micro], micro),
                     col.rs_bytes),
        "ag": DPPart(np.select(z, [0.0, ag_once, ag_once], micro * (exposed(ag, win_f) + _share(agrs3, ag, rs))),
                     np.select(z, [0.0, ag, ag], 2 * micro * ag), np.select(z, [0, 1, 1], 2 * micro), col.ag_bytes),
        "ar_rep": DPPart(np.select(z[:2], [0.0, _share(rs_rep1, ar_rep, rs)], exposed(ar_rep, win_b, True)),
                         np.where(z[0], 0.0, ar_rep), np.where(z[0] | (c.hsdp <= 1), 0, 1), col.ar_rep_bytes),
    }


def chunk_reduce(t: Any, c: Candidates, win_b: Any, layers: Any, mode: str) -> Any:
    """The exposed part of a step's gradient reduction ``t`` (ZeRO-0 all-reduce, ZeRO-1 reduce-scatter) reduced
    chunk by chunk under the interleaved schedule, ``win_b`` the backward a micro-batch runs on the critical stage
    (what of it may hide the traffic: dp_overlap x the compute). Megatron-Core keeps each virtual chunk's gradients in
    its own buffer and reduces them once that chunk's last micro-batch's backward is done (``mode`` "after": the
    schedule's grad_sync_func) or bucket by bucket during it ("during": DDP's backward hooks). The schedule runs the
    micro-batches in groups of pp per chunk (schedules.py get_schedule_table, microbatch_group_size_per_vp_stage =
    pp), the last group's backward through chunks v-1, ..., 0, so on the first pipeline rank (the last to finish)
    chunk j's gradients are final j x pp chunk-backwards (of win_b / v each) before the stage's last backward. The
    chunks' reductions (t / v each) run one after another on the data-parallel stream, so what is left after the last
    backward is max over j of (j + 1) x t / v - j x D, D = pp x win_b / v: t / v when each chunk's reduction fits in
    D, else t - (v - 1) x D. "during" also lets the first rank's chunk 0, the one chunk Megatron-Core buckets there
    (one bucket per layer here, n = ``layers`` / v of them), start each bucket as its last backward (win_b / v) makes
    it: it leaves max(t / v / n, t / v - (1 - 1 / n) x win_b / v), or what the queue of later chunks leaves,
    max(2 t / v - D, t - (v - 1) x D), if more."""
    v = np.maximum(c.ve, 1)
    t_c, b_c = t / v, win_b / v
    d = c.pp * b_c
    tail = np.maximum(t_c, t - (v - 1) * d)
    if mode == "after":
        return tail
    n_b = np.maximum(layers / v, 1.0)
    first = np.maximum(t_c / n_b, t_c - (1 - 1 / n_b) * b_c)
    return np.maximum(np.maximum(first, 2 * t_c - d), t - (v - 1) * d)


def chunk_gather(t: Any, c: Candidates, win_f: Any) -> Any:
    """The exposed part of a step's ZeRO-1 weight all-gather ``t`` gathered chunk by chunk under the interleaved
    schedule (sw.dp_chunk_gather), ``win_f`` the forward a micro-batch runs on the critical stage (dp_overlap x
    the compute). Megatron-Core's schedule dispatches the all-gathers of chunks 0 and 1 before the first forward and
    chunk j+1's at chunk j's first micro-batch (schedules.py forward_step_helper_preprocess, aligned over pipeline
    ranks), and a chunk's forward pre-hook waits for all of its buckets (distributed_data_parallel.py
    _make_forward_pre_hook; start_param_sync dispatches them last layer first, so its first layer's come last). Chunk
    j+1's first micro-batch runs pp chunk-forwards (D = pp x win_f / v) after chunk j's: the first chunk's t / v is
    exposed, and each later one what of its t / v exceeds D."""
    v = np.maximum(c.ve, 1)
    t_c = t / v
    return t_c + (v - 1) * np.maximum(t_c - c.pp * win_f / v, 0.0)


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
