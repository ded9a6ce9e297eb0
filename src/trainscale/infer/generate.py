"""Text generation with a KV cache: prefill the prompt once, then one token per step.

The cache holds K and V of every layer for every position so far, preallocated for the prompt plus
the new tokens: [L, batch, n_kv_heads, capacity, head_dim] each, so its bytes are exactly
``estimate.memory.kv_cache_bytes`` (2 · L · n_kv_heads · head_dim · bytes per value per token).

The cached forward pass reuses runtime/model.py's modules and functions (norms, projections, RoPE,
MLP); only the attention's keys and values come from the cache instead of the current chunk.
Sampling: temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019, arXiv 1904.09751);
temperature 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trainscale.errors import TrainscaleError
from trainscale.specs import ModelSpec


class KVCache:
    """Preallocated keys and values for ``capacity`` positions of ``batch`` sequences."""

    def __init__(self, spec: ModelSpec, batch: int, capacity: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        shape = (spec.n_layers, batch, spec.n_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the real K and V tensors."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def forward_cached(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, s, vocab] for ``tokens`` [b, s] that follow the ``cache.length`` cached positions."""
    from trainscale.runtime.model import apply_rope, rope_angles

    spec = model.spec
    bsz, seq = tokens.shape
    start = cache.length
    if start + seq > cache.capacity:
        raise TrainscaleError(f"the KV cache holds {cache.capacity} positions; {start + seq} were asked for")
    if start + seq > spec.max_seq_len and spec.positions == "learned":
        raise TrainscaleError(f"the model has learned positions up to {spec.max_seq_len}, not {start + seq}")
    positions = torch.arange(start, start + seq, device=tokens.device)
    h = model.tok_embeddings(tokens)
    if model.pos_embeddings is not None:
        h = h + model.pos_embeddings(positions[None])
    cos, sin = rope_angles(positions, spec.head_dim, spec.rope_theta)
    end = start + seq
    # query j (position start + j) sees cached keys 0 .. start + j
    mask = None
    if seq > 1:
        mask = torch.arange(end, device=tokens.device)[None, :] <= positions[:, None]
    for i, layer in enumerate(model.layers.values()):
        attn = layer.attention
        x = layer.attention_norm(h)
        q = attn.wq(x).view(bsz, seq, -1, spec.head_dim)
        k = attn.wk(x).view(bsz, seq, -1, spec.head_dim)
        v = attn.wv(x).view(bsz, seq, -1, spec.head_dim)
        if attn.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.k[i, :, :, start:end] = k.transpose(1, 2).to(cache.k.dtype)
        cache.v[i, :, :, start:end] = v.transpose(1, 2).to(cache.v.dtype)
        keys = cache.k[i, :, :, :end].to(q.dtype)
        values = cache.v[i, :, :, :end].to(q.dtype)
        qh = q.transpose(1, 2)
        if keys.shape[1] != qh.shape[1]:  # GQA: each K/V head serves n_heads / n_kv_heads query heads
            rep = qh.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask)
        h = h + attn.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.length = end
    h = model.norm(h)
    if model.output is not None:
        return model.output(h)
    return F.linear(h, model.tok_embeddings.weight)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def check(self) -> Sampling:
        if self.temperature < 0:
            raise TrainscaleError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise TrainscaleError(f"top-k must be >= 0, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise TrainscaleError(f"top-p must be in (0, 1], not {self.top_p}")
        return self


def sample_next(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """[b, vocab] logits -> [b] token ids."""
    logits = logits.float()
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first one always stays)
        drop = probs.cumsum(-1) - probs >= s.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    kv_cache_bytes: int
    kv_capacity: int
    kv_dtype: str
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 kv_dtype: torch.dtype = torch.float32, stop_id: int | None = None,
                 keep_logits: bool = False) -> Generation:
    """Prefill the prompt into a KV cache, then sample ``max_new_tokens`` tokens one at a time."""
    sampling.check()
    if not prompt_ids:
        raise TrainscaleError("the prompt is empty (it tokenizes to no tokens)")
    if max_new_tokens < 0:
        raise TrainscaleError(f"max new tokens must be >= 0, not {max_new_tokens}")
    spec = model.spec
    capacity = len(prompt_ids) + max_new_tokens
    if capacity > spec.max_seq_len:
        raise TrainscaleError(f"prompt ({len(prompt_ids)} tokens) + {max_new_tokens} new tokens exceeds the "
                              f"model's context of {spec.max_seq_len}")
    device = next(model.parameters()).device
    cache = KVCache(spec, 1, capacity, kv_dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
    logits = forward_cached(model, torch.tensor([prompt_ids], device=device), cache)[:, -1]
    out: list[int] = []
    kept: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        if keep_logits:
            kept.append(logits[0].float().cpu())
        nxt = sample_next(logits.cpu(), sampling, gen)
        out.append(int(nxt[0]))
        if stop_id is not None and out[-1] == stop_id:
            break
        if len(out) < max_new_tokens:
            logits = forward_cached(model, nxt[:, None].to(device), cache)[:, -1]
    return Generation(list(prompt_ids), out, cache.nbytes, capacity, str(kv_dtype).removeprefix("torch."), kept)
