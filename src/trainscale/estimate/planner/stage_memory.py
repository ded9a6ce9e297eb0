"""Memory on every pipeline stage, the heaviest deciding (item 4 of the planner's model): model state under ZeRO,
activations of the micro-batches in flight, and the buffers (gathered weights, a recomputed layer, the logits).

Middle stages hold the same layers and fewer micro-batches the later they sit, so the heaviest is the first, the
second (the first full one when the end stages give a slot to the embedding and head) or the last (head, logits, a
tied embedding copy). Arrays over the candidates (``candidates.Candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainscale.estimate import memory
from trainscale.estimate.params import layer_params
from trainscale.estimate.pipeline import in_flight
from trainscale.estimate.planner.candidates import FULL, RECOMPUTE, SELECTIVE, Candidates, per_mode
from trainscale.estimate.planner.dp import n_shard, n_shard_experts
from trainscale.estimate.planner.efficiencies import Efficiencies
from trainscale.estimate.planner.layer import ACT_BYTES, LOSS_BYTES, layer_gemm_shapes
from trainscale.estimate.planner.software import Software
from trainscale.estimate.planner.stages import DenseLayers, StageParams, moe_layer_params
from trainscale.specs import ModelSpec


def held(c: Candidates, sw: Software, r: Any) -> Any:
    """Micro-batches of a stage's layers rank r holds at its peak. DualPipe (DeepSeek-V3 Table 2, "Activation
    PP+1"): every rank holds its two chunks' PP + 1 in all, whatever its position."""
    if sw.pipeline == "dualpipe":
        return np.where(c.pp > 1, np.minimum(c.pp + 1, c.micro), in_flight(c.sched, c.pp, c.ve, c.micro, r))
    return in_flight(c.sched, c.pp, c.ve, c.micro, r)


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per layer and micro-batch: Korthikanti's count, and (a MoE or MLA model) the correction from the
    shapes of a dense and of a MoE layer."""

    korthikanti: Any
    dense: Any = 0.0
    moe: Any = 0.0


def layer_activations(m: ModelSpec, c: Candidates, eff: Efficiencies, sw: Software, seq: int) -> LayerMemory:
    """Activations one layer keeps for its backward, per micro-batch (Korthikanti et al. 2022 Table 2).

    Flash keeps no s x s scores, whatever the recompute mode: Korthikanti's "selective" is exactly that. A selective
    policy that recomputes GEMMs (torchtitan: every second one) does not keep their outputs (bf16, tokens x out
    width, sharded like the GEMM). A MoE or MLA model's layers are counted from their shapes, as a correction to
    Korthikanti's dense count (the MLA latents and up-projected q/k/v in place of MHA's Q, K, V; the routed rows,
    experts, combine and router and the shared expert, or the dense FFN of d_ff, in place of a 4h MLP's 16·sbh/t),
    under the software's caching and recompute knobs; none of it kept under full recompute. A dense model is
    counted from its shapes the same way (GQA's K/V width, a SwiGLU's 3 x d_ff, no dropout masks unless the
    software runs dropout): Korthikanti's Table 2 is a GPT layer, not a Llama one."""
    flash = sw.attention == "flash"

    def acts(mode: str) -> np.ndarray:
        def one(use_sp: bool) -> Any:
            return memory.activation_bytes_per_layer(seq // c.cp, c.mb, m.d_model, m.n_heads, c.tp, use_sp, mode)
        return np.where(c.sp, one(True), one(False))

    per_layer = per_mode(lambda mode: acts("selective" if flash and mode == "none" else mode), c.rc, RECOMPUTE)
    dropped = sum(n_out for name, (_, n_out) in layer_gemm_shapes(m, c.tp).items() if name in sw.selective_gemms)
    per_layer = per_layer - np.where(c.rc == SELECTIVE, ACT_BYTES * (seq // c.cp) * c.mb * dropped, 0.0)
    tok_s = (seq // c.cp) * c.mb
    cache_knobs = sw.activation_caching()
    imb = m.capacity_factor if m.capacity_factor > 0 else eff.moe_imbalance
    shaped = [np.where(c.full, 0.0, tok_s * memory.shaped_layer_delta_bytes_per_token(
        m, kind, c.tp, c.sp, imb, cache_knobs)) for kind in ((False, True) if m.is_moe else (False,))]
    return LayerMemory(per_layer, shaped[0], shaped[-1])


def buffers(m: ModelSpec, c: Candidates, sw: Software, seq: int) -> tuple[Any, Any]:
    """(every stage's buffers, the last stage's logits): a full recompute re-materialises one layer in the
    backward; ZeRO-3 gathers one layer's weights (and its gradients); fp32 logits for the loss."""
    flash = sw.attention == "flash"
    rc_one = np.where(c.sp, memory.activation_bytes_per_layer(seq // c.cp, c.mb, m.d_model, m.n_heads, c.tp, True,
                                                              "selective" if flash else "none"),
                      memory.activation_bytes_per_layer(seq // c.cp, c.mb, m.d_model, m.n_heads, c.tp, False,
                                                        "selective" if flash else "none"))
    rc_buf = np.where(c.rc == FULL, rc_one, 0.0)
    if m.is_moe:
        lp_d, lp_e, lp_m = moe_layer_params(m)
        lp_buf = np.maximum(lp_d / c.tp, lp_m / c.tp + lp_e / c.ep)  # one layer's gathered weights
    else:
        lp_buf = layer_params(m) / c.tp
    fsdp_buf = np.where(c.zero >= 3, (2 * memory.WEIGHT_BYTES + sw.grad_bytes) * lp_buf, 0.0)
    logits = c.tokens * m.vocab_size / c.tp * (ACT_BYTES + LOSS_BYTES)
    return fsdp_buf + rc_buf, logits


def stage_memory(m: ModelSpec, c: Candidates, sw: Software, lm: LayerMemory, buf: tuple[Any, Any], r: Any,
                 layers: Any, dense: Any, params: Any, experts: Any, is_last: Any) -> dict[str, Any]:
    """Bytes per GPU of pipeline rank ``r`` holding ``layers`` (``dense`` of them a MoE's dense ones), ``params``
    split over TP and ``experts`` over EP: weights, gradients, optimizer, activations, buffers, total."""
    st = memory.zero_state_bytes_per_gpu(params, n_shard(c), c.zero, grad_bytes=sw.grad_bytes,
                                        optimizer_bytes=sw.optimizer_state_bytes)
    if m.is_moe:
        ex = memory.zero_state_bytes_per_gpu(experts, n_shard_experts(c), c.zero, grad_bytes=sw.grad_bytes,
                                            optimizer_bytes=sw.optimizer_state_bytes)
        st = memory.StateBytes(st.weights + ex.weights, st.gradients + ex.gradients, st.optimizer + ex.optimizer)
        a = (lm.korthikanti * layers + lm.dense * dense + lm.moe * (layers - dense)) * held(c, sw, r)
    else:
        a = (lm.korthikanti + lm.moe) * layers * held(c, sw, r)
    b = buf[0] + np.where(is_last, buf[1], 0.0)
    w, g, o = (np.asarray(x) + 0.0 for x in (st.weights, st.gradients, st.optimizer))
    return {"w": w, "g": g, "o": o, "a": a, "b": b, "t": w + g + o + a + b}


def heaviest(m: ModelSpec, c: Candidates, sw: Software, lm: LayerMemory, buf: tuple[Any, Any], d: DenseLayers,
             s: StageParams) -> tuple[dict[str, Any], Any, Any]:
    """(the heaviest stage's memory by part, the first stage's total, the heaviest stage's index) of the first,
    the second and the last pipeline rank."""
    place, pp = c.place, c.pp
    s0 = stage_memory(m, c, sw, lm, buf, 0, place["first"], d.first, s.first, s.e_first, pp == 1)
    s1 = stage_memory(m, c, sw, lm, buf, np.minimum(1, pp - 1), np.where(pp > 2, place["max"], place["last"]),
                      d.second, np.where(pp > 2, s.mid, s.last), np.where(pp > 2, s.e_mid, s.e_last), pp == 2)
    sl = stage_memory(m, c, sw, lm, buf, pp - 1, place["last"], np.where(pp > 1, d.last, d.first) if m.is_moe else 0,
                      np.where(pp > 1, s.last, s.first), np.where(pp > 1, s.e_last, s.e_first),
                      np.ones(pp.shape, dtype=bool))
    cand = np.stack([s0["t"], np.where(pp > 1, s1["t"], 0.0), np.where(pp > 2, sl["t"], 0.0)])
    which = np.argmax(cand, axis=0)
    heavy = {k: np.choose(which, [s0[k], s1[k], sl[k]]) for k in s0}
    return heavy, s0["t"], np.choose(which, [np.zeros_like(pp), np.minimum(1, pp - 1), pp - 1])
