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
