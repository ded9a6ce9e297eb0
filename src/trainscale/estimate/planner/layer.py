"""One decoder layer on one GPU, per micro-batch, for every candidate layout at once: its GEMMs at their sharded
shapes on a roofline, the attention core, the element-wise work between them, its tensor- and context-parallel
traffic, its recomputation; and the output head. Arrays over the candidates (``candidates.Candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainscale.estimate import comms, flops
from trainscale.estimate.planner.candidates import FULL, SELECTIVE, Candidates
from trainscale.estimate.planner.efficiencies import AttentionCurve, Efficiencies, attention_curve
from trainscale.estimate.planner.software import Software
from trainscale.specs import GPUSpec, ModelSpec

ACT_BYTES = 2  # bf16 activations, as Korthikanti et al. 2022 count them (Sec. 4.1)
LOSS_BYTES = 4  # fp32 logits for the softmax cross-entropy on the last stage
TILE = 128  # output tile edge of a tensor-core GEMM kernel (CUTLASS / cuBLAS 128x128 tiles)


# ----------------------------------------------------------------------------- the roofline


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


# The FLOPs of one attention forward + backward over its forward: 3.5 as the FlashAttention benchmarks count them
# (Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py flops(): backward 2.5 x forward, five GEMMs to
# two), 3 as the planner counts them (flops.attention_flops_per_token: 12·L·H·Q·T = 3 x the forward's 4·L·H·Q·T).
SOURCE_FWD_BWD, PLANNER_FWD_BWD = 3.5, 3.0


def curve_rate(curve: AttentionCurve, seq: Any, head_dim: int, forward: bool = False) -> Any:
    """The curve's TFLOP/s (its own count) at ``seq`` and ``head_dim``: linear in log2(seq) between its points and in
    head dim between 64 and 128, the end values held outside them. ``forward``: its forward-only rates."""
    x = np.log2(np.maximum(np.asarray(seq, dtype=float), 1.0))
    xs = np.log2(np.array(curve.seq))
    y64, y128 = (curve.fwd64, curve.fwd128) if forward else (curve.hd64, curve.hd128)
    r64, r128 = np.interp(x, xs, y64), np.interp(x, xs, y128)
    w = min(max((head_dim - 64) / 64, 0.0), 1.0)
    return (1 - w) * r64 + w * r128


def forward_share(curve: AttentionCurve | None, seq: Any, head_dim: int) -> Any:
    """The forward's share of a fused attention kernel's forward + backward time (what full recomputation redoes).
    FlashAttention's backward does 2.5 x the forward's FLOPs (it recomputes the scores and probabilities from Q, K
    and the saved log-sum-exp, arXiv 2307.08691 Sec. 3.1.2; benchmark_flash_attention.py flops() counts it so): at
    one rate the forward is 1 / 3.5 of the time. Where the kernel's forward-only rates are published (catalog/
    planner.toml fwd_hd64, fwd_hd128), time(forward) / time(forward + backward) = rate(fwd+bwd) / (3.5 rate(fwd))."""
    if curve is None or curve.fwd64 is None:
        return 1.0 / SOURCE_FWD_BWD
    return curve_rate(curve, seq, head_dim) / (SOURCE_FWD_BWD * curve_rate(curve, seq, head_dim, forward=True))


def attention_rate(m: ModelSpec, seq: Any, peak: float, eff: Efficiencies, curve: AttentionCurve | None = None
                   ) -> Any:
    """FLOP/s (the planner's count) of a fused attention kernel, forward + backward, on a GPU whose compute runs at
    ``peak``. With the kernel's published curve (``curve``, catalog/planner.toml [attention]): its rate at this
    sequence length and head dim, in the planner's FLOP count (x 3 / 3.5), scaled by ``peak`` over the measured
    GPU's datasheet peak. Without one: the plateau fraction of peak at head dim 128 (attention_efficiency) times
    s / (s + s_half) for the rise with sequence length and d / (d + 16) (normalised at 128) for the head dimension
    (FlashAttention-2, arXiv 2307.08691 Fig. 4-7: throughput grows with both)."""
    s = np.asarray(seq, dtype=float)
    hd = m.qk_head_dim
    if curve is not None:
        # the Triton kernel's curve is FlashAttention v1's; fa_triton_speed (catalog/planner.toml) scales it
        speed = eff.fa_triton_speed if curve.kernel == "fa-triton" else 1.0
        return curve_rate(curve, s, hd) * 1e12 * PLANNER_FWD_BWD / SOURCE_FWD_BWD * peak / curve.peak * speed
    return peak * eff.attention_efficiency * s / (s + eff.attention_seq_half) * (hd / (hd + 16)) / (128 / 144)


def full_gemm_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """``layer_gemm_shapes`` of one whole (unsharded) layer, as integers."""
    return {k: (int(a), int(b)) for k, (a, b) in layer_gemm_shapes(m, 1).items()}


# ----------------------------------------------------------------------------- rates


@dataclass(frozen=True)
class Rates:
    """What one GPU sustains under the software: FLOP/s of its GEMMs and attention, HBM bytes/s, SMs."""

    peak: float  # the bf16 datasheet peak (MFU's denominator)
    peak_run: float  # tensor-core FLOP/s held through a long run, on the SMs the compute kernels keep
    peak_attn: float  # the peak an attention kernel's published rate is scaled from, on the SMs it keeps
    f_mm: float  # a bf16 GEMM (output head, router, unfused attention)
    f_lay: float  # the decoder layers' GEMMs: bf16, or FP8 at the GPU's FP8 peak
    hbm: float  # achievable HBM bandwidth
    sms: int  # SMs the GEMMs run on
    gap: float  # the shortest kernel (launch gap)
    attn: AttentionCurve | None = None  # the software's fused attention kernel's published curve on this GPU


def rates(gpu: GPUSpec, eff: Efficiencies, sw: Software) -> Rates:
    """The GPU's datasheet times the planner's efficiencies, less the SMs the software's overlapping
    communication kernels keep (DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.2)."""
    peak = gpu.peak_bf16_flops
    peak_run = peak * eff.sustained_clock_fraction  # tensor-core clock held through a long run, not a burst
    f_mm = peak_run * eff.matmul_efficiency
    hbm = gpu.hbm_bandwidth * eff.hbm_efficiency
    sms, gap = gpu.sm_count, eff.launch_gap_s
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
    f_lay = (gpu.peak_fp8_flops * eff.sustained_clock_fraction * sm_share * eff.fp8_matmul_efficiency) \
        if sw.precision == "fp8" else f_mm
    return Rates(peak, peak_run, peak * sm_share, f_mm, f_lay, hbm, sms, gap, kernel_curve(gpu, eff, sw))


def kernel_curve(gpu: GPUSpec, eff: Efficiencies, sw: Software) -> AttentionCurve | None:
    """The published curve of the software's attention kernel on this GPU's generation, unless a measured profile or
    the command line set attention_efficiency (then that figure rules)."""
    if eff.sources.get("attention_efficiency", "").startswith(("profile", "set on")):
        return None
    # a kernel the generation has no curve for (cuDNN or FlashAttention-3 on Ampere): the frameworks fall back to
    # FlashAttention-2 there (Transformer Engine prefers cuDNN only on Hopper+; FA3 is Hopper-only)
    return attention_curve(sw.attention_kernel, gpu.generation) or attention_curve("fa2", gpu.generation)


# ----------------------------------------------------------------------------- one layer


@dataclass(frozen=True)
class LayerTime:
    """One decoder layer (dense or MoE), one micro-batch, on one GPU; seconds, arrays over the candidates."""

    mm_f: Any  # its GEMMs, forward
    mm_b: Any  # its GEMMs, backward
    attn: Any  # the attention core, forward + backward
    attn_f: Any  # the attention core, forward
    ew_f: Any  # the element-wise work between the GEMMs, forward
    ew: Any  # the element-wise work, forward + backward
    sel: Any  # the forward of the GEMMs selective recompute redoes
    rc: Any = 0.0  # recomputation in the backward
    last_f: Any = 0.0  # the forward of its last GEMM (w2), which checkpointing with early stop does not redo
    a2a: Any = 0.0  # the expert all-to-all, forward + backward (+ the recomputed forward)
    a2a_x: Any = 0.0  # the part of it the layer's compute does not hide

    @property
    def compute(self) -> Any:
        return self.mm_f + self.mm_b + self.attn + self.ew

    @property
    def fwd(self) -> Any:
        """The forward compute a collective can overlap."""
        return self.mm_f + self.attn_f + self.ew_f

    @property
    def bwd(self) -> Any:
        """The backward compute a collective can overlap."""
        return self.mm_b + self.attn - self.attn_f + 2 * self.ew_f


NO_LAYER = LayerTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # the MoE layer of a dense model


@dataclass(frozen=True)
class Gemms:
    """A dense layer's GEMM times (forward, backward), with the parts recomputation redoes."""

    f: Any
    b: Any
    sel: Any  # the software's selective-recompute GEMMs, forward
    up: Any  # MLA up-projections (wq_b, wkv_b), forward (recomputed under sw.recompute_mla_up)
    att_f: Any  # the attention projections alone, forward
    att_b: Any  # ... backward
    att_sel: Any  # ... the selective-recompute ones among them, forward
    last: Any = 0.0  # the layer's last GEMM (the FFN's w2), forward


def dense_gemms(m: ModelSpec, c: Candidates, r: Rates, sw: Software) -> Gemms:
    """Every GEMM of one dense layer at its sharded shape (item 1 of the planner's model)."""
    t_mm_f = t_mm_b = t_sel = t_up = 0.0
    last_att = list(attention_gemm_shapes(m, 1))[-1]
    for name, (k_in, n_out) in layer_gemm_shapes(m, c.tp).items():
        f, b = gemm_train_time(c.tokens, k_in, n_out, r.f_lay, r.hbm, r.sms, r.gap)
        t_mm_f, t_mm_b = t_mm_f + f, t_mm_b + b
        if name in sw.selective_gemms:
            t_sel = t_sel + f
        if name in ("wq_b", "wkv_b"):
            t_up = t_up + f
        if name == last_att:
            t_att_f, t_att_b, t_sel_att = t_mm_f, t_mm_b, t_sel
        if name == "w2":
            t_last = f
    return Gemms(t_mm_f, t_mm_b, t_sel, t_up, t_att_f, t_att_b, t_sel_att, t_last)


def cp_kernel_seq(seq: int, cp: Any) -> Any:
    """The square causal sequence length whose published kernel rate a context-parallel rank's attention runs at:
    seq / cp. A rank holds seq / cp queries in 2 load-balanced chunks of seq / (2 cp) (Llama 3, arXiv 2407.21783
    Sec. 3.3.2: rank i takes chunks i and 2 CP - 1 - i; Megatron-Core's p2p CP, transformer_engine
    context_parallel.py, the same). FlashAttention-2's backward (2.5 of its 3.5 FLOP units) parallelises over key
    blocks and loops over the query blocks (arXiv 2307.08691 Sec. 3.2): a chunk's seq / (2 cp) queries, unmasked
    but for the diagonal block, the same loop as a causal square of seq / cp (whose key block meets seq / (2 cp)
    query rows on average). Ring-style CP runs (seq / cp) x (seq / cp) blocks per step. The key length is long and
    does not shorten the forward's loop; the curve at seq / cp is taken for forward and backward alike."""
    return seq / np.asarray(cp, dtype=float)


def attention_core(m: ModelSpec, c: Candidates, r: Rates, eff: Efficiencies, sw: Software, seq: int) -> tuple[Any, Any]:
    """(forward + backward, forward) of the attention core: fused (FlashAttention, causal halving) or unfused (full
    s x s products and the score traffic)."""
    if sw.attention == "flash":
        attn_train = flops.attention_flops_per_token(m, seq, causal=True) / m.n_layers * c.tokens / c.tp
        # a published kernel curve is scaled from the datasheet peak (the sustained clock is the GEMMs', Rates);
        # under context parallelism the kernel runs at the shapes of one rank's seq / cp queries (``cp_kernel_seq``)
        rate = attention_rate(m, cp_kernel_seq(seq, c.cp), r.peak_attn if r.attn else r.peak_run, eff, r.attn)
        t_attn = attn_train / (rate * sw.attention_speed)
        return t_attn, t_attn * forward_share(r.attn, cp_kernel_seq(seq, c.cp), m.qk_head_dim)
    heads = m.n_heads / c.tp
    rows = c.mb * heads * (seq / c.cp)
    qk_f, qk_b = gemm_train_time(rows, m.head_dim, seq, r.f_mm, r.hbm, r.sms, r.gap)
    av_f, av_b = gemm_train_time(rows, seq, m.head_dim, r.f_mm, r.hbm, r.sms, r.gap)
    score_f, score_b = unfused_score_bytes(m, c, seq, sw.dropout)
    t_attn_f = qk_f + av_f + score_f / r.hbm
    return t_attn_f + qk_b + av_b + score_b / r.hbm, t_attn_f


# HBM passes over the s x s score tensor (bf16 = 1 pass) that an unfused attention's kernels move BEYOND the operands
# of its two batched GEMMs (whose rooflines, gemm_time, already write the scores and read the probabilities).
# Megatron-LM megatron/core/transformer/dot_product_attention.py (as megatron/model/transformer.py CoreAttention in
# 2021-22): baddbmm(beta=0) writes the scores [GEMM], scale_mask_softmax, attention_dropout, bmm with V [GEMM].
# megatron/core/fusions/fused_softmax.py FusedScaleMaskSoftmax -> ScaledUpperTriangMaskedSoftmax /
# ScaledMaskedSoftmax: forward reads the scores, writes the probabilities (2) and saves them; backward reads the
# output grad and the saved probabilities and writes the input grad (3). torch.nn.Dropout (native_dropout): forward
# reads the probabilities, writes the dropped ones and a 1-byte bool mask (2 + 0.5); backward reads the grad and the
# mask and writes the grad (2.5). The V product's backward writes dP and reads the dropped probabilities [GEMM].
SOFTMAX_PASSES = (2.0, 3.0)  # forward (read, write), backward (read grad and saved probabilities, write)
DROPOUT_PASSES = (2.5, 2.5)  # forward (read, write, 1-byte mask), backward (read grad and mask, write)


def unfused_score_bytes(m: ModelSpec, c: Candidates, seq: int, dropout: bool = True) -> tuple[Any, Any]:
    """(forward, backward) HBM bytes of one unfused attention's softmax and dropout (if the software runs it: with
    p = 0 Megatron's attention_dropout is the identity) on one rank: the score tensor (micro-batch x local heads x
    local queries x keys, bf16) times the passes above: 4.5 forward, 5.5 backward with dropout."""
    score = c.mb * (m.n_heads / c.tp) * (seq / c.cp) * seq * ACT_BYTES
    drop = 1.0 if dropout else 0.0
    return ((SOFTMAX_PASSES[0] + drop * DROPOUT_PASSES[0]) * score,
            (SOFTMAX_PASSES[1] + drop * DROPOUT_PASSES[1]) * score)


def hidden_tokens(c: Candidates) -> Any:
    """Tokens of the norm/dropout regions on one rank: sequence parallelism shards them over TP."""
    return np.where(c.sp, c.tokens / c.tp, c.tokens)


def up_projections(m: ModelSpec) -> int:
    """2 when the MLP has a gate and an up projection (SwiGLU), else 1."""
    return 2 if m.mlp == "swiglu" else 1


def dense_layer(m: ModelSpec, c: Candidates, r: Rates, eff: Efficiencies, sw: Software, seq: int,
                g: Gemms) -> LayerTime:
    """One dense layer: its GEMMs ``g``, the attention core, and (item 2) the work between GEMMs (norms,
    residuals, RoPE, dropout, activation) as HBM traffic, the backward moving twice the forward's bytes."""
    t_attn, t_attn_f = attention_core(m, c, r, eff, sw, seq)
    ew_f = ACT_BYTES * (sw.elementwise_passes * hidden_tokens(c) * m.d_model + sw.mlp_act_passes * c.tokens
                        * m.d_ff / c.tp * up_projections(m) / 2) / r.hbm
    return LayerTime(g.f, g.b, t_attn, t_attn_f, ew_f, 3 * ew_f, g.sel, last_f=g.last)


def head_time(m: ModelSpec, c: Candidates, r: Rates) -> Any:
    """The output head's GEMM and the softmax cross-entropy (fp32 logits), forward + backward."""
    hf, hb = gemm_train_time(c.tokens, m.d_model, m.vocab_size / c.tp, r.f_mm, r.hbm, r.sms, r.gap)
    t_loss = c.tokens * m.vocab_size / c.tp * (ACT_BYTES + LOSS_BYTES) * 3 / r.hbm
    return hf + hb + t_loss


# ----------------------------------------------------------------------------- its TP / CP traffic


def layer_bytes(m: ModelSpec, c: Candidates) -> Any:
    """A micro-batch's activations (bf16) at one layer boundary on one rank, before any TP sharding."""
    return c.tokens * m.d_model * ACT_BYTES


def cp_kv_bytes(m: ModelSpec, c: Candidates, seq: int) -> Any:
    """K and V of a micro-batch's whole sequence on one TP rank (bf16): what a CP all-gather assembles."""
    return c.mb * seq * 2 * np.maximum(m.n_kv_heads / c.tp, 1) * m.head_dim * ACT_BYTES


def wgrad_hidden_tp(m: ModelSpec, c: Candidates, r: Rates, one: Any) -> Any:
    """TP traffic of one layer's backward hidden under weight gradients (software knob ``tp_wgrad_overlap``).

    Megatron's column-parallel linear (megatron/core/tensor_parallel/layers.py,
    LinearWithGradAccumulationAndAsyncCommunication.backward; since Megatron-LM v3.0, 2022) launches the reduction
    of its input gradient (the all-reduce, or the reduce-scatter under sequence parallelism) asynchronously right
    after the dgrad GEMM and waits for it after the weight-gradient GEMM dW = X^T dY: each of the layer's two
    column-parallel blocks (the Q/K/V projections; the FFN's w1/w3) hides min(its collective, its dW GEMMs).
    ``one``: one such collective's time. The FFN side only for dense layers (a MoE layer's experts are not
    Megatron linears), the attention side for MLA's up-projections."""
    shapes = layer_gemm_shapes(m, c.tp)
    dw = {name: gemm_time(k_in, c.tokens, n_out, r.f_lay, r.hbm, r.sms, r.gap)
          for name, (k_in, n_out) in shapes.items()}
    att = sum((dw[n] for n in ("wq", "wk", "wv", "wq_b", "wkv_b") if n in dw), start=0.0)
    ffn = 0.0 if m.is_moe else sum((dw[n] for n in ("w1", "w3") if n in dw), start=0.0)
    return np.minimum(one, att) + (np.minimum(one, ffn) if not m.is_moe else 0.0)


def tp_cp_exposed(m: ModelSpec, c: Candidates, topo: comms.Topology, eff: Efficiencies, sw: Software,
                  seq: int, r: Rates | None = None) -> tuple[Any, Any]:
    """(TP, CP) traffic of one layer the compute does not hide, forward + backward (+ the recomputed forward).

    Tensor (+ sequence) parallel: 2 all-gathers + 2 reduce-scatters (or 2 all-reduces) per layer each way
    (Korthikanti et al. 2022 Sec. 4.2.2), less what the backward hides under weight gradients when the software
    does (``wgrad_hidden_tp``; needs the GEMM ``r``ates). Context parallel (Llama 3, arXiv 2407.21783 Sec. 3.3.2):
    all-gather K and V forward; again + reduce-scatter dK, dV backward."""
    act = layer_bytes(m, c)
    bw_tp, lat_tp = comms.link(topo, c.tp, c.tp)
    tp_one_way = np.where(c.sp, 2 * (comms.all_gather_time(act, c.tp, bw_tp, lat_tp)
                                     + comms.reduce_scatter_time(act, c.tp, bw_tp, lat_tp)),
                          2 * comms.all_reduce_time(act, c.tp, bw_tp, lat_tp))
    kv_bytes = cp_kv_bytes(m, c, seq)
    bw_cp, lat_cp = comms.link(topo, c.cp, c.tp * c.cp)
    cp_ag = comms.all_gather_time(kv_bytes, c.cp, bw_cp, lat_cp)
    cp_fwd, cp_bwd = cp_ag, cp_ag + comms.reduce_scatter_time(kv_bytes, c.cp, bw_cp, lat_cp)
    hidden = 0.0
    if sw.tp_wgrad_overlap and r is not None:  # the backward reduction of each column-parallel block's input grad
        one = np.where(c.sp, comms.reduce_scatter_time(act, c.tp, bw_tp, lat_tp),
                       comms.all_reduce_time(act, c.tp, bw_tp, lat_tp))
        hidden = np.where(c.tp > 1, wgrad_hidden_tp(m, c, r, one), 0.0)
    tp_x = (1 - sw.tp_overlap) * ((2 + c.full) * tp_one_way - hidden)
    cp_x = (1 - eff.cp_overlap) * (cp_fwd + cp_bwd + c.full * cp_fwd)
    return tp_x, cp_x


# ----------------------------------------------------------------------------- recomputation


def recompute_time(c: Candidates, lay: LayerTime, sw: Software, knobs: Any = None) -> Any:
    """Recomputation (Korthikanti Sec. 5): full redoes the layer forward (its TP/CP traffic is in
    ``tp_cp_exposed``), less its last GEMM under ``sw.recompute_early_stop`` (``early_stop_skip``); selective redoes
    the attention core (unless ``sw.recompute_attention_core`` is false: torchtitan's op-level SAC saves the SDPA
    output) and the GEMMs the software names (torchtitan: every second one), and then also the element-wise ops
    between them (only saved ops are kept). ``knobs``: the software's memory-saving recomputation
    of a MoE / MLA layer (``recompute_knobs``), None for neither."""
    sel_ew = lay.ew_f if sw.selective_gemms else 0.0
    full = lay.mm_f + lay.attn_f + lay.ew_f - (lay.last_f if sw.recompute_early_stop else 0.0)
    sel_attn = lay.attn_f if sw.recompute_attention_core else 0.0
    t = np.select([c.rc == FULL, c.rc == SELECTIVE], [full, sel_attn + lay.sel + sel_ew], 0.0)
    return t if knobs is None else t + knobs


def recompute_knobs(m: ModelSpec, c: Candidates, r: Rates, sw: Software, g: Gemms) -> Any:
    """A MoE / MLA layer under the software's memory-saving recomputation (DeepSeek-V3 Sec. 3.2.3, 3.3.3), short
    of full recompute (which redoes it all anyway): the MLA up-projection GEMMs forward again, and each RMSNorm's
    forward (read x, write its output: the two layer norms over h, the latent norms over q/kv ranks)."""
    return (g.up if sw.recompute_mla_up else 0.0) + (ACT_BYTES * 2 * (
        2 * hidden_tokens(c) * m.d_model + c.tokens * (m.q_lora_rank + m.kv_lora_rank)) / r.hbm
        if sw.recompute_norms else 0.0)
