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
from trainscale.estimate.params import (
    active_params,
    embedding_params,
    expert_tensors,
    head_params,
    layer_params,
    numel,
)
from trainscale.estimate.pipeline import bubble_fraction, dualpipe_bubble_fraction, layer_placement, pipeline_time
from trainscale.estimate.planner.software import Software, load_software
from trainscale.estimate.profile import check_profile, is_hardware_profile
from trainscale.specs import ClusterSpec, GPUSpec, ModelSpec, load_gpu

ACT_BYTES = 2  # bf16 activations, as Korthikanti et al. 2022 count them (Sec. 4.1)
FP8_BYTES = 1  # an FP8 (e4m3) activation: DeepSeek-V3 (arXiv 2412.19437) Sec. 3.3.4 dispatches tokens in FP8
PERMUTE_PASSES = 4  # a MoE layer's token permute and unpermute/combine: a gather each, one read + one write of the
#                     routed rows (Megatron-Core moe_utils.permute / unpermute), forward
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
    fp8_matmul_efficiency: float
    moe_imbalance: float
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
              "network_bus_efficiency", "sustained_clock_fraction", "fp8_matmul_efficiency"):
        if not 0 < vals[k] <= 1:
            raise TrainscaleError(f"planner setting {k} must be in (0, 1], not {vals[k]}")
    if not 1 <= vals["moe_imbalance"] <= 1e3:
        raise TrainscaleError(f"planner setting moe_imbalance must be at least 1 (the busiest rank over the mean), "
                              f"not {vals['moe_imbalance']}")
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


def attention_gemm_shapes(m: ModelSpec, tp: Any) -> dict[str, tuple[Any, Any]]:
    """(in, out) of each attention projection of one decoder layer on one TP rank (Megatron column/row split,
    Shoeybi et al. 2019 Sec. 3): wq, wk, wv split their outputs, wo its input; K/V heads are replicated when TP
    exceeds their count (GQA). Under MLA (DeepSeek-V2, arXiv 2405.04434 Sec. 2.1) the down-projections wq_a and
    wkv_a are whole on every rank, the up-projections wq_b and wkv_b split over heads, wo its input. Names as
    estimate/params.py."""
    tp = np.asarray(tp, dtype=float)
    d = m.d_model
    if m.attention == "mla":
        h, qk, v = m.n_heads, m.qk_head_dim, m.value_head_dim
        out: dict[str, tuple[Any, Any]] = {}
        if m.q_lora_rank:
            out["wq_a"] = (d, m.q_lora_rank + 0 * tp)
            out["wq_b"] = (m.q_lora_rank, h * qk / tp)
        else:
            out["wq"] = (d, h * qk / tp)
        out["wkv_a"] = (d, m.kv_lora_rank + m.qk_rope_head_dim + 0 * tp)
        out["wkv_b"] = (m.kv_lora_rank, h * (m.head_dim + v) / tp)
        out["wo"] = (h * v / tp, d)
        return out
    kv = np.maximum(m.n_kv_heads / tp, 1) * m.head_dim
    return {"wq": (d, m.q_dim / tp), "wk": (d, kv), "wv": (d, kv), "wo": (m.q_dim / tp, d)}


def ffn_gemm_shapes(m: ModelSpec, tp: Any, width: int | None = None) -> dict[str, tuple[Any, Any]]:
    """(in, out) of a dense FFN of ``width`` (default d_ff) on one TP rank: w1 (and w3) split their outputs, w2
    its input."""
    tp = np.asarray(tp, dtype=float)
    width = m.d_ff if width is None else width
    shapes = {"w1": (m.d_model, width / tp), "w2": (width / tp, m.d_model)}
    if m.mlp == "swiglu":
        shapes["w3"] = (m.d_model, width / tp)
    return shapes


def layer_gemm_shapes(m: ModelSpec, tp: Any) -> dict[str, tuple[Any, Any]]:
    """(in, out) of each GEMM of one dense decoder layer on one TP rank: the attention projections, then the
    FFN (``attention_gemm_shapes``, ``ffn_gemm_shapes``). Names as runtime/model.py."""
    return {**attention_gemm_shapes(m, tp), **ffn_gemm_shapes(m, tp)}


def attention_rate(m: ModelSpec, seq: Any, peak: float, eff: Efficiencies) -> Any:
    """FLOP/s of a fused (FlashAttention) kernel, forward + backward: its plateau fraction of peak at head dim 128,
    times s / (s + s_half) for the rise with sequence length and d / (d + 16) (normalised at 128) for the head
    dimension (FlashAttention-2, arXiv 2307.08691 Fig. 4-7: throughput grows with both)."""
    s = np.asarray(seq, dtype=float)
    hd = m.qk_head_dim
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
    """N for MFU: every weight in a matmul a token passes through. The input embedding is a lookup (no
    multiply-adds); a tied output head still runs its V x d GEMM, so tied models count it once. A MoE counts
    its ACTIVE parameters (``params.active_params``: the router and shared experts in full, top-k of the
    routed experts), so FLOPs per token follow the active count and training state the total."""
    tied_head = m.vocab_size * m.d_model if m.tied_embeddings else 0
    return active_params(m, embeddings=False) + tied_head


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
    recompute zero hsdp sp, and ep for a MoE; schedule and recompute as indices into SCHEDULE and RECOMPUTE) under
    software ``sw``.

    A MoE (``m.is_moe``) adds, per MoE layer: the router GEMM, the shared expert (TP-split like a dense FFN) and
    the routed experts of this rank (n_experts / ep of them, whole: not TP-split), which compute the tokens/tp of
    this rank's sequence shard times top-k times the load imbalance (the busiest EP rank sets the pace); the
    dispatch and combine all-to-all (``comms.all_to_all_time``, 2 forward + 2 backward) over the EP group, whose
    ranks sit tp x cp apart inside the pipeline dim (``placement.mesh_sizes``); expert weights and their state
    split over EP and then over the ranks that share them (ZeRO over dp / (hsdp x ep) x cp)."""
    sw = load_software(sw)
    tp, cp, pp, dp, mb, v, sched, rc, zero, hsdp = (np.asarray(cfg[k], dtype=np.int64) for k in (
        "tp", "cp", "pp", "dp", "mb", "v", "schedule", "recompute", "zero", "hsdp"))
    ep = np.asarray(cfg["ep"], dtype=np.int64) if "ep" in cfg else np.ones_like(tp)
    moe = m.is_moe
    shaped = moe or m.attention == "mla"  # activations counted from the shapes (memory.shaped_layer_delta_...)
    fp8 = sw.precision == "fp8"
    if fp8 and not gpu.peak_fp8_flops:
        raise TrainscaleError(f"{gpu.name} has no FP8 tensor cores (catalog/gpus.toml gives it no FP8 peak), so FP8 "
                              "training cannot be planned on it; use --precision bf16")
    if not moe and np.any(ep > 1):
        raise TrainscaleError(f"expert parallelism (ep{int(np.max(ep))}) needs a mixture-of-experts model, and "
                              f"{m.name} is dense")
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
    sm_share = 1.0
    if sw.comm_sms and sms:
        # communication kernels that overlap compute keep comm_sms of the SMs (DeepSeek-V3 Sec. 3.2.2): the GEMMs
        # and the attention kernel run on the rest
        sm_share = max(sms - sw.comm_sms, 1) / sms
        sms = max(sms - sw.comm_sms, 1)
        peak_run = peak_run * sm_share
        f_mm = peak_run * eff.matmul_efficiency
    # the decoder layers' GEMMs: bf16, or FP8 at the GPU's FP8 peak with its own efficiency (DeepSeek-V3 Sec. 3.3.1:
    # Fprop, Dgrad and Wgrad of the linear layers; the output head, router and attention core stay bf16)
    f_lay = (gpu.peak_fp8_flops * eff.sustained_clock_fraction * sm_share * eff.fp8_matmul_efficiency) if fp8 \
        else f_mm

    # --- compute per layer per micro-batch on one GPU (item 1: every GEMM at its sharded shape)
    t_mm_f = t_mm_b = t_sel = t_up = 0.0
    att_names = attention_gemm_shapes(m, 1)
    for name, (k_in, n_out) in layer_gemm_shapes(m, tp).items():
        f, b = gemm_train_time(tokens, k_in, n_out, f_lay, hbm, sms, gap)
        t_mm_f, t_mm_b = t_mm_f + f, t_mm_b + b
        if name in sw.selective_gemms:
            t_sel = t_sel + f
        if name in ("wq_b", "wkv_b"):
            t_up = t_up + f  # MLA up-projections, forward (recomputed under sw.recompute_mla_up)
        if name == list(att_names)[-1]:
            t_att_f, t_att_b, t_sel_att = t_mm_f, t_mm_b, t_sel  # the attention projections alone
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
    if moe:
        k_top, n_exp, width = m.experts_per_token, m.n_experts, m.expert_width
        imbalance = m.capacity_factor if m.capacity_factor > 0 else eff.moe_imbalance
        tok_moe = tokens / tp  # each TP rank routes its own sequence shard; the experts are whole on every TP rank
        rows = tok_moe * k_top * imbalance  # routed token copies on the busiest EP rank
        n_local = n_exp / ep  # experts per EP rank
        rows_e = rows / n_local
        # router (bf16, as DeepSeek-V3 keeps the gating), shared expert (TP-split), routed experts: one grouped GEMM
        # of n_local experts, each a GEMM of rows_e rows (tile/wave quantization per expert), one launch
        rf, rb = gemm_train_time(tok_moe, h, n_exp, f_mm, hbm, sms, gap)
        t_mm_f_m, t_mm_b_m = t_att_f + rf, t_att_b + rb
        if m.d_ff_shared:
            for k_in, n_out in ffn_gemm_shapes(m, tp, m.d_ff_shared).values():
                f, b = gemm_train_time(tokens, k_in, n_out, f_lay, hbm, sms, gap)
                t_mm_f_m, t_mm_b_m = t_mm_f_m + f, t_mm_b_m + b
        for k_in, n_out in ffn_gemm_shapes(m, 1, width).values():
            f, b = gemm_train_time(rows_e, k_in, n_out, f_lay, hbm, sms, 0.0)
            t_mm_f_m, t_mm_b_m = t_mm_f_m + n_local * f + gap, t_mm_b_m + n_local * b + 2 * gap
        ew_f_m = ACT_BYTES * (sw.elementwise_passes * hidden_tok * h + sw.mlp_act_passes * (
            tokens * m.d_ff_shared / tp + rows * width) * ups / 2 + PERMUTE_PASSES * rows * h) / hbm
        t_ew_m = 3 * ew_f_m
        t_lc_m = t_mm_f_m + t_mm_b_m + t_attn + t_ew_m
        # dispatch (FP8 under fp8, DeepSeek-V3 Sec. 3.3.4) and combine (bf16) forward, their transposes backward;
        # the busiest rank receives imbalance x the mean
        ep_local = np.clip(topo.scale_up_domain // (tp * cp), 1, ep)  # EP ranks sit tp x cp apart
        nodes = ep / ep_local
        off = (ep - ep_local) / np.maximum(ep, 1)  # share of a token's k copies bound off the node
        if sw.moe_node_limit:
            # node-limited routing: at most M target nodes per token, one copy each over the network, forwarded
            # inside the node on NVLink (DeepSeek-V3 Sec. 2.1.2, 3.2.2); as a share of the k copies
            off = np.minimum(off, np.minimum(sw.moe_node_limit, nodes) * (nodes - 1) / np.maximum(nodes, 1) / k_top)
        copy_bytes = tok_moe * k_top * h * imbalance
        disp = comms.all_to_all_time(copy_bytes * (FP8_BYTES if fp8 else ACT_BYTES), ep, ep_local, topo, off)
        comb = comms.all_to_all_time(copy_bytes * ACT_BYTES, ep, ep_local, topo, off)
        a2a_f, a2a_b = disp + comb, disp + comb
        a2a_t = a2a_f + a2a_b + (rc == 2) * a2a_f
        a2a_x = np.maximum(a2a_t - sw.a2a_overlap * t_lc_m, 0.0)  # what the layer's compute does not hide
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
    # a MoE / MLA model under the software's memory-saving recomputation (DeepSeek-V3 Sec. 3.2.3, 3.3.3), short of
    # full recompute (which redoes it all anyway): the MLA up-projection GEMMs forward again, each RMSNorm's
    # forward (read x, write its output: the two layer norms over h, the latent norms over q/kv ranks), a MoE
    # SwiGLU's output from its inputs (the forward activation pass, as ew_f_m counts it)
    rc_knobs = rc_knobs_m = 0.0
    if shaped:
        rc_knobs = (t_up if sw.recompute_mla_up else 0.0) + (ACT_BYTES * 2 * (
            2 * hidden_tok * h + tokens * (m.q_lora_rank + m.kv_lora_rank)) / hbm if sw.recompute_norms else 0.0)
        rc_knobs_m = rc_knobs
        if moe and sw.recompute_swiglu_output:
            rc_knobs_m = rc_knobs_m + ACT_BYTES * sw.mlp_act_passes * (tokens * m.d_ff_shared / tp + rows * width) \
                * ups / 2 / hbm
        rc_knobs, rc_knobs_m = np.where(rc == 2, 0.0, rc_knobs), np.where(rc == 2, 0.0, rc_knobs_m)
        t_rc = t_rc + rc_knobs
    tp_x = (1 - sw.tp_overlap) * (2 + (rc == 2)) * tp_one_way
    cp_x = (1 - eff.cp_overlap) * (cp_fwd + cp_bwd + (rc == 2) * cp_fwd)
    if moe:
        sel_ew_m = ew_f_m if sw.selective_gemms else 0.0
        t_rc_m = np.select([rc == 2, rc == 1], [t_mm_f_m + t_attn_f + ew_f_m, t_attn_f + t_sel_att + sel_ew_m], 0.0) \
            + rc_knobs_m

    # the slowest stage: the fullest one, or the last one if the output head tips it over; each chunk pass of
    # a micro-batch also pays the software's fixed dispatch cost
    t_layer = t_layer_compute + t_rc + tp_x + cp_x
    if not moe:
        last_slower = place["last"] * t_layer + t_head > place["max"] * t_layer
        n_crit = np.where(last_slower, place["last"], place["max"])
        head_crit = np.where(last_slower, t_head, 0.0)
        n_moe = 0  # MoE layers on the critical stage
        t_lc_m = t_rc_m = a2a_x = t_mm_f_m = t_mm_b_m = ew_f_m = t_ew_m = 0.0
    else:
        # dense (first_dense_layers) and MoE layers mixed: the first pipeline rank holds the dense ones (those of its
        # first stage), the rank after it any left over (exact for v = 1; with v > 1 the dense layers past the first
        # stage are counted as MoE ones, the heavier kind); the slowest of first, fullest and last decides
        fd = m.first_dense_layers
        chunks = pp * ve
        stage0 = np.where(chunks > 1, place["base"] + (place["extra"] == chunks - 1), L)
        d_first = np.minimum(fd, stage0)
        d_mid = np.where(pp > 1, np.clip(fd - place["first"], 0, place["max"]), d_first)
        d_last = np.where(pp > 1, np.clip(fd - (L - place["last"]), 0, place["last"]), d_first)
        t_layer_m = t_lc_m + t_rc_m + tp_x + cp_x + a2a_x
        cand_t = np.stack([d_first * t_layer + (place["first"] - d_first) * t_layer_m + np.where(pp > 1, 0.0, t_head),
                           d_mid * t_layer + (place["max"] - d_mid) * t_layer_m,
                           d_last * t_layer + (place["last"] - d_last) * t_layer_m + t_head])
        crit = np.argmax(cand_t, axis=0)
        n_all = np.choose(crit, [place["first"], place["max"], place["last"]])
        n_crit = np.choose(crit, [d_first, d_mid, d_last])  # dense layers on the critical stage
        n_moe = n_all - n_crit
        head_crit = np.where((crit == 2) | (pp == 1), t_head, 0.0)
    t_fixed = ve * sw.microbatch_overhead_s
    st_compute = n_crit * t_layer_compute + n_moe * t_lc_m + head_crit + t_fixed
    st_rc, st_tp, st_cp = n_crit * t_rc + n_moe * t_rc_m, (n_crit + n_moe) * tp_x, (n_crit + n_moe) * cp_x
    st_a2a = n_moe * a2a_x
    t_stage = st_compute + st_rc + st_tp + st_cp + st_a2a
    if sw.pipeline == "dualpipe":
        t_pipe = np.where(pp > 1, micro * t_stage * (1 + dualpipe_bubble_fraction(pp, micro)),
                          pipeline_time(t_stage, micro, pp, ve))
    else:
        t_pipe = pipeline_time(t_stage, micro, pp, ve)
    bubble = t_pipe - micro * t_stage

    # pipeline point to point: activations sharded over TP (sequence parallel / scatter-gather, Narayanan
    # 2021 Sec. 4.1), async in steady state, exposed in fill and drain: a micro-batch crosses p x v - 1 chunk
    # boundaries to fill the pipeline and as many to drain it
    bw_pp, lat_pp = comms.link(topo, pp, tp * cp * ep * pp, collective=False)  # EP ranks sit inside pp
    t_p2p = comms.p2p_time(act / tp, bw_pp, lat_pp)
    hops = 2 * (pp * ve - 1)
    p2p_x = np.where(pp > 1, (hops + (1 - eff.p2p_overlap) * 2 * micro * ve) * t_p2p, 0.0)

    # data parallel / ZeRO over the cp x dp replicas (CP ranks hold the same weights)
    lp = layer_params(m)
    emb, head = embedding_params(m), head_params(m)
    tied_copy = emb if m.tied_embeddings else 0  # a tied head keeps its own copy of the embedding on the last stage
    if not moe:
        p_first = (place["first"] * lp + np.where(pp > 1, emb, emb + head)) / tp
        p_mid = place["max"] * lp / tp
        p_last = (place["last"] * lp + head + tied_copy) / tp
        e_first = e_mid = e_last = 0.0  # routed-expert parameters on the stage, per rank
        d_mem1 = 0
    else:
        # a MoE layer: its attention, norms, router and shared expert split over TP like a dense layer; its routed
        # experts whole over EP. The memory stages: rank 0, rank 1 (the fullest from rank 1 on), the last
        lp_d = layer_params(m, 0) if m.first_dense_layers else 0
        lp_e = numel(expert_tensors(m, L - 1))
        lp_m = layer_params(m, L - 1) - lp_e
        n1 = np.where(pp > 2, place["max"], place["last"])
        d_mem1 = np.where(pp > 1, np.clip(fd - place["first"], 0, n1), 0)
        p_first = (d_first * lp_d + (place["first"] - d_first) * lp_m + np.where(pp > 1, emb, emb + head)) / tp
        p_mid = (d_mem1 * lp_d + (n1 - d_mem1) * lp_m) / tp
        p_last = (d_last * lp_d + (place["last"] - d_last) * lp_m + head + tied_copy) / tp
        e_first, e_mid, e_last = ((place["first"] - d_first) * lp_e / ep, (n1 - d_mem1) * lp_e / ep,
                                  (place["last"] - d_last) * lp_e / ep)
    if sw.pipeline == "dualpipe":
        # DualPipe holds every stage's parameters twice (DeepSeek-V3 Table 2: "Parameter 2x")
        dual = np.where(pp > 1, 2.0, 1.0)
        p_first, p_mid, p_last = p_first * dual, p_mid * dual, p_last * dual
        e_first, e_mid, e_last = e_first * dual, e_mid * dual, e_last * dual
    p_crit = np.where(pp > 1, np.maximum(p_mid, np.maximum(p_first, p_last)), p_first)
    e_crit = np.where(pp > 1, np.maximum(e_mid, np.maximum(e_first, e_last)), e_first) + 0.0
    n_shard = cp * dp // hsdp
    n_shard_e = np.maximum(n_shard // ep, 1)  # the ranks sharing one EP rank's experts (placement expert_shard)
    extent_dp = np.where(dp > 1, world, tp * cp)
    extent_shard = np.where(dp // hsdp > 1, tp * cp * pp * (dp // hsdp), tp * cp)
    bw_s, lat_s = comms.link(topo, n_shard, extent_shard)
    bw_r, lat_r = comms.link(topo, hsdp, world)
    bw_d, lat_d = comms.link(topo, cp * dp, extent_dp)
    gb, wb = sw.grad_reduce_bytes * p_crit, memory.WEIGHT_BYTES * p_crit
    win_f = n_crit * (t_mm_f + t_attn_f + ew_f) + n_moe * (t_mm_f_m + t_attn_f + ew_f_m)
    win_b = n_crit * (t_mm_b + t_attn - t_attn_f + 2 * ew_f) + n_moe * (t_mm_b_m + t_attn - t_attn_f + 2 * ew_f_m) \
        + st_rc
    rs = comms.reduce_scatter_time(gb, n_shard, bw_s, lat_s)
    ag = comms.all_gather_time(wb, n_shard, bw_s, lat_s)
    ar_rep = comms.all_reduce_time(gb / n_shard, hsdp, bw_r, lat_r)
    ar = comms.all_reduce_time(gb, cp * dp, bw_d, lat_d)
    if moe:
        # the routed experts' state: reduced/gathered over the ranks holding the same experts (dp x cp / ep)
        gb_e, wb_e = sw.grad_reduce_bytes * e_crit, memory.WEIGHT_BYTES * e_crit
        bw_se, lat_se = comms.link(topo, n_shard_e, np.where(n_shard_e > 1, world // hsdp, tp * cp))
        bw_de, lat_de = comms.link(topo, cp * dp // ep, np.where(cp * dp // ep > 1, world, tp * cp))
        rs = rs + comms.reduce_scatter_time(gb_e, n_shard_e, bw_se, lat_se)
        ag = ag + comms.all_gather_time(wb_e, n_shard_e, bw_se, lat_se)
        ar_rep = ar_rep + comms.all_reduce_time(gb_e / n_shard_e, hsdp, bw_r, lat_r)
        ar = ar + comms.all_reduce_time(gb_e, cp * dp // ep, bw_de, lat_de)
    ov = sw.dp_overlap
    n_layers_crit = n_crit + n_moe

    def hidden(t: Any, window: Any, once: bool = False) -> Any:
        # a collective overlaps the compute it follows; one that runs once per step also leaves one layer's
        # bucket exposed (the first gather before any compute, the last reduce after all of it)
        floor = t / np.maximum(n_layers_crit, 1) if once else 0.0
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
    if moe:
        p_shard = p_shard + e_crit / np.where(zero >= 1, n_shard_e, 1)
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
    lp_buf = lp / tp if not moe else np.maximum(lp_d / tp, lp_m / tp + lp_e / ep)  # one layer's gathered weights
    fsdp_buf = np.where(zero >= 3, (2 * memory.WEIGHT_BYTES + sw.grad_bytes) * lp_buf, 0.0)
    logits = tokens * m.vocab_size / tp * (ACT_BYTES + LOSS_BYTES)
    capacity = gpu.memory_bytes - eff.memory_reserve_bytes

    if shaped:
        # a MoE or MLA model's layers counted from their shapes, as a correction to Korthikanti's dense count (the MLA
        # latents and up-projected q/k/v in place of MHA's Q, K, V; the routed rows, experts, combine and router
        # and the shared expert, or the dense FFN of d_ff, in place of a 4h MLP's 16·sbh/t), under the software's
        # caching and recompute knobs; none of it kept under full recompute
        tok_s = (S // cp) * mb
        cache_knobs = sw.activation_caching()
        imb = m.capacity_factor if m.capacity_factor > 0 else eff.moe_imbalance
        dense_act, moe_act = (np.where(rc == 2, 0.0, tok_s * memory.shaped_layer_delta_bytes_per_token(
            m, kind, tp, sp, imb, cache_knobs)) for kind in (False, True))
        if not moe:
            moe_act = dense_act
    else:
        dense_act = moe_act = 0.0

    def held(r: Any) -> Any:
        """Micro-batches of a stage's layers rank r holds at its peak. DualPipe (DeepSeek-V3 Table 2, "Activation
        PP+1"): every rank holds its two chunks' PP + 1 in all, whatever its position."""
        if sw.pipeline == "dualpipe":
            return np.where(pp > 1, np.minimum(pp + 1, micro), in_flight(sched, pp, ve, micro, r))
        return in_flight(sched, pp, ve, micro, r)

    def stage(r: Any, layers: Any, dense: Any, params: Any, experts: Any, is_last: Any) -> dict[str, Any]:
        st = memory.zero_state_bytes_per_gpu(params, n_shard, zero, grad_bytes=sw.grad_bytes)
        if moe:
            ex = memory.zero_state_bytes_per_gpu(experts, n_shard_e, zero, grad_bytes=sw.grad_bytes)
            st = memory.StateBytes(st.weights + ex.weights, st.gradients + ex.gradients, st.optimizer + ex.optimizer)
            a = (per_layer * layers + dense_act * dense + moe_act * (layers - dense)) * held(r)
        else:
            a = (per_layer + moe_act) * layers * held(r)
        buf = fsdp_buf + rc_buf + np.where(is_last, logits, 0.0)
        w, g, o = (np.asarray(x) + 0.0 for x in (st.weights, st.gradients, st.optimizer))
        return {"w": w, "g": g, "o": o, "a": a, "b": buf, "t": w + g + o + a + buf}

    if moe:
        dl = np.where(pp > 1, d_last, d_first)
    else:
        d_first = d_mem1 = dl = 0
    s0 = stage(0, place["first"], d_first, p_first, e_first, pp == 1)
    s1 = stage(np.minimum(1, pp - 1), np.where(pp > 2, place["max"], place["last"]), d_mem1,
               np.where(pp > 2, p_mid, p_last), np.where(pp > 2, e_mid, e_last), pp == 2)
    sl = stage(pp - 1, place["last"], dl, np.where(pp > 1, p_last, p_first), np.where(pp > 1, e_last, e_first),
               np.ones(pp.shape, dtype=bool))
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
    if shaped and sw.recompute_mla_up:  # the MLA up-projections again, every layer, short of full recompute
        up_params = sum(int(np.prod(sh)) for name, sh in _full_shapes(m).items() if name in ("wq_b", "wkv_b"))
        rpt = rpt + np.where(rc == 2, 0.0, 2.0 * up_params * L)
    tokens_step = float(global_seqs) * S
    tps = tokens_step / step
    mfu = flops.mfu(tps, fpt, world, peak)
    hfu = flops.hfu(tps, fpt, rpt, world, peak)
    return {
        "world": world, "micro_batches": micro, "layers_first_stage": place["first"],
        "layers_max_stage": place["max"], "balanced_ends": place["balanced"] & (pp > 1),
        "bubble_fraction": np.where(pp > 1, dualpipe_bubble_fraction(pp, micro) if sw.pipeline == "dualpipe"
                                    else bubble_fraction(pp, micro, ve), 0.0),
        "step_time_s": step, "t_compute": micro * st_compute, "t_recompute": micro * st_rc,
        "t_tp_comm": micro * st_tp, "t_cp_comm": micro * st_cp, "t_bubble": bubble, "t_pp_p2p": p2p_x,
        "t_dp_comm": dp_x, "t_optimizer": t_opt, "dp_traffic_s": dp_traffic, "t_ep_comm": micro * st_a2a,
        "a2a_per_layer_s": (a2a_t if moe else np.zeros(tp.shape)) + np.zeros(tp.shape),
        "ep_in_scale_up": (comms.in_scale_up(topo, tp * cp * ep) | (ep == 1)),
        "t_gemm": micro * n_crit * (t_mm_f + t_mm_b) + (micro * n_moe * (t_mm_f_m + t_mm_b_m) if moe else 0.0),
        "t_attention": micro * (n_crit + n_moe) * t_attn,
        "t_elementwise": micro * n_crit * t_ew + (micro * n_moe * t_ew_m if moe else 0.0),
        "tp_in_scale_up": comms.in_scale_up(topo, tp) | (tp == 1),
        "mem_weights": heavy["w"], "mem_gradients": heavy["g"], "mem_optimizer": heavy["o"],
        "mem_activations": heavy["a"], "mem_buffers": heavy["b"], "mem_total": heavy["t"],
        "mem_first_stage": s0["t"], "heaviest_stage": heaviest_stage,
        "fits": heavy["t"] <= capacity, "headroom": capacity - heavy["t"],
        "tokens_per_s": tps, "mfu": mfu, "hfu": hfu, "tflops_per_gpu": mfu * peak / 1e12,
        "hw_tflops_per_gpu": hfu * peak / 1e12, "params_per_gpu": p_crit + e_crit,
    }


def _full_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    return {k: (int(a), int(b)) for k, (a, b) in layer_gemm_shapes(m, 1).items()}
