"""Training compute: how many FLOPs, how long on what, and utilization."""

from __future__ import annotations

from trainscale.estimate.params import active_params, expert_tensors, layer_params, mtp_block_extra, numel
from trainscale.specs import ModelSpec

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
SECONDS_PER_YEAR = 365.25 * SECONDS_PER_DAY


def forward_flops_per_token(n_params: float) -> float:
    """2 FLOPs per parameter per token: one multiply + one add (Kaplan et al. 2020, Sec. 2.1)."""
    return 2.0 * n_params


def backward_flops_per_token(n_params: float) -> float:
    """4 FLOPs per parameter per token: gradients w.r.t. activations and weights (Kaplan et al. 2020)."""
    return 4.0 * n_params


def training_flops(n_params: float, tokens: float) -> float:
    """C = 6ND (Kaplan et al. 2020 arXiv 2001.08361 Sec. 2.1; Hoffmann et al. 2022 arXiv 2203.15556)."""
    return (forward_flops_per_token(n_params) + backward_flops_per_token(n_params)) * tokens


def attention_flops_per_token(m: ModelSpec, seq_len: int, causal: bool = False) -> float:
    """12·L·H·Q·T training FLOPs per token for attention scores (PaLM, arXiv 2204.02311 App. B).

    The score product QK^T runs over the query/key head width and the value product over the value width, so
    the general form is 6·L·H·T·(d_qk + d_v): 12·L·H·Q·T when both are the head dim Q; under multi-head latent
    attention (DeepSeek-V2, arXiv 2405.04434 Sec. 2.1) d_qk = head_dim + the decoupled RoPE dim (192 for
    DeepSeek-V3) and d_v = v_head_dim (128). With ``causal`` the score and value matmuls skip the masked half.
    """
    if m.attention == "mla":
        full = 6.0 * m.n_layers * m.n_heads * (m.qk_head_dim + m.value_head_dim) * seq_len
    else:
        full = 12.0 * m.n_layers * m.n_heads * m.head_dim * seq_len
    return full / 2 if causal else full


def model_flops_per_token(m: ModelSpec, n_params: float, seq_len: int, causal: bool = False) -> float:
    """6N + 12·L·H·Q·T (PaLM, arXiv 2204.02311 App. B): the FLOPs MFU counts per trained token."""
    return 6.0 * n_params + attention_flops_per_token(m, seq_len, causal)


# The one FLOP convention of every training-compute figure trainscale prints (explain, plan, report, the runtime's
# MFU): PaLM's model FLOPs (arXiv 2204.02311 App. B) with N the matmul weights (``matmul_params``) and the attention
# term halved for causal masking (a fused causal kernel skips the masked half: FlashAttention-2, arXiv 2307.08691
# Sec. 3.1.1). Published runs read in their own conventions live in estimate/planner/validate.py CONVENTIONS.
FLOP_CONVENTION_NAME = "6N + 6LHQT"
FLOP_CONVENTION = ("6N + 6LHQT: N the matmul weights a token passes through (active ones for a MoE; LM head in, "
                   "input embedding out), + 12·L·H·Q·T attention halved for causal masking; multi-token-prediction "
                   "modules in both terms, as Megatron-Core counts them")


def matmul_params(m: ModelSpec) -> int:
    """N for the FLOP convention: every weight in a matmul a token passes through. The input embedding is a lookup
    (no multiply-adds); a tied output head still runs its V x d GEMM, so tied models count it once. A MoE counts
    its ACTIVE parameters (``params.active_params``: the router and shared experts in full, top-k of the routed
    experts), so FLOPs per token follow the active count and training state the total."""
    tied_head = m.vocab_size * m.d_model if m.tied_embeddings else 0
    return active_params(m, embeddings=False) + tied_head


def mtp_matmul_params(m: ModelSpec) -> int:
    """Matmul weights a token passes through in the multi-token-prediction modules (DeepSeek-V3 Sec. 2.2): per module
    its block's active weights (top-k of the routed experts), the projection M_k and the shared output head, which
    each module runs again. Counted in FLOP_CONVENTION as Megatron-Core's num_floating_point_operations does
    (megatron/training/training.py: the MTP layers added to the layer counts, "MTP norms and proj", logits x
    (mtp_num_layers + 1)); ``matmul_params`` and the parameter counts stay the main model's, as DeepSeek counts
    671B / 37B activated without the MTP module (HF deepseek-ai/DeepSeek-V3 README)."""
    if not m.mtp_layers:
        return 0
    last = m.n_layers - 1
    routed = numel(expert_tensors(m, last)) if m.is_moe_layer(last) else 0
    block = layer_params(m, last) - routed + (routed * m.experts_per_token // m.n_experts if routed else 0)
    return m.mtp_layers * (block + mtp_block_extra(m) + m.vocab_size * m.d_model)


def training_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token under FLOP_CONVENTION: 6·matmul_params + the causal attention term at ``seq_len``,
    with the multi-token-prediction modules' own (``mtp_matmul_params``, one attention layer each)."""
    mtp_attn = attention_flops_per_token(m, seq_len, causal=True) * m.mtp_layers / m.n_layers
    return model_flops_per_token(m, matmul_params(m) + mtp_matmul_params(m), seq_len, causal=True) + mtp_attn


def training_compute(m: ModelSpec, tokens: float, seq_len: int) -> float:
    """Training FLOPs of ``tokens`` tokens in sequences of ``seq_len`` under FLOP_CONVENTION (C = per token x D,
    Kaplan et al. 2020 Sec. 2.1 with PaLM App. B's attention term)."""
    return training_flops_per_token(m, seq_len) * tokens


def recompute_flops_per_token(m: ModelSpec, n_params: float, seq_len: int, mode: str,
                              causal: bool = False) -> float:
    """Extra forward FLOPs per token that activation recomputation adds (counted in HFU, not MFU).

    full: one more forward of every layer (2N + the attention forward, 1/3 of its training cost);
    selective: only the attention core softmax(QK^T)V is recomputed (Korthikanti et al. 2022,
    arXiv 2205.05198 Sec. 5), i.e. the forward part of the attention term.
    """
    attn_fwd = attention_flops_per_token(m, seq_len, causal) / 3.0
    if mode == "full":
        return forward_flops_per_token(n_params) + attn_fwd
    if mode == "selective":
        return attn_fwd
    return 0.0


def mfu(tokens_per_s: float, flops_per_token: float, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization: model FLOPs achieved / peak (Chowdhery et al. 2022, PaLM App. B)."""
    return tokens_per_s * flops_per_token / (n_gpus * peak_flops)


def hfu(tokens_per_s: float, flops_per_token: float, recompute_per_token: float, n_gpus: int,
        peak_flops: float) -> float:
    """Hardware FLOPs utilization: like MFU but counting recomputed FLOPs too (PaLM App. B)."""
    return tokens_per_s * (flops_per_token + recompute_per_token) / (n_gpus * peak_flops)


def seconds_on(total_flops: float, n_gpus: int, peak_flops: float, utilization: float = 1.0) -> float:
    """Wall time = FLOPs / (GPUs x peak x utilization)."""
    return total_flops / (n_gpus * peak_flops * utilization)


def days_from_gpu_hours(gpu_hours: float, n_gpus: int) -> float:
    """Calendar days if ``n_gpus`` ran the whole time: GPU-hours / GPUs / 24."""
    return gpu_hours / n_gpus / 24.0


def gpu_hours(total_flops: float, peak_flops: float, utilization: float) -> float:
    """GPU-hours for a job at a given utilization."""
    return total_flops / (peak_flops * utilization) / SECONDS_PER_HOUR


def gpus_for_target(total_flops: float, days: float, peak_flops: float, utilization: float) -> float:
    """GPUs needed to finish in ``days`` at ``utilization``: C / (days x 86400 x peak x MFU)."""
    return total_flops / (days * SECONDS_PER_DAY * peak_flops * utilization)


def compute_growth(flops_now: float, years: float, factor_per_year: float) -> float:
    """Frontier training compute after ``years`` growing ``factor_per_year`` (Epoch AI 2024: 4-5x/yr)."""
    return flops_now * factor_per_year**years
