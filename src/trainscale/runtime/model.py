"""A Llama-style (or GPT-style) decoder built from a ModelSpec, readable in one sitting.

Parameter names equal ``estimate.params.tensor_inventory(spec)`` one for one, so the estimator's
count is checkable against the real module. Parallelism is applied from outside (runtime/
parallelize.py): this file only knows the math. Two hooks make that possible without touching
the math here:

- ``Attention.core`` is the attention kernel ``core(q, k, v) -> out`` on [batch, heads, seq, dim];
  context parallelism replaces it with one that gathers K/V across the cp group.
- ``Transformer.forward(tokens, positions=None)`` takes the positions of the local tokens, so a
  rank that holds a (load-balanced) slice of the sequence rotates by the right angles. Positions [b, s] (one
  row per sequence) pack documents: each document's positions restart at 0, RoPE rotates by them, and a token
  attends only to earlier tokens of its own document (``document_mask``, block-diagonal and causal).
- A MoE model's layers from ``first_dense_layers`` on hold ``moe`` (runtime/moe.py: router, routed
  experts, shared expert, the balance loss) instead of ``feed_forward``; expert parallelism sets its
  groups from outside too. Multi-head latent attention is planner-only (``rules.check_model``).
- ``Transformer.forward(tokens, cache=KVCache(...))`` is inference's path (infer/generate.py): the
  tokens follow the cached positions, their K/V are appended and the same attention attends over all.
Head counts are inferred from tensor shapes (``view(b, s, -1, head_dim)``), so a tensor-parallel
shard that holds n_heads / tp heads runs unchanged.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainscale.errors import TrainscaleError
from trainscale.rules import check_model
from trainscale.runtime.moe import FFN, MoE
from trainscale.runtime.weights import Box, local_box
from trainscale.specs import ModelSpec


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019, arXiv 1910.07467). ``offset``: the gain is 1 + g,
    applied in fp32 before the cast (Gemma's GemmaRMSNorm in transformers)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight


class ProjectionNorm(nn.Module):
    """OLMo-2's q_norm / k_norm (transformers' Olmo2RMSNorm over the whole projection, all heads together, the gain
    applied in fp32 before the cast): x / sqrt(sum(x^2) / dim + eps) * g. Under tensor parallelism a rank holds its
    heads' features and their rows of g (a DTensor sharded on dim 0, as the projection's rows are): the sum of
    squares is all-reduced over ``group`` (set by runtime/parallel/parallelize.py), whose backward all-reduces
    the gradient, so every rank divides by the whole projection's norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.group = None
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.group is not None:
            from torch.distributed.nn.functional import all_reduce

            squares = all_reduce(squares, group=self.group)
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return (w * (xf * torch.rsqrt(squares / self.dim + self.eps))).to(x.dtype)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.d_model, spec.norm_eps, spec.norm_offset)
    return nn.LayerNorm(spec.d_model, eps=spec.norm_eps)


def rope_frequencies(spec: ModelSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies theta^(-2i/d) (Su et al. 2021, arXiv 2104.09864), computed as transformers'
    modeling_rope_utils does (1 / theta^(2i/d) in fp32), then scaled by ``spec.rope_scaling``: "linear" divides
    each by rope_factor (_compute_linear_scaling_rope_parameters); "yarn" (``yarn_frequencies``); "llama3" (Meta's
    Llama 3.1 apply_scaling, _compute_llama3_parameters) divides those of wavelength above L/low_freq_factor by the
    factor, keeps those below L/high_freq_factor and blends in between (L: rope_original_max_len)."""
    hd = spec.head_dim
    pos = spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd)
    inv = 1.0 / pos
    if spec.rope_scaling == "linear":
        return inv / spec.rope_factor
    if spec.rope_scaling == "yarn":
        return yarn_frequencies(spec, pos)
    if spec.rope_scaling != "llama3":
        return inv
    factor, lo, hi, old = (spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor,
                           spec.rope_original_max_len)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, blended, scaled)


def yarn_frequencies(spec: ModelSpec, pos: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, arXiv 2309.00071, "NTK-by-parts"; transformers'
    _compute_yarn_parameters, same fp32 operations): dims that turn fewer than beta_slow times over the original
    length L take inv / factor, those turning more than beta_fast times keep inv, a linear ramp between. The
    dim of r turns is d ln(L / (2 pi r)) / (2 ln theta), rounded outward when ``rope_truncate``. ``pos``:
    theta^(2i/d) in fp32 (transformers' pos_freqs)."""
    hd, factor, base, old = spec.head_dim, spec.rope_factor, spec.rope_theta, spec.rope_original_max_len

    def dim_of(turns: float) -> float:
        return hd * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(spec.rope_beta_fast), dim_of(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos.device)
    keep = 1 - ramp  # 1: the dim keeps theta^(-2i/d) (extrapolates), 0: it is divided by the factor (interpolates)
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep


def rope_scale(spec: ModelSpec) -> float:
    """What RoPE's cos and sin are multiplied by: 1, or YaRN's attention factor, given or 0.1 ln(factor) + 1
    (YaRN eq. 21; transformers' yarn_get_mscale, 1 for a factor <= 1)."""
    if spec.rope_scaling != "yarn":
        return 1.0
    if spec.rope_attention_factor is not None:
        return spec.rope_attention_factor
    return 1.0 if spec.rope_factor <= 1 else 0.1 * math.log(spec.rope_factor) + 1.0


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float, inv: torch.Tensor | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's rotation angles pos * inv_freq: ``inv`` (``rope_frequencies``), else unscaled
    theta^(-2i/d) for ``head_dim``, times ``scale`` (``rope_scale``). Positions [s] -> [s, d/2]; [b, s] (packed
    documents) -> [b, s, d/2]."""
    if inv is None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                               / head_dim))
    ang = positions.float()[..., None] * inv.to(positions.device)
    if scale != 1.0:
        return ang.cos() * scale, ang.sin() * scale
    return ang.cos(), ang.sin()


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """positions [b, s] of packed documents (each restarting at 0) -> the attention mask [b, 1, s, s]: query i
    sees key j iff j <= i and both are in the same document (block-diagonal causal)."""
    doc = torch.cumsum(positions == 0, dim=1)  # [b, s]: which document of the row each token is in
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, h, d] by the angles for their positions."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    if cos.ndim == 3:  # a position per sequence and token (packed documents): [b, s, d/2]
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    else:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


# SDPA's kernel order on CUDA: cuDNN attention first, then flash, then memory-efficient, then math, each taken only
# where it serves the call (torch.nn.attention.sdpa_kernel(backends, set_priority=True), where this torch has
# set_priority). It is torchtitan's order (models/attention.py, ScaledDotProductAttentionWrapper: [CUDNN_ATTENTION,
# FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH] with set_priority=True). The PyTorch 2.5 release notes introduce the
# cuDNN backend as faster than FlashAttention-2 on H100, so it leads on Hopper (sm90) and newer; older GPUs keep
# torch's own order (flash first). The CPU is never wrapped: its results are those of a plain SDPA call.
SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention, on a CUDA GPU of compute capability >= 9 (Hopper) in ``SDPA_PRIORITY``'s
    kernel order (torch.compile folds get_device_properties to a constant and traces sdpa_kernel)."""
    if _HAS_PRIORITY and q.is_cuda and torch.cuda.get_device_properties(q.device).major >= 9:
        with sdpa_kernel(SDPA_PRIORITY, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [b, kv_heads, t, d] with each head repeated for its group of query heads (GQA) -> [b, heads, t, d]."""
    if k.shape[1] == q.shape[1]:
        return k, v
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + causal mask) V on [b, h, s, d]; K/V may hold fewer heads (GQA). With a KV
    cache K/V hold t >= s positions and the queries are the last s of them: query j sees keys 0..t-s+j.
    ``window`` > 0: a query sees only the last ``window`` keys, itself included (Mistral's sliding window,
    transformers' masking_utils.sliding_window_overlay: kv_idx > q_idx - window). ``mask`` [b, 1, s, s]
    (packed documents, ``document_mask``): what each query may see instead of the causal mask.

    GQA: a call without a mask hands SDPA the K/V heads as they are (``enable_gqa=True``, torch >= 2.5: the flash
    and cuDNN kernels read each K/V head for its group, no copy); a call with a mask repeats them first, since
    with a mask SDPA's GQA runs on the math kernel on CUDA (transformers' integrations/sdpa_attention.py,
    use_gqa_in_sdpa: only without a mask, head dim <= 256) while the memory-efficient kernel takes the repeated
    heads and the mask. Both forms agree to 1e-6 in fp32 (tests/test_runtime_attention.py)."""
    s, t = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1] and q.shape[-1] <= 256
    if mask is not None:
        if window and window < t:
            i = torch.arange(t - s, t, device=q.device)[:, None]
            mask = mask & (torch.arange(t, device=q.device)[None, :] > i - window)
        return sdpa(q, *repeat_kv(q, k, v), attn_mask=mask)
    if window and window < t:
        i = torch.arange(t - s, t, device=q.device)[:, None]
        j = torch.arange(t, device=q.device)[None, :]
        return sdpa(q, *repeat_kv(q, k, v), attn_mask=(j <= i) & (j > i - window))
    if s == t:
        return sdpa(q, k, v, is_causal=True, enable_gqa=True) if gqa else sdpa(q, *repeat_kv(q, k, v), is_causal=True)
    if s == 1:  # one new token sees every cached key
        return sdpa(q, k, v, enable_gqa=True) if gqa else sdpa(q, *repeat_kv(q, k, v))
    mask = torch.arange(t, device=q.device)[None, :] <= torch.arange(t - s, t, device=q.device)[:, None]  # [s, t]
    return sdpa(q, *repeat_kv(q, k, v), attn_mask=mask)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, scale: float | None = None,
                    softcap: float = 0.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_attention`` with the scores written out, for what SDPA does not do: scores scaled by ``scale``
    and soft-capped, s -> c tanh(s / c), before the mask and an fp32 softmax (Gemma 2; transformers'
    modeling_gemma2.eager_attention_forward)."""
    k, v = repeat_kv(q, k, v)
    s, t = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(t - s, t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    seen = (j <= i) & (j > i - window) if window else j <= i
    if mask is not None:  # packed documents: [b, 1, s, t]
        seen = seen & mask
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def attention_core(spec: ModelSpec, layer: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Layer ``layer``'s attention kernel: SDPA (``causal_attention``) with the sliding window where it applies
    (``window_layers``), or ``eager_attention`` for soft-capped or rescaled scores."""
    window = spec.sliding_window if spec.window_layers is None or layer in spec.window_layers else 0
    if spec.attn_softcap or spec.query_scale:
        return functools.partial(eager_attention, window=window, softcap=spec.attn_softcap,
                                 scale=spec.query_scale ** -0.5 if spec.query_scale else None)
    return functools.partial(causal_attention, window=window) if window else causal_attention


class KVCache:
    """Keys and values of every layer for the positions so far, preallocated for ``capacity`` positions of
    ``batch`` sequences: [L, batch, n_kv_heads, capacity, head_dim] each, so its bytes are exactly
    ``estimate.memory.kv_cache_bytes`` (2 · L · n_kv_heads · head_dim · bytes per value per token)."""

    def __init__(self, spec: ModelSpec, batch: int, capacity: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        shape = (spec.n_layers, batch, spec.n_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # positions cached; Transformer.forward advances it after all layers

    @property
    def nbytes(self) -> int:
        """Bytes of the real K and V tensors."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def next_positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Positions [seq] of ``seq`` tokens that follow the cached ones."""
        if self.length + seq > self.capacity:
            raise TrainscaleError(f"the KV cache holds {self.capacity} positions; {self.length + seq} were asked for")
        return torch.arange(self.length, self.length + seq, device=device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``layer``'s k, v [b, kv_heads, s, d] after the cached positions -> all its keys and values
        [b, kv_heads, length + s, d], as stored (in the cache's dtype), in k's dtype."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k.to(self.k.dtype)
        self.v[layer, :, :, self.length:end] = v.to(self.v.dtype)
        return self.k[layer, :, :, :end].to(k.dtype), self.v[layer, :, :, :end].to(v.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        d, b = spec.d_model, spec.bias
        qkv_b = b or spec.qkv_bias  # Qwen2: biases on Q, K, V only
        self.head_dim = spec.head_dim
        self.rope = spec.positions == "rope"
        self.wq = nn.Linear(d, spec.q_dim, bias=qkv_b)
        self.wk = nn.Linear(d, spec.kv_dim, bias=qkv_b)
        self.wv = nn.Linear(d, spec.kv_dim, bias=qkv_b)
        self.wo = nn.Linear(spec.q_dim, d, bias=b)
        self.whole_qk_norm = spec.qk_norm and spec.qk_norm_whole
        if self.whole_qk_norm:  # OLMo-2: an RMSNorm over the whole Q projection and one over K's, before RoPE
            self.q_norm = ProjectionNorm(spec.q_dim, spec.norm_eps)
            self.k_norm = ProjectionNorm(spec.kv_dim, spec.norm_eps)
        elif spec.qk_norm:  # Qwen3: an RMSNorm over each head's query and key, before RoPE
            self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps, spec.norm_offset)
        self.core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = attention_core(spec, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, d] -> [b, s, d]; with ``cache``, x's K/V join layer ``layer``'s cached ones first; ``mask``
        (packed documents): who sees whom."""
        bsz, seq, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, seq, -1, self.head_dim)
        k = k.view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if hasattr(self, "q_norm") and not self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, head_dim]
        if cache is not None:
            k, v = cache.append(layer, k, v)  # [b, kv_heads, cached + s, head_dim]
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(FFN):
    """The dense feed-forward of width d_ff (SwiGLU or GELU, runtime/moe.py's FFN; GeGLU, Gemma's
    w2(gelu_tanh(w1 x) * w3 x), Shazeer 2020, arXiv 2002.05202, with ``gate_act`` "gelu_tanh")."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec, spec.d_ff)
        self.geglu = self.gated and spec.gate_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.geglu:
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        return super().forward(x)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(x)); the ffn is ``moe`` (runtime/moe.py)
    in a MoE model's layers from ``first_dense_layers`` on, else ``feed_forward``. Gemma 2 norms the sub-layers'
    outputs too (``sandwich_norms``); OLMo-2 norms only them (``post_norms``): x + norm(attn(x)), + norm(ffn(x))."""

    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        if not spec.post_norms:  # OLMo-2 norms the sub-layers' outputs only
            self.attention_norm = make_norm(spec)
        self.attention = Attention(spec, layer)
        if not spec.post_norms:
            self.ffn_norm = make_norm(spec)
        if spec.sandwich_norms or spec.post_norms:  # Gemma 2 (and OLMo-2): the sub-layers' outputs normed
            self.attention_post_norm = make_norm(spec)
            self.ffn_post_norm = make_norm(spec)
        if spec.is_moe_layer(layer):
            self.moe = MoE(spec)
        else:
            self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        # the cache and mask as keywords: tensor parallelism prepares the positional inputs (x, cos, sin) only
        pre = hasattr(self, "attention_norm")
        a = self.attention(self.attention_norm(x) if pre else x, cos, sin, cache=cache, layer=layer, mask=mask)
        x = x + (self.attention_post_norm(a) if hasattr(self, "attention_post_norm") else a)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        f = ffn(self.ffn_norm(x) if pre else x)
        return x + (self.ffn_post_norm(f) if hasattr(self, "ffn_post_norm") else f)


class Transformer(nn.Module):
    """Decoder-only LM. ``layers`` is a ModuleDict keyed "0".."L-1" so a pipeline stage can drop
    the layers it does not own (and the embeddings / head) and keep the original names."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(spec.max_seq_len, spec.d_model) if spec.positions == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.n_layers)})
        self.norm: nn.Module | None = make_norm(spec)
        self.output: nn.Module | None = (
            None if spec.tied_embeddings else nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        )
        self.has_head = True  # False on pipeline stages that do not end the model
        # False on a pipeline's last stage holding a tied model's embedding only as its head (``stage``)
        self.embeds_tokens = True
        # Global positions of the local tokens when the caller does not pass them: set once by
        # runtime/parallel/parallelize.py (context parallel slices; pipeline stages see hidden states, not tokens).
        self.positions: torch.Tensor | None = None

    def init_weights(self, seed: int = 0) -> None:
        """N(0, 0.02) for matrices, residual projections scaled by 1/sqrt(2L) (GPT-2, Radford et al.
        2019), zeros for biases, ones for norms. A parameter's values depend on ``seed`` and its name only
        (``normal_box``), never on what else this module holds or how it is sharded: the whole model, a pipeline
        stage, and a rank's shards (TP, FSDP, EP DTensors, materialised from the meta device) get the same value for
        every element, so every layout starts from the same weights however the model was built. Each rank draws
        on the CPU only the rows its box meets and copies its box in (``weights.local_box``)."""
        torch.manual_seed(seed)  # the global generator too, as before (draws that follow a build stay as they were)
        std, resid = 0.02, 0.02 / math.sqrt(2 * self.spec.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                local, box = local_box(p)
                if name.endswith("bias"):
                    local.zero_()
                elif p.ndim == 1:
                    local.fill_(0.0 if self.spec.norm_offset else 1.0)  # a gain of 1 either way
                elif all(b.stop > b.start for b in box):  # an FSDP rank past an uneven tensor's end holds nothing
                    s = resid if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
                    local.copy_(normal_box(name, tuple(p.shape), s, seed, box).reshape(local.shape))

    def stage(self, layer_ids: list[int], first: bool, last: bool) -> Transformer:
        """A pipeline stage that shares this model's modules: layers ``layer_ids`` (keeping their keys,
        so parameter names are unchanged), the embeddings only if ``first``, the final norm and the head
        only if ``last``. A tied model's last stage (not also the first) holds its own copy of the embedding
        as its head, under the same name (Megatron's word-embedding copy on the last stage): the pipeline keeps
        the two equal (runtime/parallel/pipeline.py sums their gradients)."""
        part = Transformer.__new__(Transformer)
        nn.Module.__init__(part)
        part.spec = self.spec
        tied_copy = last and not first and self.spec.tied_embeddings
        part.tok_embeddings = (self.tok_embeddings if first else
                               copy.deepcopy(self.tok_embeddings) if tied_copy else None)
        part.embeds_tokens = first
        part.pos_embeddings = self.pos_embeddings if first else None
        part.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in layer_ids})
        part.norm = self.norm if last else None
        part.output = self.output if last else None
        part.has_head = last
        part.positions = self.positions
        return part

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens [b, s] (ints; or hidden states [b, s, d] on a later pipeline stage) -> logits or
        hidden states. ``positions`` [s] are the global positions of the local tokens; [b, s]: each row packs
        documents whose positions restart at 0, and attention stays within each (``document_mask``). ``cache``:
        the tokens follow the cached positions (their positions), and their K/V are added to it."""
        if cache is not None:
            positions = cache.next_positions(tokens.shape[1], tokens.device)
        elif positions is None:
            positions = self.positions if self.positions is not None else torch.arange(tokens.shape[1])
        positions = positions.to(tokens.device)
        mask = document_mask(positions) if positions.ndim == 2 else None
        h = self.tok_embeddings(tokens) if self.embeds_tokens else tokens
        if self.embeds_tokens and self.spec.embed_scale:  # Gemma: sqrt(d) as an fp32 scalar cast to h's dtype
            h = h * torch.tensor(self.spec.d_model ** 0.5).to(h.dtype).item()
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions if positions.ndim == 2 else positions[None])
        cos, sin = rope_angles(positions, self.spec.head_dim, self.spec.rope_theta,
                               rope_frequencies(self.spec, positions.device), rope_scale(self.spec))
        local = local_rope(self.spec, positions)
        for key, layer in self.layers.items():
            c, s = local[1:] if local is not None and int(key) in local[0] else (cos, sin)  # Gemma 3's own
            if cache is not None:
                h = layer(h, c, s, cache, int(key))
            else:
                h = layer(h, c, s) if mask is None else layer(h, c, s, mask=mask)
        if cache is not None:
            cache.length += tokens.shape[1]
        if self.norm is not None:
            h = self.norm(h)
        if not self.has_head:
            return h
        logits = self.output(h) if self.output is not None else tied_head(h, self.tok_embeddings.weight)
        if self.spec.final_softcap:  # Gemma 2: z -> c tanh(z / c)
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits


def local_rope(spec: ModelSpec, positions: torch.Tensor) -> tuple[set[int], torch.Tensor, torch.Tensor] | None:
    """(the sliding-window layers, cos, sin of their RoPE) where they rotate by their own base
    (``rope_local_theta``, unscaled: Gemma 3's rope_parameters["sliding_attention"]), else None."""
    if not spec.rope_local_theta:
        return None
    layers = set(range(spec.n_layers) if spec.window_layers is None else spec.window_layers)
    return (layers, *rope_angles(positions, spec.head_dim, spec.rope_local_theta))


def tied_head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Logits h W_emb^T with the embedding table as the head. Under tensor parallelism the table is
    vocab-parallel (a DTensor sharded on the vocabulary, dim 0, as the untied head's column-parallel weight
    is): h, whole or sequence-sharded, is made whole on every tp rank, each rank computes its vocabulary
    shard's logits and they are gathered, the untied head's ColwiseParallel(output_layouts=Replicate())."""
    if not isinstance(w, DTensor):
        return F.linear(h, w)
    whole = [Replicate()] * w.device_mesh.ndim
    h = h.redistribute(placements=whole) if isinstance(h, DTensor) else DTensor.from_local(h, w.device_mesh, whole)
    return F.linear(h, w).full_tensor()


INIT_BLOCK = 1 << 24  # elements per random block of a parameter: whole rows of its dim 0 (one row at least)


def init_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block ``block`` of parameter ``name``: 63 bits of blake2b over the three (the same on
    every rank, process and layout; Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def normal_box(name: str, shape: tuple[int, ...], std: float, seed: int, box: Box) -> torch.Tensor:
    """The ``box`` of parameter ``name``'s initial N(0, std^2) values (shape ``shape``), on the CPU. The rows of
    dim 0 are drawn in blocks of INIT_BLOCK elements (whole rows, one at least), block i from its own generator
    (``init_seed``): a box needs only the blocks its rows meet, drawn one at a time, so a rank never holds more than
    one block beyond its box, and the values never depend on the box."""
    width = math.prod(shape[1:])
    rows = max(1, INIT_BLOCK // max(width, 1))
    first, stop = box[0].start, box[0].stop
    out = torch.empty([b.stop - b.start for b in box])
    for i in range(first // rows, -(-stop // rows)):
        lo, hi = i * rows, min((i + 1) * rows, shape[0])
        g = torch.Generator().manual_seed(init_seed(seed, name, i))
        block = torch.randn((hi - lo, *shape[1:]), generator=g) * std
        a, z = max(lo, first), min(hi, stop)
        out[a - first:z - first] = block[(slice(a - lo, z - lo), *box[1:])]
    return out


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Build the model; on the ``meta`` device no memory is allocated (for counting 405B)."""
    check_model(spec)
    with torch.device(device):
        model = Transformer(spec)
    if str(device) != "meta":
        model.init_weights(seed)
    return model


IGNORE = -100  # a target not learned (chat data's prompts, template tokens): F.cross_entropy's ignore_index


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions (those whose target is IGNORE left out)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy of the learned targets (not IGNORE): zero where none is learned."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
