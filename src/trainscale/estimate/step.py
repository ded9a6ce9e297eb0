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
from trainscale.estimate.pipeline import bubble_fraction, layer_placement, pipeline_time
from trainscale.estimate.profile import check_profile, is_hardware_profile
from trainscale.estimate.software import Software, load_software
from trainscale.specs import ClusterSpec, GPUSpec, ModelSpec, load_gpu

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
    attention_seq_half: float
    hbm_efficiency: float
    launch_gap_s: float
    sustained_clock_fraction: float
    scale_up_bus_efficiency: float
    network_bus_efficiency: float
    scale_up_latency_s: float
    optimizer_bytes_per_param: float
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


def _generation(gpu: str | None) -> str:
    """The GPU's architecture generation (catalog/gpus.toml), '' when unknown."""
    if not gpu:
        return ""
    try:
        return load_gpu(gpu).generation
    except TrainscaleError:
        return ""


def load_efficiencies(gpu: str | None = None, profile: str | Path | None = None,
                      overrides: dict[str, float] | None = None, peak_flops: float | None = None,
                      hbm_bandwidth: float | None = None, scale_up_bandwidth: float | None = None) -> Efficiencies:
    """Catalog defaults, then the GPU generation's constants, then the GPU's overrides, then a measured profile
    (TOML/JSON), then ``overrides``.

    A profile is either flat planner settings (the keys of catalog/planner.toml [defaults]; ``matmul_flops``
    may stand for ``matmul_efficiency`` and is divided by the GPU's peak) or a hardware profile written by
    ``trainscale calibrate`` on the GPU (``profile_efficiencies``).
    """
    cat = planner_catalog()
    vals: dict[str, Any] = {k: cat["defaults"][k] for k in _EFF_KEYS}
    sources = {k: cat["defaults"].get(f"{k}_source", "") for k in _EFF_KEYS}
    gen = _generation(gpu)
    for k, x in cat.get("generation", {}).get(gen, {}).items():
        if k in vals:
            vals[k], sources[k] = x, cat["generation"][gen].get(f"{k}_source", f"catalog/planner.toml "
                                                                                 f"[generation.{gen}]")
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
        if is_hardware_profile(extra):  # a `trainscale calibrate` hardware profile
            extra = profile_efficiencies(check_profile(extra, path), path, peak_flops, hbm_bandwidth,
                                         scale_up_bandwidth)
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
              "network_bus_efficiency", "sustained_clock_fraction"):
        if not 0 < vals[k] <= 1:
            raise TrainscaleError(f"planner setting {k} must be in (0, 1], not {vals[k]}")
    return Efficiencies(**vals, sources=sources)


def cluster_topology(cluster: ClusterSpec, gpu: GPUSpec, eff: Efficiencies) -> comms.Topology:
    """The cluster's wires, with its pods and oversubscription (ClusterSpec)."""
    src = cluster.source + (f"; {cluster.pods_source}" if cluster.pods_source else "")
    return comms.topology(cluster, gpu, eff.scale_up_bus_efficiency, eff.network_bus_efficiency,
                          eff.scale_up_latency_s, cluster.pod_gpus, cluster.oversubscription, src)


def with_overrides(eff: Efficiencies, **kw: float) -> Efficiencies:
    return replace(eff, **kw)


# ----------------------------------------------------------------------------- compute

TILE = 128  # output tile edge of a tensor-core GEMM kernel (CUTLASS / cuBLAS 128x128 tiles)


def gemm_time(mm: Any, k: Any, n: Any, flops_per_s: float, bytes_per_s: float, sms: int = 0,
              launch_s: float = 0.0) -> Any:
    """One (mm x k) @ (k x n) GEMM: a roofline (Williams et al. 2009), max(2mkn / FLOP/s, bf16 bytes of A, B, C /
    memory bandwidth), with tile and wave quantization (NVIDIA Matrix Multiplication Background guide): the output
    is cut into 128 x 128 tiles, padded at the edges, and the tiles run in waves of one per SM; a partial last wave
    leaves SMs idle. ``flops_per_s`` is the sustained rate of a large, well-shaped GEMM; no kernel is shorter than
    ``launch_s``."""
    mm, k, n = (np.asarray(x, dtype=float) for x in (mm, k, n))
    tm, tn = np.ceil(mm / TILE), np.ceil(n / TILE)
    util = mm * n / (tm * tn * TILE * TILE)
    if sms:
        tiles = tm * tn
        util = util * tiles / (np.ceil(tiles / sms) * sms)
    t = np.maximum(2.0 * mm * k * n / (flops_per_s * util), ACT_BYTES * (mm * k + k * n + mm * n) / bytes_per_s)
    return np.maximum(t, launch_s)


def gemm_train_time(mm: Any, k: Any, n: Any, flops_per_s: float, bytes_per_s: float, sms: int = 0,
                    launch_s: float = 0.0) -> tuple[Any, Any]:
    """(forward, backward) of one linear layer: y = x W (mm, k, n); backward dX = dY W^T (mm, n, k) and
    dW = X^T dY (k, mm, n)."""
    f = gemm_time(mm, k, n, flops_per_s, bytes_per_s, sms, launch_s)
    b = (gemm_time(mm, n, k, flops_per_s, bytes_per_s, sms, launch_s)
         + gemm_time(k, mm, n, flops_per_s, bytes_per_s, sms, launch_s))
    return f, b


def layer_gemm_shapes(m: ModelSpec, tp: Any) -> dict[str, tuple[Any, Any]]:
    """(in, out) of each GEMM of one decoder layer on one TP rank (Megatron column/row split, Shoeybi et al.
    2019 Sec. 3): wq, wk, wv, w1, w3 split their outputs, wo and w2 their inputs. K/V heads are replicated
    when TP exceeds their count (GQA). Names as runtime/model.py."""
    tp = np.asarray(tp, dtype=float)
    kv = np.maximum(m.n_kv_heads / tp, 1) * m.head_dim
    d = m.d_model
    shapes = {"wq": (d, m.q_dim / tp), "wk": (d, kv), "wv": (d, kv), "wo": (m.q_dim / tp, d),
              "w1": (d, m.d_ff / tp), "w2": (m.d_ff / tp, d)}
    if m.mlp == "swiglu":
        shapes["w3"] = (d, m.d_ff / tp)
    return shapes


def attention_rate(m: ModelSpec, seq: Any, peak: float, eff: Efficiencies) -> Any:
    """FLOP/s of a fused (FlashAttention) kernel, forward + backward: its plateau fraction of peak at head dim 128,
    times s / (s + s_half) for the rise with sequence length and d / (d + 16) (normalised at 128) for the head
    dimension (FlashAttention-2, arXiv 2307.08691 Fig. 4-7: throughput grows with both)."""
    s = np.asarray(seq, dtype=float)
    hd = m.head_dim
    return peak * eff.attention_efficiency * s / (s + eff.attention_seq_half) * (hd / (hd + 16)) / (128 / 144)


def _per_mode(fn, codes: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Evaluate ``fn(name)`` once per discrete choice present and pick each row's value."""
    out = np.zeros(codes.shape, dtype=float)
    for i, name in enumerate(names):
        sel = codes == i
        if sel.any():
            out = np.where(sel, fn(name), out)
    return out


# ----------------------------------------------------------------------------- the model


def matmul_params(m: ModelSpec) -> int:
    """N for MFU: every weight in a matmul. The input embedding is a lookup (no multiply-adds); a tied output
    head still runs its V x d GEMM, so tied models count it once."""
    tied_head = m.vocab_size * m.d_model if m.tied_embeddings else 0
    return param_count(m) - embedding_params(m) + tied_head


def in_flight(sched: Any, pp: Any, v: Any, micro: Any, r: Any) -> Any:
    """Micro-batches (in units of a whole stage's layers) whose activations stage r holds at its peak.

    GPipe keeps all m; 1F1B keeps p - r on stage r (Narayanan et al. 2021 Sec. 2.2.1); interleaved 1F1B runs
    Megatron's warm-up of (p - r - 1) x 2 + (v - 1) x p chunk forwards, plus the one in flight, each chunk
    1/v of the stage (Megatron-LM schedules.py forward_backward_pipelining_with_interleaving)."""
    sched, pp, v, micro, r = (np.asarray(x) for x in (sched, pp, v, micro, r))
    one_f = np.minimum(pp - r, micro)
    chunks = np.minimum((pp - r - 1) * 2 + (v - 1) * pp + 1, micro * v)
    return np.select([sched == 0, sched == 2], [micro, chunks / np.maximum(v, 1)], one_f)


def evaluate(m: ModelSpec, gpu: GPUSpec, topo: comms.Topology, eff: Efficiencies, seq: int, global_seqs: int,
             cfg: dict[str, Any], sw: Software | None = None) -> dict[str, np.ndarray]:
    """Step time, memory and utilization of every layout in ``cfg`` (arrays: tp cp pp dp mb v schedule
    recompute zero hsdp sp; schedule and recompute as indices into SCHEDULE and RECOMPUTE) under software ``sw``."""
    sw = load_software(sw)
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
    peak_run = peak * eff.sustained_clock_fraction  # tensor-core clock held through a long run, not a burst
    f_mm = peak_run * eff.matmul_efficiency
    hbm = gpu.hbm_bandwidth * eff.hbm_efficiency
    sms, gap = gpu.sm_count, eff.launch_gap_s
    flash = sw.attention == "flash"

    # --- compute per layer per micro-batch on one GPU (item 1: every GEMM at its sharded shape)
    t_mm_f = t_mm_b = t_sel = 0.0
    for name, (k_in, n_out) in layer_gemm_shapes(m, tp).items():
        f, b = gemm_train_time(tokens, k_in, n_out, f_mm, hbm, sms, gap)
        t_mm_f, t_mm_b = t_mm_f + f, t_mm_b + b
        if name in sw.selective_gemms:
            t_sel = t_sel + f
    # the attention core: fused (FlashAttention; causal halving) or unfused (full s x s products + score traffic)
    heads = m.n_heads / tp
    if flash:
        attn_train = flops.attention_flops_per_token(m, S, causal=True) / L * tokens / tp
        t_attn = attn_train / (attention_rate(m, S, peak_run, eff) * sw.attention_speed)
        t_attn_f = t_attn / 3  # the forward is a third of forward + backward
        t_scores_f = 0.0
    else:
        rows = mb * heads * (S / cp)
        qk_f, qk_b = gemm_train_time(rows, m.head_dim, S, f_mm, hbm, sms, gap)
        av_f, av_b = gemm_train_time(rows, S, m.head_dim, f_mm, hbm, sms, gap)
        # score bytes (bf16): QK^T written, scale-mask-softmax read + written, dropout read + written (+ a 1-byte
        # mask), read by the V product: 6.5 passes forward, twice that backward (Korthikanti 2022 Sec. 4.1's
        # 5as/h terms are these tensors)
        score = mb * heads * (S / cp) * S * ACT_BYTES
        t_scores_f = 6.5 * score / hbm
        t_attn_f = qk_f + av_f + t_scores_f
        t_attn = t_attn_f + qk_b + av_b + 2 * t_scores_f
    # item 2: the work between GEMMs (norms, residuals, RoPE, dropout, activation) as HBM traffic
    hidden_tok = np.where(sp, tokens / tp, tokens)  # sequence parallel shards the norm/dropout regions
    ups = 2 if m.mlp == "swiglu" else 1
    ew_f = ACT_BYTES * (sw.elementwise_passes * hidden_tok * h + sw.mlp_act_passes * tokens * m.d_ff / tp
                        * ups / 2) / hbm
    t_ew = 3 * ew_f  # forward + a backward moving twice the bytes
    t_layer_compute = t_mm_f + t_mm_b + t_attn + t_ew
    hf, hb = gemm_train_time(tokens, h, m.vocab_size / tp, f_mm, hbm, sms, gap)
    t_loss = tokens * m.vocab_size / tp * (ACT_BYTES + LOSS_BYTES) * 3 / hbm  # softmax cross-entropy, fwd + bwd
    t_head = hf + hb + t_loss

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

    # recomputation (Korthikanti Sec. 5): full redoes the layer forward (and its TP/CP traffic); selective redoes
    # the attention core and the GEMMs the software names (torchtitan: every second one), and then also the
    # element-wise ops between them (only saved ops are kept)
    sel_ew = ew_f if sw.selective_gemms else 0.0
    t_rc = np.select([rc == 2, rc == 1], [t_mm_f + t_attn_f + ew_f, t_attn_f + t_sel + sel_ew], 0.0)
    tp_x = (1 - sw.tp_overlap) * (2 + (rc == 2)) * tp_one_way
    cp_x = (1 - eff.cp_overlap) * (cp_fwd + cp_bwd + (rc == 2) * cp_fwd)

    # the slowest stage: the fullest one, or the last one if the output head tips it over; each chunk pass of
    # a micro-batch also pays the software's fixed dispatch cost
    t_layer = t_layer_compute + t_rc + tp_x + cp_x
    last_slower = place["last"] * t_layer + t_head > place["max"] * t_layer
    n_crit = np.where(last_slower, place["last"], place["max"])
    head_crit = np.where(last_slower, t_head, 0.0)
    t_fixed = ve * sw.microbatch_overhead_s
    st_compute = n_crit * t_layer_compute + head_crit + t_fixed
    st_rc, st_tp, st_cp = n_crit * t_rc, n_crit * tp_x, n_crit * cp_x
    t_stage = st_compute + st_rc + st_tp + st_cp
    t_pipe = pipeline_time(t_stage, micro, pp, ve)
    bubble = t_pipe - micro * t_stage

    # pipeline point to point: activations sharded over TP (sequence parallel / scatter-gather, Narayanan
    # 2021 Sec. 4.1), async in steady state, exposed in fill and drain: a micro-batch crosses p x v - 1 chunk
    # boundaries to fill the pipeline and as many to drain it
    bw_pp, lat_pp = comms.link(topo, pp, tp * cp * pp, collective=False)
    t_p2p = comms.p2p_time(act / tp, bw_pp, lat_pp)
    hops = 2 * (pp * ve - 1)
    p2p_x = np.where(pp > 1, (hops + (1 - eff.p2p_overlap) * 2 * micro * ve) * t_p2p, 0.0)

    # data parallel / ZeRO over the cp x dp replicas (CP ranks hold the same weights)
    lp = layer_params(m)
    emb, head = embedding_params(m), head_params(m)
    tied_copy = emb if m.tied_embeddings else 0  # a tied head keeps its own copy of the embedding on the last stage
    p_first = (place["first"] * lp + np.where(pp > 1, emb, emb + head)) / tp
    p_mid = place["max"] * lp / tp
    p_last = (place["last"] * lp + head + tied_copy) / tp
    p_crit = np.where(pp > 1, np.maximum(p_mid, np.maximum(p_first, p_last)), p_first)
    n_shard = cp * dp // hsdp
    extent_dp = np.where(dp > 1, world, tp * cp)
    extent_shard = np.where(dp // hsdp > 1, tp * cp * pp * (dp // hsdp), tp * cp)
    bw_s, lat_s = comms.link(topo, n_shard, extent_shard)
    bw_r, lat_r = comms.link(topo, hsdp, world)
    bw_d, lat_d = comms.link(topo, cp * dp, extent_dp)
    gb, wb = sw.grad_reduce_bytes * p_crit, memory.WEIGHT_BYTES * p_crit
    win_f = n_crit * (t_mm_f + t_attn_f + ew_f)
    win_b = n_crit * (t_mm_b + t_attn - t_attn_f + 2 * ew_f) + st_rc
    rs = comms.reduce_scatter_time(gb, n_shard, bw_s, lat_s)
    ag = comms.all_gather_time(wb, n_shard, bw_s, lat_s)
    ar_rep = comms.all_reduce_time(gb / n_shard, hsdp, bw_r, lat_r)
    ar = comms.all_reduce_time(gb, cp * dp, bw_d, lat_d)
    ov = sw.dp_overlap

    def hidden(t: Any, window: Any, once: bool = False) -> Any:
        # a collective overlaps the compute it follows; one that runs once per step also leaves one layer's
        # bucket exposed (the first gather before any compute, the last reduce after all of it)
        floor = t / np.maximum(n_crit, 1) if once else 0.0
        return np.maximum(floor, t - ov * window)

    # ZeRO-3 gathers the weights again for the backward (FSDP reshard_after_forward); the backward's gather and
    # reduce-scatter share the same links at once
    dp_x = np.select(
        [zero == 0, zero == 1, zero == 2],
        [hidden(ar, win_b, True),
         hidden(rs + ar_rep, win_b, True) + hidden(ag, win_f, True),
         micro * hidden(rs, win_b) + hidden(ar_rep, win_b, True) + hidden(ag, win_f, True)],
        micro * (hidden(ag, win_f) + hidden(ag + rs, win_b)) + hidden(ar_rep, win_b, True))
    dp_traffic = np.select([zero == 0, zero == 1, zero == 2], [ar, rs + ag + ar_rep, micro * rs + ag + ar_rep],
                           micro * (2 * ag + rs) + ar_rep)

    # optimizer: Adam is memory-bound on this rank's shard of the state; fp32 grads are read at 4 bytes
    p_shard = p_crit / np.where(zero >= 1, n_shard, 1)
    t_opt = (eff.optimizer_bytes_per_param + sw.grad_bytes - memory.GRAD_BYTES) * p_shard / hbm

    step = t_pipe + p2p_x + dp_x + t_opt

    # --- memory on every pipeline stage (item 4), the heaviest deciding. Middle stages hold the same layers and
    # fewer micro-batches the later they sit, so the heaviest is the first, the second (the first full one when
    # the end stages give a slot to the embedding and head) or the last (head, logits, a tied embedding copy).
    def acts(mode: str) -> np.ndarray:
        def one(use_sp: bool) -> Any:
            return memory.activation_bytes_per_layer(S // cp, mb, h, m.n_heads, tp, use_sp, mode)
        return np.where(sp, one(True), one(False))

    # flash keeps no s x s scores, whatever the recompute mode: Korthikanti's "selective" is exactly that
    per_layer = _per_mode(lambda mode: acts("selective" if flash and mode == "none" else mode), rc, RECOMPUTE)
    # a selective policy that recomputes GEMMs (torchtitan: every second one) does not keep their outputs
    # (bf16, tokens x out width, sharded like the GEMM)
    dropped = sum(n_out for name, (_, n_out) in layer_gemm_shapes(m, tp).items() if name in sw.selective_gemms)
    per_layer = per_layer - np.where(rc == 1, ACT_BYTES * (S // cp) * mb * dropped, 0.0)
    rc_one = np.where(sp, memory.activation_bytes_per_layer(S // cp, mb, h, m.n_heads, tp, True,
                                                            "selective" if flash else "none"),
                      memory.activation_bytes_per_layer(S // cp, mb, h, m.n_heads, tp, False,
                                                        "selective" if flash else "none"))
    rc_buf = np.where(rc == 2, rc_one, 0.0)  # full recompute re-materialises one layer in the backward
    fsdp_buf = np.where(zero >= 3, (2 * memory.WEIGHT_BYTES + sw.grad_bytes) * lp / tp, 0.0)
    logits = tokens * m.vocab_size / tp * (ACT_BYTES + LOSS_BYTES)
    capacity = gpu.memory_bytes - eff.memory_reserve_bytes

    def stage(r: Any, layers: Any, params: Any, is_last: Any) -> dict[str, Any]:
        st = memory.zero_state_bytes_per_gpu(params, n_shard, zero, grad_bytes=sw.grad_bytes)
        a = per_layer * layers * in_flight(sched, pp, ve, micro, r)
        buf = fsdp_buf + rc_buf + np.where(is_last, logits, 0.0)
        w, g, o = (np.asarray(x) + 0.0 for x in (st.weights, st.gradients, st.optimizer))
        return {"w": w, "g": g, "o": o, "a": a, "b": buf, "t": w + g + o + a + buf}

    s0 = stage(0, place["first"], p_first, pp == 1)
    s1 = stage(np.minimum(1, pp - 1), np.where(pp > 2, place["max"], place["last"]),
               np.where(pp > 2, p_mid, p_last), pp == 2)
    sl = stage(pp - 1, place["last"], np.where(pp > 1, p_last, p_first), np.ones(pp.shape, dtype=bool))
    cand = np.stack([s0["t"], np.where(pp > 1, s1["t"], 0.0), np.where(pp > 2, sl["t"], 0.0)])
    which = np.argmax(cand, axis=0)
    heavy = {k: np.choose(which, [s0[k], s1[k], sl[k]]) for k in s0}
    heaviest_stage = np.choose(which, [np.zeros_like(pp), np.minimum(1, pp - 1), pp - 1])

    # utilization (item 6): MFU counts 6N (N with the LM head) + 12·L·H·Q·T attention with causal halving
    n_mm = matmul_params(m)
    fpt = flops.model_flops_per_token(m, n_mm, S, causal=True)
    rpt = _per_mode(lambda mode: np.full(rc.shape, flops.recompute_flops_per_token(m, n_mm, S, mode, causal=True)),
                    rc, RECOMPUTE)
    sel_params = sum(int(np.prod(sh)) for name, sh in _full_shapes(m).items() if name in sw.selective_gemms)
    rpt = rpt + np.where(rc == 1, 2.0 * sel_params * L, 0.0)  # 2 FLOPs per weight per token, every layer
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
        "t_gemm": micro * n_crit * (t_mm_f + t_mm_b),
        "t_attention": micro * n_crit * t_attn, "t_elementwise": micro * n_crit * t_ew,
        "tp_in_scale_up": comms.in_scale_up(topo, tp) | (tp == 1),
        "mem_weights": heavy["w"], "mem_gradients": heavy["g"], "mem_optimizer": heavy["o"],
        "mem_activations": heavy["a"], "mem_buffers": heavy["b"], "mem_total": heavy["t"],
        "mem_first_stage": s0["t"], "heaviest_stage": heaviest_stage,
        "fits": heavy["t"] <= capacity, "headroom": capacity - heavy["t"],
        "tokens_per_s": tps, "mfu": mfu, "hfu": hfu, "tflops_per_gpu": mfu * peak / 1e12,
        "hw_tflops_per_gpu": hfu * peak / 1e12, "params_per_gpu": p_crit,
    }


def _full_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    return {k: (int(a), int(b)) for k, (a, b) in layer_gemm_shapes(m, 1).items()}
