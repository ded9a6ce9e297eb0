"""Memory: training state (ZeRO), activations (Korthikanti et al. 2022), KV cache.

Symbols follow Korthikanti et al. 2022 (arXiv 2205.05198): s sequence length, b micro-batch size,
h hidden size, a attention heads, t tensor-parallel size, p pipeline stages, L layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import ceil
from typing import Any

import numpy as np

from trainscale.specs import ModelSpec

# Rajbhandari et al. 2020, ZeRO (arXiv 1910.02054) Sec. 3.1: mixed-precision Adam keeps 2 bytes of
# fp16/bf16 weights, 2 bytes of gradients and K = 12 bytes of fp32 master weights + momentum + variance.
WEIGHT_BYTES = 2
GRAD_BYTES = 2
ADAM_BYTES = 12


@dataclass(frozen=True)
class StateBytes:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def _out(x: Any) -> Any:
    """Plain float for scalar inputs, the array for array inputs (the planner passes numpy arrays)."""
    return float(x) if np.ndim(x) == 0 else x


def training_state_bytes(n_params: float, weight_bytes: float = WEIGHT_BYTES, grad_bytes: float = GRAD_BYTES,
                         optimizer_bytes: float = ADAM_BYTES) -> StateBytes:
    """(2 + 2 + K)·Ψ with K = 12 for mixed-precision Adam: 16 bytes/param (ZeRO, Sec. 3.1)."""
    return StateBytes(weight_bytes * n_params, grad_bytes * n_params, optimizer_bytes * n_params)


def zero_state_bytes_per_gpu(n_params: Any, dp: Any, zero: Any, weight_bytes: float = WEIGHT_BYTES,
                             grad_bytes: float = GRAD_BYTES, optimizer_bytes: float = ADAM_BYTES) -> StateBytes:
    """Per-GPU model state under ZeRO stage 0-3 over ``dp`` ranks (ZeRO Sec. 5, Fig. 1):

    stage 1 shards the optimizer (P_os), stage 2 also the gradients (P_os+g), stage 3 (= FSDP) also
    the weights (P_os+g+p). ``n_params`` is what this rank's model-parallel slice holds. Scalars or
    numpy arrays.
    """
    zero = np.asarray(zero)
    w = weight_bytes * n_params / np.where(zero >= 3, dp, 1)
    g = grad_bytes * n_params / np.where(zero >= 2, dp, 1)
    o = optimizer_bytes * n_params / np.where(zero >= 1, dp, 1)
    return StateBytes(_out(w), _out(g), _out(o))


def gpus_to_hold(total_bytes: float, gpu_memory_bytes: float) -> int:
    """Fewest GPUs whose combined memory holds ``total_bytes`` (ignoring everything else)."""
    return ceil(total_bytes / gpu_memory_bytes)


# ----------------------------------------------------------------------- activations (Korthikanti)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str = "none") -> float:
    """Activation memory of one transformer layer, bytes (Korthikanti et al. 2022, Table 2).

    no parallelism:             sbh(34 + 5as/h)
    tensor parallel:            sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel: sbh/t · (34 + 5as/h)
    tensor + selective recompute:         sbh(10 + 24/t)
    tensor + sequence + selective recompute: sbh · 34/t
    full recompute:             2sbh (only the layer input is kept; /t with sequence parallel)
    """
    sbh = s * b * h
    attn = 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective":
        return sbh * 34 / t if sp else sbh * (10 + 24 / t)
    if recompute != "none":
        raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def interleave_factor(p: Any, v: Any) -> Any:
    """First-stage activation factor of interleaved 1F1B: 1 + (p-1)/(p·v) (Korthikanti Sec. 4.2.3)."""
    p, v = np.asarray(p, dtype=float), np.asarray(v, dtype=float)
    return _out(np.where(v > 1, 1.0 + (p - 1) / (p * np.maximum(v, 1)), 1.0))


def first_stage_activation_bytes(m: ModelSpec, s: Any, b: Any, t: Any = 1, p: Any = 1, sp: bool = False,
                                 recompute: str = "none", v: Any = 1, schedule: str = "1f1b",
                                 n_microbatches: Any = 1, cp: Any = 1, layers: Any = None) -> Any:
    """Activations held on the first pipeline stage, the most loaded one (Korthikanti Sec. 4.2.3).

    1F1B keeps p micro-batches in flight on stage 1, each through L/p layers: L · per-layer in total,
    times the interleaving factor; GPipe keeps all m micro-batches. Context parallelism splits the
    sequence, so each rank holds s/cp of it. ``layers`` overrides L/p when the first stage holds a
    different share (Llama 3 gives it one layer fewer). Scalars or numpy arrays (the planner's search).
    """
    per_layer = activation_bytes_per_layer(np.asarray(s) // cp, b, m.d_model, m.n_heads, t, sp, recompute)
    layers_per_stage = m.n_layers / np.asarray(p, dtype=float) if layers is None else layers
    n_mb = np.asarray(n_microbatches)
    if schedule == "gpipe":
        in_flight = n_mb
    else:
        in_flight = np.where(n_mb > 0, np.minimum(p, n_mb), p)
    return _out(per_layer * layers_per_stage * in_flight * interleave_factor(p, v))


def kv_cache_bytes_per_token(m: ModelSpec, bytes_per_value: float = 2) -> float:
    """KV cache per token: 2 (K and V) · L · n_kv_heads · head_dim · bytes (GQA: Ainslie et al. 2023)."""
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * bytes_per_value


def kv_cache_bytes(m: ModelSpec, tokens: int, batch: int = 1, bytes_per_value: float = 2) -> float:
    return kv_cache_bytes_per_token(m, bytes_per_value) * tokens * batch


# ------------------------------------------------- activations of MoE and MLA layers, from the shapes

ACT = 2  # a bf16 activation value (Korthikanti et al. 2022 Sec. 4.1)
ROUTER_BYTES = 4  # fp32 router scores / gate weights (DeepEP dispatch carries float32 top-k weights)


@dataclass(frozen=True)
class ActivationCaching:
    """What a MoE / MLA layer keeps for its backward, as the software's knobs say (catalog/software.toml).

    Bytes per element of the cached Linear inputs (Wgrad operands), of the attention output (saved by the
    attention kernel and read by the output projection) and of a MoE SwiGLU's inputs; which cheap forward
    pieces are recomputed instead of kept (RMSNorm outputs, the MLA up-projections, the SwiGLU output); whether
    the combine weights the expert outputs by the gate (and so keeps them) or the gate is applied on the expert
    side and the combine is a plain sum (DeepEP)."""

    linear_input_bytes: float = ACT
    attn_out_bytes: float = ACT
    swiglu_input_bytes: float = ACT
    recompute_norms: bool = False
    recompute_mla_up: bool = False
    recompute_swiglu_output: bool = False
    weighted_combine: bool = True
    dropout: bool = False  # the layer runs dropout (two 1-byte masks kept): the software's knob


def _sp_div(t: Any, sp: Any) -> Any:
    """The divisor of a sequence-parallel region: t under sequence parallelism, 1 otherwise."""
    return np.where(sp, t, 1)


def mha_attention_bytes_per_token(h: int, t: Any, sp: Any) -> Any:
    """Korthikanti Table 2's attention terms that an MLA count replaces, per token: the QKV input 2h (sequence-
    parallel region) and Q, K, V and the output-projection input 8h/t (the softmax/score terms 5as/h stay)."""
    return 2 * h / _sp_div(t, sp) + 8 * h / t


def mla_attention_bytes_per_token(m: ModelSpec, t: Any, sp: Any, c: ActivationCaching) -> Any:
    """Multi-head latent attention's saved activations per token on one TP rank (DeepSeek-V2, arXiv 2405.04434
    Sec. 2.1; shapes from the ModelSpec): the down-projections' input (the normed x), the query latent c_q and
    the key-value latent c_kv with the shared rope key (norm inputs), their normed copies (up-projection
    inputs), the up-projected q, k (H x (nope + rope)) and v (H x v) the fused attention kernel keeps, its output
    O (H x v, also the output projection's input) and its fp32 log-sum-exp (H). Heads split over TP, latents
    whole on every rank."""
    heads = m.n_heads / np.asarray(t, dtype=float)
    lin, keep_norm = c.linear_input_bytes, 0.0 if c.recompute_norms else 1.0
    x_norm = keep_norm * lin * m.d_model / _sp_div(t, sp)
    latents = ACT * (m.kv_lora_rank + m.qk_rope_head_dim) + keep_norm * lin * m.kv_lora_rank
    if m.q_lora_rank:
        latents = latents + ACT * m.q_lora_rank + keep_norm * lin * m.q_lora_rank
    qkv = 0.0 if c.recompute_mla_up else ACT * heads * (2 * m.qk_head_dim + m.value_head_dim)
    out = c.attn_out_bytes * heads * m.value_head_dim + 4 * heads
    return x_norm + latents + qkv + out


def ffn_bytes_per_token(m: ModelSpec, t: Any, width: int, act_input_bytes: float, recompute_act_output: bool,
                        c: ActivationCaching) -> Any:
    """A dense FFN of ``width`` on one TP rank, per token, its input apart: the activation's inputs (w1 and w3
    outputs under SwiGLU, w1's otherwise) and its output (w2's input, a cached Linear input) unless recomputed."""
    ups = 2 if m.mlp == "swiglu" else 1
    return width / np.asarray(t, dtype=float) * (ups * act_input_bytes
                                                 + (0.0 if recompute_act_output else c.linear_input_bytes))


def moe_ffn_bytes_per_token(m: ModelSpec, t: Any, imbalance: float, c: ActivationCaching) -> Any:
    """A MoE layer's feed-forward activations per token on the busiest EP rank (each TP rank routes its own
    tokens/t): router scores (fp32, n_experts); per routed copy (top-k x imbalance) the dispatched row (the
    experts' w1/w3 input), the expert's SwiGLU inputs and output, and what the combine keeps (the expert output
    when it weights by the gate, else the fp32 gate weight the dispatch carried); the shared expert as a dense
    FFN. The layer's input (the normed x) is Korthikanti's fc1 input and stays there."""
    rows = m.experts_per_token * imbalance / np.asarray(t, dtype=float)
    per_row = (c.linear_input_bytes * m.d_model
               + (ACT * m.d_model if c.weighted_combine else ROUTER_BYTES)
               + ffn_bytes_per_token(m, 1, m.expert_width, c.swiglu_input_bytes, c.recompute_swiglu_output, c))
    shared = ffn_bytes_per_token(m, t, m.d_ff_shared, c.swiglu_input_bytes, c.recompute_swiglu_output, c) \
        if m.d_ff_shared else 0.0
    return rows * per_row + shared + ROUTER_BYTES * m.n_experts / np.asarray(t, dtype=float)


def gqa_attention_delta_bytes_per_token(m: ModelSpec, t: Any) -> Any:
    """What a grouped-query attention layer with a fused kernel keeps beyond Korthikanti's MHA terms, per token on
    one TP rank: K and V at the KV width (n_kv_heads x head_dim, replicated when TP exceeds the KV heads) in place
    of h each, and the kernel's fp32 log-sum-exp per local head (FlashAttention-2, arXiv 2307.08691 Alg. 1-2: the
    backward needs Q, K, V, O and L)."""
    t = np.asarray(t, dtype=float)
    kv = np.maximum(m.n_kv_heads / t, 1) * m.head_dim
    return ACT * 2 * (kv - m.d_model / t) + 4 * m.n_heads / t


def shaped_layer_delta_bytes_per_token(m: ModelSpec, moe_layer: bool, t: Any, sp: Any, imbalance: float,
                                       c: ActivationCaching) -> Any:
    """What a layer keeps per token beyond (or short of) Korthikanti's dense count (``activation_bytes_per_layer``
    / (s·b)), which assumes MHA with Q, K, V of width h, a 4h GeLU MLP and dropout, from the layer's own tensors:

    - MLA: the MHA terms (``mha_attention_bytes_per_token``) out, ``mla_attention_bytes_per_token`` in; GQA/MHA:
      K and V at their own width and the kernel's log-sum-exp (``gqa_attention_delta_bytes_per_token``); under
      recompute_norms a non-MLA attention drops its QKV input (the normed x, recomputed)
    - FFN: the 4h MLP's 16h/t out; the MoE FFN (``moe_ffn_bytes_per_token``) or the dense SwiGLU/GeLU FFN of
      d_ff in (a SwiGLU keeps w1 and w3 outputs and w2's input: 3 x d_ff, Llama's 14,336 or 53,248 not 4h); under
      recompute_norms its input (the normed x, Korthikanti's fc1 input 2h) recomputed
    - dropout: Korthikanti's two 1-byte masks (sbh each) out unless the software runs dropout (Llama 3, Mixtral,
      DeepSeek-V3 and torchtitan's Llama train without it; Megatron's GPT defaults --hidden-dropout 0.1)
    """
    h, t = m.d_model, np.asarray(t, dtype=float)
    norm_in = 2 * h / _sp_div(t, sp)  # a normed x, Korthikanti's QKV or fc1 input
    if m.attention == "mla":
        attn = mla_attention_bytes_per_token(m, t, sp, c) - mha_attention_bytes_per_token(h, t, sp)
    else:
        attn = gqa_attention_delta_bytes_per_token(m, t) - (norm_in if c.recompute_norms else 0.0)
    if moe_layer:
        ffn = moe_ffn_bytes_per_token(m, t, imbalance, c)
    else:
        ffn = ffn_bytes_per_token(m, t, m.d_ff, ACT, False, c)
    ffn = ffn - 16 * h / t - (norm_in if c.recompute_norms else 0.0)
    masks = 0.0 if c.dropout else 2 * h / _sp_div(t, sp)  # Korthikanti's two dropout masks (1 byte each)
    return attn + ffn - masks
