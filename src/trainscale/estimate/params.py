"""Parameter inventory: every tensor a model has, by name and shape.

The runtime module (``runtime/model.py``) uses exactly these names, so the count the estimator
makes is checkable tensor by tensor against the real module.
"""

from __future__ import annotations

from math import prod

from trainscale.specs import ModelSpec

Tensor = tuple[str, tuple[int, ...]]


def _ffn_tensors(m: ModelSpec, p: str, width: int) -> list[Tensor]:
    """A dense FFN of ``width`` under prefix ``p``. SwiGLU: w1 = gate, w3 = up, w2 = down (Shazeer 2020,
    arXiv 2002.05202); GELU: w1 = up, w2 = down."""
    d = m.d_model
    out: list[Tensor] = []
    for name in ("w1", "w3") if m.mlp == "swiglu" else ("w1",):
        out.append((f"{p}{name}.weight", (width, d)))
        if m.bias:
            out.append((f"{p}{name}.bias", (width,)))
    out.append((p + "w2.weight", (d, width)))
    if m.bias:
        out.append((p + "w2.bias", (d,)))
    return out


def expert_tensors(m: ModelSpec, i: int) -> list[Tensor]:
    """The routed experts of MoE layer ``i``, stacked on a leading expert dim (what expert parallelism
    splits): ``moe.experts.w1`` [E, width, d] (and w3), ``moe.experts.w2`` [E, d, width]; no biases."""
    p, e, w, d = f"layers.{i}.moe.experts.", m.n_experts, m.expert_width, m.d_model
    ups = ("w1", "w3") if m.mlp == "swiglu" else ("w1",)
    return [(f"{p}{name}", (e, w, d)) for name in ups] + [(p + "w2", (e, d, w))]


def moe_tensors(m: ModelSpec, i: int) -> list[Tensor]:
    """MoE layer ``i``'s feed-forward: the router, the routed experts, the shared expert (and its gate)."""
    p, d = f"layers.{i}.moe.", m.d_model
    out: list[Tensor] = [(p + "router.weight", (m.n_experts, d))]
    out += expert_tensors(m, i)
    if m.d_ff_shared:
        out += _ffn_tensors(m, p + "shared.", m.d_ff_shared)
        if m.shared_expert_gate:
            out.append((p + "shared_gate.weight", (1, d)))
    return out


def attention_tensors(m: ModelSpec, i: int) -> list[Tensor]:
    """Layer ``i``'s attention projections. MHA/GQA: wq, wk, wv, wo. MLA (DeepSeek-V2, arXiv 2405.04434
    eq. 1-11): wq_a [q_lora, d], q_norm, wq_b [H*(head_dim + rope), q_lora] (or one wq [H*(head_dim + rope),
    d] without a query latent); wkv_a [kv_lora + rope, d] (the latent and the shared RoPE key), kv_norm,
    wkv_b [H*(head_dim + v_head_dim), kv_lora]; wo [d, H*v_head_dim]."""
    d, p = m.d_model, f"layers.{i}.attention."
    if m.attention == "mla":
        h, qk, v = m.n_heads, m.qk_head_dim, m.value_head_dim
        out: list[Tensor] = []
        if m.q_lora_rank:
            out += [(p + "wq_a.weight", (m.q_lora_rank, d)), (p + "q_norm.weight", (m.q_lora_rank,)),
                    (p + "wq_b.weight", (h * qk, m.q_lora_rank))]
        else:
            out.append((p + "wq.weight", (h * qk, d)))
        out += [(p + "wkv_a.weight", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
                (p + "kv_norm.weight", (m.kv_lora_rank,)), (p + "wkv_b.weight", (h * (m.head_dim + v), m.kv_lora_rank)),
                (p + "wo.weight", (d, h * v))]
        return out
    out = []
    for name, rows in (("wq", m.q_dim), ("wk", m.kv_dim), ("wv", m.kv_dim)):
        out.append((f"{p}{name}.weight", (rows, d)))
        if m.bias or m.qkv_bias:  # Qwen2: biases on Q, K and V only
            out.append((f"{p}{name}.bias", (rows,)))
    out.append((p + "wo.weight", (d, m.q_dim)))
    if m.bias:
        out.append((p + "wo.bias", (d,)))
    if m.qk_norm and m.qk_norm_whole:  # OLMo-2: one gain over the whole query projection, one over the keys'
        out += [(p + "q_norm.weight", (m.q_dim,)), (p + "k_norm.weight", (m.kv_dim,))]
    elif m.qk_norm:  # Qwen3: one RMSNorm gain of head_dim over every query head and one over every key head
        out += [(p + "q_norm.weight", (m.head_dim,)), (p + "k_norm.weight", (m.head_dim,))]
    return out


def layer_tensors(m: ModelSpec, i: int) -> list[Tensor]:
    """Tensors of decoder layer ``i``: attention + its norm, then the feed-forward (dense, or MoE when
    ``m.is_moe_layer(i)``) + its norm."""
    d, p = m.d_model, f"layers.{i}."
    if m.post_norms:  # OLMo-2: RMSNorms on the sub-layers' outputs only
        out: list[Tensor] = [*attention_tensors(m, i), (p + "attention_post_norm.weight", (d,)),
                             (p + "ffn_post_norm.weight", (d,))]
        return out + (moe_tensors(m, i) if m.is_moe_layer(i) else _ffn_tensors(m, p + "feed_forward.", m.d_ff))
    out = [(p + "attention_norm.weight", (d,))]
    if m.norm == "layernorm":
        out.append((p + "attention_norm.bias", (d,)))
    out += attention_tensors(m, i)
    out.append((p + "ffn_norm.weight", (d,)))
    if m.norm == "layernorm":
        out.append((p + "ffn_norm.bias", (d,)))
    if m.sandwich_norms:  # Gemma 2: the attention's and the MLP's outputs normed too (RMSNorm gains)
        out += [(p + "attention_post_norm.weight", (d,)), (p + "ffn_post_norm.weight", (d,))]
    if m.is_moe_layer(i):
        return out + moe_tensors(m, i)
    return out + _ffn_tensors(m, p + "feed_forward.", m.d_ff)


def embedding_tensors(m: ModelSpec) -> list[Tensor]:
    out: list[Tensor] = [("tok_embeddings.weight", (m.vocab_size, m.d_model))]
    if m.positions == "learned":
        out.append(("pos_embeddings.weight", (m.max_seq_len, m.d_model)))
    return out


def head_tensors(m: ModelSpec) -> list[Tensor]:
    out: list[Tensor] = [("norm.weight", (m.d_model,))]
    if m.norm == "layernorm":
        out.append(("norm.bias", (m.d_model,)))
    if not m.tied_embeddings:
        out.append(("output.weight", (m.vocab_size, m.d_model)))
    return out


def mtp_tensors(m: ModelSpec, k: int) -> list[Tensor]:
    """Multi-token-prediction module ``k`` (DeepSeek-V3, arXiv 2412.19437 Sec. 2.2 eq. 21-23): RMSNorms of the
    previous depth's hidden state (hnorm) and of the next token's embedding (enorm), the projection M_k [d, 2d]
    (eh_proj), one transformer block of the kind of the model's last layer, and the final norm before the output
    head (the HF checkpoint's shared_head.norm); the embedding and the head are the main model's, shared."""
    p, d = f"mtp.{k}.", m.d_model
    norm = [("weight", (d,))] + ([("bias", (d,))] if m.norm == "layernorm" else [])
    out: list[Tensor] = [(f"{p}{n}.{w}", sh) for n in ("enorm", "hnorm") for w, sh in norm]
    out.append((p + "eh_proj.weight", (d, 2 * d)))
    out += [(p + "block." + name.split(".", 2)[2], shape) for name, shape in layer_tensors(m, m.n_layers - 1)]
    return out + [(f"{p}norm.{w}", sh) for w, sh in norm]


def mtp_params(m: ModelSpec) -> int:
    """Parameters of the multi-token-prediction modules (0 without): apart from ``param_count``, as DeepSeek counts
    them ("671B of the main model weights and 14B of the MTP module weights", HF deepseek-ai/DeepSeek-V3 README;
    its 14B also holds the checkpoint's copies of the shared embedding and head)."""
    return m.mtp_layers * numel(mtp_tensors(m, 0)) if m.mtp_layers else 0


def mtp_block_extra(m: ModelSpec) -> int:
    """One MTP module's parameters besides its transformer block: the norms and the projection M_k."""
    return numel(mtp_tensors(m, 0)) - layer_params(m, m.n_layers - 1)


def tensor_inventory(m: ModelSpec) -> list[Tensor]:
    """All parameter tensors in module order."""
    out = embedding_tensors(m)
    for i in range(m.n_layers):
        out += layer_tensors(m, i)
    return out + head_tensors(m)


def numel(tensors: list[Tensor]) -> int:
    return sum(prod(shape) for _, shape in tensors)


def layer_params(m: ModelSpec, i: int | None = None) -> int:
    """Parameters of decoder layer ``i``; without ``i``, of the model's most common layer (a MoE layer in a
    MoE model, else a dense one)."""
    if i is None:
        i = m.n_layers - 1 if m.is_moe else 0
    return numel(layer_tensors(m, i))


def embedding_params(m: ModelSpec) -> int:
    return numel(embedding_tensors(m))


def head_params(m: ModelSpec) -> int:
    return numel(head_tensors(m))


def param_count(m: ModelSpec) -> int:
    """Exact parameter count: embeddings + every layer + final norm (+ untied output projection); the main model's,
    without its multi-token-prediction modules (``mtp_params``)."""
    n_moe = m.n_moe_layers
    body = (m.n_layers - n_moe) * numel(layer_tensors(m, 0)) if m.n_layers > n_moe else 0
    if n_moe:
        body += n_moe * numel(layer_tensors(m, m.n_layers - 1))
    return embedding_params(m) + body + head_params(m)


def expert_params(m: ModelSpec) -> int:
    """Parameters in routed experts, all layers (what expert parallelism splits)."""
    return m.n_moe_layers * numel(expert_tensors(m, m.n_layers - 1)) if m.is_moe else 0


def active_params(m: ModelSpec, embeddings: bool = True) -> int:
    """Parameters one token passes through: everything but the routed experts it is not sent to, i.e. the
    total less (n_experts - experts_per_token) / n_experts of the routed experts (the router and shared
    experts count in full). ``embeddings``: count the input embedding table (the convention of DeepSeek's
    "37B activated", whose 671B total includes it; Mixtral's "12.9B active" as well). The output head is
    always counted: every token's logits use all of it."""
    routed = expert_params(m)
    n = param_count(m) - routed + (routed * m.experts_per_token // m.n_experts if m.is_moe else 0)
    return n if embeddings else n - embedding_params(m)
