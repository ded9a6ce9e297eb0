"""Parameter inventory: every tensor a model has, by name and shape.

The runtime module (``runtime/model.py``) uses exactly these names, so the count the estimator
makes is checkable tensor by tensor against the real module.
"""

from __future__ import annotations

from math import prod

from trainscale.specs import ModelSpec

Tensor = tuple[str, tuple[int, ...]]


def layer_tensors(m: ModelSpec, i: int) -> list[Tensor]:
    """Tensors of decoder layer ``i`` (attention + MLP + two norms)."""
    d, p = m.d_model, f"layers.{i}."
    out: list[Tensor] = [(p + "attention_norm.weight", (d,))]
    if m.norm == "layernorm":
        out.append((p + "attention_norm.bias", (d,)))
    for name, rows in (("wq", m.q_dim), ("wk", m.kv_dim), ("wv", m.kv_dim)):
        out.append((f"{p}attention.{name}.weight", (rows, d)))
        if m.bias:
            out.append((f"{p}attention.{name}.bias", (rows,)))
    out.append((p + "attention.wo.weight", (d, m.q_dim)))
    if m.bias:
        out.append((p + "attention.wo.bias", (d,)))
    out.append((p + "ffn_norm.weight", (d,)))
    if m.norm == "layernorm":
        out.append((p + "ffn_norm.bias", (d,)))
    # SwiGLU: w1 = gate, w3 = up, w2 = down (Shazeer 2020, arXiv 2002.05202); GELU: w1 = up, w2 = down.
    ups = ("w1", "w3") if m.mlp == "swiglu" else ("w1",)
    for name in ups:
        out.append((f"{p}feed_forward.{name}.weight", (m.d_ff, d)))
        if m.bias:
            out.append((f"{p}feed_forward.{name}.bias", (m.d_ff,)))
    out.append((p + "feed_forward.w2.weight", (d, m.d_ff)))
    if m.bias:
        out.append((p + "feed_forward.w2.bias", (d,)))
    return out


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


def tensor_inventory(m: ModelSpec) -> list[Tensor]:
    """All parameter tensors in module order."""
    out = embedding_tensors(m)
    for i in range(m.n_layers):
        out += layer_tensors(m, i)
    return out + head_tensors(m)


def numel(tensors: list[Tensor]) -> int:
    return sum(prod(shape) for _, shape in tensors)


def layer_params(m: ModelSpec) -> int:
    return numel(layer_tensors(m, 0))


def embedding_params(m: ModelSpec) -> int:
    return numel(embedding_tensors(m))


def head_params(m: ModelSpec) -> int:
    return numel(head_tensors(m))


def param_count(m: ModelSpec) -> int:
    """Exact parameter count: embeddings + L x layer + final norm (+ untied output projection)."""
    return embedding_params(m) + m.n_layers * layer_params(m) + head_params(m)


def non_embedding_params(m: ModelSpec) -> int:
    """N as Kaplan et al. 2020 (arXiv 2001.08361) count it: without embedding matrices."""
    out = m.vocab_size * m.d_model if not m.tied_embeddings else 0
    return param_count(m) - embedding_params(m) - out
