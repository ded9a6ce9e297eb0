"""LoRA: trainable parameters and optimizer state of low-rank adapters.

Hu et al. 2021, LoRA (arXiv 2106.09685) Sec. 4.1: a frozen weight W0 [d_out, d_in] gets the update
B·A with A [r, d_in] and B [d_out, r], so each adapted matrix trains r·(d_in + d_out) parameters.
"""

from __future__ import annotations

from trainscale.specs import ModelSpec

ATTENTION = ("wq", "wk", "wv", "wo")
MLP = ("w1", "w2", "w3")


def lora_targets(m: ModelSpec, targets: str | tuple[str, ...] | list[str] = "all") -> tuple[str, ...]:
    """Expand a target list ("all", "attn", "mlp", or projection names wq,wk,wv,wo,w1,w2,w3) to names."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    mlp = MLP if m.mlp == "swiglu" else ("w1", "w2")
    out: list[str] = []
    for raw in (t.strip().lower() for t in items):
        names = {"all": ATTENTION + mlp, "attn": ATTENTION, "mlp": mlp}.get(raw, (raw,))
        for n in names:
            if n not in ATTENTION + mlp:
                raise ValueError(f"LoRA target {raw!r} is not one of all, attn, mlp, {', '.join(ATTENTION + mlp)}")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError("LoRA needs at least one target projection")
    if m.is_moe and any(n in mlp for n in out):
        raise ValueError("LoRA on a mixture of experts adapts the attention projections only (--targets attn): its "
                         "routed experts are stacked tensors, not the linear layers an adapter wraps")
    return tuple(out)


def projection_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each projection of one decoder layer, as runtime/model.py builds them."""
    d = m.d_model
    shapes = {"wq": (d, m.q_dim), "wk": (d, m.kv_dim), "wv": (d, m.kv_dim), "wo": (m.q_dim, d),
              "w1": (d, m.d_ff), "w2": (m.d_ff, d)}
    if m.mlp == "swiglu":
        shapes["w3"] = (d, m.d_ff)
    return shapes


def lora_trainable_params(m: ModelSpec, rank: int, targets: str | tuple[str, ...] | list[str] = "all") -> int:
    """Σ over adapted matrices of r·(d_in + d_out), in every layer (Hu et al. 2021, Sec. 4.1)."""
    shapes = projection_shapes(m)
    per_layer = sum(rank * sum(shapes[t]) for t in lora_targets(m, targets))
    return m.n_layers * per_layer


# Adam (Kingma & Ba 2014) keeps two fp32 moments, m and v, per trainable parameter: 8 bytes. Mixed
# precision adds an fp32 master copy of each trainable parameter: 4 more (ZeRO, arXiv 1910.02054 Sec. 3.1).
ADAM_MOMENT_BYTES = 8
FP32_MASTER_BYTES = 4


def lora_optimizer_bytes(m: ModelSpec, rank: int, targets: str | tuple[str, ...] | list[str] = "all",
                         mixed_precision: bool = False) -> int:
    """Adam state of the adapters only: 8 bytes (fp32 m + v) per trainable parameter, + 4 bytes of fp32
    master weights when the adapters train in bf16/fp16. The frozen base weights have no optimizer state.
    Counts the moment tensors; torch's per-tensor ``step`` counters (one scalar each) are not included."""
    per = ADAM_MOMENT_BYTES + (FP32_MASTER_BYTES if mixed_precision else 0)
    return per * lora_trainable_params(m, rank, targets)
