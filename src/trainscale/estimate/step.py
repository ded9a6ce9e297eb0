"""Step time and memory of a parallel layout: compute, communication, pipeline bubble, optimizer.

``evaluate`` takes numpy arrays (one entry per layout) so that the planner scores a whole search
space in one pass; one layout is the same call with arrays of length one. The model, with
Korthikanti et al. 2022 (arXiv 2205.05198) symbols where they apply:

  step = m · t_stage · (1 + bubble) + exposed pipeline p2p + exposed DP/ZeRO traffic + optimizer
  t_stage = layers on the slowest stage x (compute + recompute + exposed TP + exposed CP) [+ head]

Compute runs each GEMM at min(achievable FLOP/s, arithmetic intensity x HBM bandwidth) (roofline)
and the attention core (FlashAttention, causal) at its own achievable fraction of peak.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.estimate import comms, flops, memory
from trainscale.estimate.params import embedding_params, head_params, layer_params, param_count
from trainscale.estimate.pipeline import bubble_fraction, fill_drain_hops, layer_placement, pipeline_time
from trainscale.specs import ClusterSpec, GPUSpec, ModelSpec

ACT_BYTES = 2  # bf16 activations, as Korthikanti et al. 2022 count them (Sec. 4.1)
LOSS_BYTES = 4  # fp32 logits for the softmax cross-entropy on the last stage
RECOMPUTE = ("none", "selective", "full")
SCHEDULE = ("gpipe", "1f1b", "interleaved")


# ----------------------------------------------------------------------------- defaults


@dataclass(frozen=True)
class Efficiencies:
    """What fraction of the datasheet the step-time model assumes; defaults from catalog/planner.toml."""

    matmul_efficiency: float
    attention_efficiency: float
    hbm_efficiency: float
    scale_up_bus_efficiency: float
    network_bus_efficiency: float
    scale_up_latency_s: float
    optimizer_bytes_per_param: float
    dp_overlap: float
    tp_overlap: float
    cp_overlap: float
    p2p_overlap: float
    memory_reserve_bytes: float
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        return d


_EFF_KEYS = tuple(f.name for f in fields(Efficiencies) if f.name != "sources")


@cache
def planner_catalog() -> dict[str, Any]:
    return tomllib.loads(resources.files("trainscale.catalog").joinpath("planner.toml").read_text())


def profile_efficiencies(prof: dict[str, Any], path: Path, peak_flops: float | None, hbm_bandwidth: float | None,
                         scale_up_bandwidth: float | None) -> dict[str, float]:
    """The planner settings a ``trainscale calibrate`` hardware profile implies for one GPU: its one-process
    figures over the datasheet (matmul and attention FLOP/s over the bf16 peak, copy bandwidth over HBM), the
    measured AdamW bytes per parameter, and from the largest all-reduce group the bus efficiency over the
    per-direction scale-up link and the latency per ring step (2(n-1) steps, NCCL-tests' ring)."""
    machine = prof.get("machine", {})
    if machine.get("device") != "cuda":
        raise TrainscaleError(f"profile {path} was measured on a {machine.get('device', 'unknown')} device "
                              f"({machine.get('device_name', '?')}); the planner's GPUs need one calibrated on "
                              "the GPU (run trainscale calibrate there)")
    if not peak_flops or not hbm_bandwidth:
        raise TrainscaleError("a calibrated profile needs the GPU's peak and HBM bandwidth to become efficiencies")
    one = prof.get("processes", {}).get("1")
    if not one:
        raise TrainscaleError(f"profile {path} has no one-process figures ([processes.1])")
    try:
        out = {"matmul_efficiency": min(1.0, float(one["matmul_flops"]) / peak_flops),
               "attention_efficiency": min(1.0, float(one["attention_flops"]) / peak_flops),
               "hbm_efficiency": min(1.0, float(one["memory_bandwidth"]) / hbm_bandwidth),
               "optimizer_bytes_per_param": float(one["optimizer_bytes_per_param"])}
        groups = {int(n): v for n, v in prof.get("collectives", {}).items() if "all_reduce" in v}
        if groups and scale_up_bandwidth:
            n = max(groups)
            ar = groups[n]["all_reduce"]
            out["scale_up_bus_efficiency"] = min(1.0, float(ar["bus_bandwidth"]) / (scale_up_bandwidth / 2))
            out["scale_up_latency_s"] = float(ar["latency_s"]) / (2 * (n - 1))
    except (KeyError, TypeError, ValueError) as e:
        raise TrainscaleError(f"profile {path} is malformed ({e}); run trainscale calibrate again") from None
    return out


def load_efficiencies(gpu: str | None = None, profile: str | Path | None = None,
                      overrides: dict[str, float] | None = None, peak_flops: float | None = None,
                      hbm_bandwidth: float | None = None, scale_up_bandwidth: float | None = None) -> Efficiencies:
    """Catalog defaults, then the GPU's overrides, then a measured profile (TOML/JSON), then ``overrides``.

    A profile is either flat planner settings (the keys of catalog/planner.toml [defaults]; ``matmul_flops``
    may stand for ``matmul_efficiency`` and is divided by the GPU's peak) or a hardware profile written by
    ``trainscale calibrate`` on the GPU (``profile_efficiencies``).
    """
    cat = planner_catalog()
    vals: dict[str, Any] = {k: cat["defaults"][k] for k in _EFF_KEYS}
    sources = {k: cat["defaults"].get(f"{k}_source", "") for k in _EFF_KEYS}
    for k, x in cat.get("gpu", {}).get(gpu or "", {}).items():
        if k in vals:
            vals[k], sources[k] = x, f"catalog/planner.toml [gpu.{gpu}]"
    extra: dict[str, Any] = {}
    if profile is not None:
        path = Path(profile)
        try:
            text = path.read_text()
            extra = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as e:
            raise TrainscaleError(f"profile {path} cannot be read: {e}") from None
        if "processes" in extra:  # a `trainscale calibrate` hardware profile
            extra = profile_efficiencies(extra, path, peak_flops, hbm_bandwidth, scale_up_bandwidth)
        if "matmul_flops" in extra:
            if not peak_flops:
                raise TrainscaleError("a profile's matmul_flops needs the GPU's peak to become an efficiency")
            extra.setdefault("matmul_efficiency", float(extra.pop("matmul_flops")) / peak_flops)
        extra = {k: v for k, v in extra.items() if k in vals}
        sources.update({k: f"profile {path}" for k in extra})
    for k, x in {**extra, **(overrides or {})}.items():
        if k not in vals:
            raise TrainscaleError(f"unknown planner setting '{k}'; known: {', '.join(_EFF_KEYS)}")
        try:
            vals[k] = float(x)
        except (TypeError, ValueError):
            raise TrainscaleError(f"planner setting {k} must be a number, not {x!r}") from None
        if overrides and k in overrides:
            sources[k] = "set on the command line"
    for k in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency", "scale_up_bus_efficiency",
              "network_bus_efficiency"):
        if not 0 < vals[k] <= 1:
            raise TrainscaleError(f"planner setting {k} must be in (0, 1], not {vals[k]}")
    return Efficiencies(**vals, sources=sources)


def cluster_topology(cluster: ClusterSpec, gpu: GPUSpec, eff: Efficiencies) -> comms.Topology:
    """The cluster's wires plus the pod/oversubscription extras in catalog/planner.toml [topology.*]."""
    extra = planner_catalog().get("topology", {}).get(cluster.name, {})
    src = cluster.source + (f"; {extra['source']}" if extra.get("source") else "")
    return comms.topology(cluster, gpu, eff.scale_up_bus_efficiency, eff.network_bus_efficiency,
                          eff.scale_up_latency_s, int(extra.get("pod_gpus", 0)),
                          float(extra.get("oversubscription", 1.0)), src)


def with_overrides(eff: Efficiencies, **kw: float) -> Efficiencies:
    return replace(eff, **kw)


# ----------------------------------------------------------------------------- compute


def gemm_time(mm: Any, k: Any, n: Any, flops_per_s: float, bytes_per_s: float) -> Any:
    """Roofline (Williams et al. 2009): max(2mkn / FLOP/s, bf16 bytes of A, B, C / memory bandwidth)."""
    return np.maximum(2.0 * mm * k * n / flops_per_s, ACT_BYTES * (mm * k + k * n + mm * n) / bytes_per_s)


def layer_forward_gemm_time(m: ModelSpec, tokens: Any, tp: Any, flops_per_s: float, bytes_per_s: float) -> Any:
    """Forward GEMMs of one decoder layer for ``tokens`` tokens on one TP rank (Megatron column/row split,
    Shoeybi et al. 2019 Sec. 3): QKV and MLP-up split their outputs, attention-out and MLP-down their inputs.
    K/V heads are replicated when TP exceeds their count (GQA)."""
    kv = np.maximum(m.n_kv_heads / tp, 1) * m.head_dim
    ups = 2 if m.mlp == "swiglu" else 1
    d = m.d_model
    return (gemm_time(tokens, d, m.q_dim / tp + 2 * kv, flops_per_s, bytes_per_s)
            + gemm_time(tokens, m.q_dim / tp, d, flops_per_s, bytes_per_s)
            + gemm_time(tokens, d, ups * m.d_ff / tp, flops_per_s, bytes_per_s)
            + gemm_time(tokens, m.d_ff / tp, d, flops_per_s, bytes_per_s))


def _per_mode(fn, codes: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Evaluate ``fn(name)`` once per discrete choice present and pick each row's value."""
    out = np.zeros(codes.shape, dtype=float)
    for i, name in enumerate(names):
        sel = codes == i
        if sel.any():
            out = np.where(sel, fn(name), out)
    return out


def _score_bytes(m: ModelSpec, s: Any, b: Any, t: Any, sp: bool) -> Any:
    """Bytes of one layer's materialised attention scores: Korthikanti's "none" minus "selective" activations."""
    h, a = m.d_model, m.n_heads
    return (memory.activation_bytes_per_layer(s, b, h, a, t, sp, "none")
            - memory.activation_bytes_per_layer(s, b, h, a, t, sp, "selective"))


# ----------------------------------------------------------------------------- the model


def matmul_params(m: ModelSpec) -> int:
    """N for MFU: every weight in a matmul. The input embedding is a lookup (no multiply-adds)."""
    return param_count(m) - embedding_params(m)


def evaluate(m: ModelSpec, gpu: GPUSpec, topo: comms.Topology, eff: Efficiencies, seq: int, global_seqs: int,
             cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Step time, memory and utilization of every layout in ``cfg`` (arrays: tp cp pp dp mb v schedule
    recompute zero hsdp sp; schedule and recompute as indices into SCHEDULE and RECOMPUTE)."""
    tp, cp, pp, dp, mb, v, sched, rc, zero, hsdp = (np.asarray(cfg[k], dtype=np.int64) for k in (
        "tp", "cp", "pp", "dp", "mb", "v", "schedule", "recompute", "zero", "hsdp"))
    sp = np.asarray(cfg["sp"], dtype=bool) & (tp > 1)
    L, h, S = m.n_layers, m.d_model, seq
    world = tp * cp * pp * dp
    micro = global_seqs // (dp * mb)  # micro-batches per step through each pipeline
    ve = np.where(sched == 2, v, 1)
    place = layer_placement(L, pp, ve)
    tokens = mb * S / cp  # tokens of its sequence shard a rank computes per micro-batch
    peak = gpu.peak_bf16_flops
    f_mm, f_attn = peak * eff.matmul_efficiency, peak * eff.attention_efficiency
    hbm = gpu.hbm_bandwidth * eff.hbm_efficiency
    bwd_ratio = flops.backward_flops_per_token(1.0) / flops.forward_flops_per_token(1.0)

    # compute per layer per micro-batch on one GPU
    t_dense_f = layer_forward_gemm_time(m, tokens, tp, f_mm, hbm)
    attn_train = flops.attention_flops_per_token(m, S, causal=True) / L * tokens / tp
    # the attention core's forward is what selective recomputation redoes (flops.recompute_flops_per_token)
    attn_fwd = flops.recompute_flops_per_token(m, 0.0, S, "selective", causal=True) / L * tokens / tp
    t_attn, t_attn_f = attn_train / f_attn, attn_fwd / f_attn
    # without recomputation the attention core is unfused: its s x s score tensors (Korthikanti's 5as/h term,
    # the gap between the "none" and "selective" activations) are written, re-read and read back in the backward
    scores = np.where(sp, _score_bytes(m, S // cp, mb, tp, True), _score_bytes(m, S // cp, mb, tp, False))
    t_unfused = np.where(rc == 0, 3 * scores / hbm, 0.0)
    t_layer_compute = (1 + bwd_ratio) * t_dense_f + t_attn + t_unfused
    t_head = (1 + bwd_ratio) * gemm_time(tokens, h, m.vocab_size / tp, f_mm, hbm)

    # tensor (+ sequence) parallel: 2 all-gathers + 2 reduce-scatters (or 2 all-reduces) per layer each way
    # (Korthikanti et al. 2022 Sec. 4.2.2)
    act = tokens * h * ACT_BYTES
    bw_tp, lat_tp = comms.link(topo, tp, tp)
    tp_one_way = np.where(sp, 2 * (comms.all_gather_time(act, tp, bw_tp, lat_tp)
                                   + comms.reduce_scatter_time(act, tp, bw_tp, lat_tp)),
                          2 * comms.all_reduce_time(act, tp, bw_tp, lat_tp))
    # context parallel (Llama 3 Sec. 3.3.2): all-gather K and V forward; again + reduce-scatter dK, dV backward
    kv_bytes = mb * S * 2 * np.maximum(m.n_kv_heads / tp, 1) * m.head_dim * ACT_BYTES
    bw_cp, lat_cp = comms.link(topo, cp, tp * cp)
    cp_ag = comms.all_gather_time(kv_bytes, cp, bw_cp, lat_cp)
    cp_fwd, cp_bwd = cp_ag, cp_ag + comms.reduce_scatter_time(kv_bytes, cp, bw_cp, lat_cp)

    # recomputation (Korthikanti Sec. 5): full redoes the layer forward (and its TP/CP traffic);
    # selective redoes the attention core
    t_rc = np.select([rc == 2, rc == 1], [t_dense_f + t_attn_f, t_attn_f], 0.0)
    tp_x = (1 - eff.tp_overlap) * (2 + (rc == 2)) * tp_one_way
    cp_x = (1 - eff.cp_overlap) * (cp_fwd + cp_bwd + (rc == 2) * cp_fwd)

    # the slowest stage: the fullest one, or the last one if the output head tips it over
    t_layer = t_layer_compute + t_rc + tp_x + cp_x
    last_slower = place["last"] * t_layer + t_head > place["max"] * t_layer
    n_crit = np.where(last_slower, place["last"], place["max"])
    head_crit = np.where(last_slower, t_head, 0.0)
    st_compute = n_crit * t_layer_compute + head_crit
    st_rc, st_tp, st_cp = n_crit * t_rc, n_crit * tp_x, n_crit * cp_x
    t_stage = st_compute + st_rc + st_tp + st_cp
    t_pipe = pipeline_time(t_stage, micro, pp, ve)
    bubble = t_pipe - micro * t_stage

    # pipeline point to point: activations sharded over TP (sequence parallel / scatter-gather, Narayanan
    # 2021 Sec. 4.1), async in steady state, exposed in fill and drain
    bw_pp, lat_pp = comms.link(topo, pp, tp * cp * pp)
    t_p2p = comms.p2p_time(act / tp, bw_pp, lat_pp)
    p2p_x = np.where(pp > 1, (fill_drain_hops(pp) + (1 - eff.p2p_overlap) * 2 * micro * ve) * t_p2p, 0.0)

    # data parallel / ZeRO over the cp x dp replicas (CP ranks hold the same weights)
    lp = layer_params(m)
    p_first = (place["first"] * lp + np.where(pp > 1, embedding_params(m), embedding_params(m) + head_params(m))) / tp
    p_last = (place["last"] * lp + head_params(m)) / tp
    p_crit = np.where(pp > 1, np.maximum(place["max"] * lp / tp, p_last), p_first)
    n_shard = cp * dp // hsdp
    extent_dp = np.where(dp > 1, world, tp * cp)
    extent_shard = np.where(dp // hsdp > 1, tp * cp * pp * (dp // hsdp), tp * cp)
    bw_s, lat_s = comms.link(topo, n_shard, extent_shard)
    bw_r, lat_r = comms.link(topo, hsdp, world)
    bw_d, lat_d = comms.link(topo, cp * dp, extent_dp)
    gb, wb = memory.GRAD_BYTES * p_crit, memory.WEIGHT_BYTES * p_crit
    win_f = n_crit * (t_dense_f + t_attn_f)
    win_b = n_crit * (bwd_ratio * t_dense_f + t_attn - t_attn_f)
    rs = comms.reduce_scatter_time(gb, n_shard, bw_s, lat_s)
    ag = comms.all_gather_time(wb, n_shard, bw_s, lat_s)
    ar_rep = comms.all_reduce_time(gb / n_shard, hsdp, bw_r, lat_r)
    ar = comms.all_reduce_time(gb, cp * dp, bw_d, lat_d)
    ov = eff.dp_overlap

    def hidden(t: Any, window: Any, once: bool = False) -> Any:
        # a collective overlaps the compute it follows; one that runs once per step also leaves one layer's
        # bucket exposed (the first gather before any compute, the last reduce after all of it)
        floor = t / np.maximum(n_crit, 1) if once else 0.0
        return np.maximum(floor, t - ov * window)

    dp_x = np.select(
        [zero == 0, zero == 1, zero == 2],
        [hidden(ar, win_b, True),
         hidden(rs + ar_rep, win_b, True) + hidden(ag, win_f, True),
         micro * hidden(rs, win_b) + hidden(ar_rep, win_b, True) + hidden(ag, win_f, True)],
        micro * (hidden(ag, win_f) + hidden(ag + rs, win_b)) + hidden(ar_rep, win_b, True))
    dp_traffic = np.select([zero == 0, zero == 1, zero == 2], [ar, rs + ag + ar_rep, micro * rs + ag + ar_rep],
                           micro * (2 * ag + rs) + ar_rep)

    # optimizer: Adam is memory-bound on this rank's shard of the state
    p_shard = p_crit / np.where(zero >= 1, n_shard, 1)
    t_opt = eff.optimizer_bytes_per_param * p_shard / hbm

    step = t_pipe + p2p_x + dp_x + t_opt

    # memory on the first stage (the most loaded: Korthikanti Sec. 4.2.3)
    state = memory.zero_state_bytes_per_gpu(p_first, n_shard, zero)

    def acts(mode: str) -> np.ndarray:
        def one(sched_name: str, use_sp: bool) -> Any:
            return memory.first_stage_activation_bytes(m, S, mb, tp, pp, use_sp, mode, ve, sched_name, micro, cp,
                                                       layers=place["first"])
        rows = [np.where(sp, one(s_name, True), one(s_name, False)) for s_name in ("gpipe", "1f1b")]
        return np.where(sched == 0, rows[0], rows[1])

    act_mem = _per_mode(acts, rc, RECOMPUTE)
    # transient buffers: FSDP's gathered layers (current + prefetched) and one layer's unsharded gradient;
    # a full-recompute backward re-materialises one layer (FlashAttention-style, no s x s scores);
    # with pp = 1 the logits of one micro-batch (bf16 + fp32 for the loss)
    fsdp_buf = np.where(zero >= 3, (2 * memory.WEIGHT_BYTES + memory.GRAD_BYTES) * lp / tp, 0.0)
    rc_buf = np.where(rc == 2, np.where(
        sp, memory.activation_bytes_per_layer(S // cp, mb, h, m.n_heads, tp, True, "selective"),
        memory.activation_bytes_per_layer(S // cp, mb, h, m.n_heads, tp, False, "selective")), 0.0)
    logits = np.where(pp == 1, tokens * m.vocab_size / tp * (ACT_BYTES + LOSS_BYTES), 0.0)
    buffers = fsdp_buf + rc_buf + logits
    mem_total = state.weights + state.gradients + state.optimizer + act_mem + buffers
    capacity = gpu.memory_bytes - eff.memory_reserve_bytes

    # utilization
    n_mm = matmul_params(m)
    fpt = flops.model_flops_per_token(m, n_mm, S, causal=True)
    rpt = _per_mode(lambda mode: np.full(rc.shape, flops.recompute_flops_per_token(m, n_mm, S, mode, causal=True)),
                    rc, RECOMPUTE)
    tokens_step = float(global_seqs) * S
    tps = tokens_step / step
    mfu = flops.mfu(tps, fpt, world, peak)
    hfu = flops.hfu(tps, fpt, rpt, world, peak)
    return {
        "world": world, "micro_batches": micro, "layers_first_stage": place["first"],
        "layers_max_stage": place["max"], "balanced_ends": place["balanced"] & (pp > 1),
        "bubble_fraction": np.where(pp > 1, bubble_fraction(pp, micro, ve), 0.0),
        "step_time_s": step, "t_compute": micro * st_compute, "t_recompute": micro * st_rc,
        "t_tp_comm": micro * st_tp, "t_cp_comm": micro * st_cp, "t_bubble": bubble, "t_pp_p2p": p2p_x,
        "t_dp_comm": dp_x, "t_optimizer": t_opt, "dp_traffic_s": dp_traffic,
        "tp_in_scale_up": comms.in_scale_up(topo, tp) | (tp == 1),
        "mem_weights": np.asarray(state.weights) + 0.0, "mem_gradients": np.asarray(state.gradients) + 0.0,
        "mem_optimizer": np.asarray(state.optimizer) + 0.0, "mem_activations": act_mem, "mem_buffers": buffers,
        "mem_total": mem_total, "fits": mem_total <= capacity, "headroom": capacity - mem_total,
        "tokens_per_s": tps, "mfu": mfu, "hfu": hfu, "tflops_per_gpu": mfu * peak / 1e12,
        "params_per_gpu": p_crit,
    }
