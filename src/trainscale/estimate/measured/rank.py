"""What one rank of trainscale's own runtime holds and computes, predicted without torch.

The planner (estimate/planner/step.py, memory.py) models a Megatron-style GPU job with the published formulas.
This module predicts the *runtime in this repository* (runtime/model.py + parallelize.py + pipeline.py)
rank by rank, so that ``trainscale train --compare-plan`` can check every figure against real tensors:

- model state: each parameter tensor of ``estimate.params.tensor_inventory``, cut by the pipeline
  (the stages a rank runs, ``trainscale.placement``), by tensor parallelism (the TP plan of
  ``trainscale.placement``: which dim each weight is sharded on) and by FSDP2 (dim 0 over the
  dp_shard x cp group), both with ``torch.chunk``'s sizes (ceil-sized pieces, the last ones short or
  empty). A MoE layer's routed experts (``moe.experts.*``, [E, ...]) are split over ep on dim 0 (E/ep
  each, DTensor Shard(0)) and sharded by FSDP2 on dim 1 over the expert_shard group (dp_shard x cp: the
  ranks holding the same experts); every other tensor is FSDP-sharded over dp_shard x ep x cp. Gradients
  have the parameters' local shapes; AdamW keeps two moments of that shape and one
  fp32 step counter per tensor (Loshchilov & Hutter 2019, arXiv 1711.05101; torch.optim.AdamW's state
  layout). zero1 keeps zero0's whole weights and gradients and cuts only the AdamW state as FSDP2 would
  (runtime/parallel/zero1.py); FSDP2 (zero2/3) cuts all three.
- activations: the tensors autograd saves for the backward pass of one micro-batch through a rank's
  stage, counted operation by operation from the model's code (norm, projections, RoPE, the attention
  kernel, the MLP, the loss). It is the same accounting Korthikanti et al. 2022 (arXiv 2205.05198,
  Sec. 4.1) do for Megatron's layer, applied to this layer (RMSNorm, GQA, RoPE, SwiGLU, no dropout).
- FLOPs: the matmul FLOPs a rank executes in one step, forward + backward + recomputation, in the
  convention torch's FlopCounterMode counts them (dense attention matmuls; a FlashAttention backward
  recomputes QK^T, Dao et al. 2022 arXiv 2205.14135 Algorithm 4). A MoE layer counts its active
  matmuls: the router, k expert FFNs per token and the shared expert; under EP a rank computes the rows
  routed to its experts, k x its tokens when the routing is balanced (the prediction; the measured
  figure follows the real routing, and the ep group's sum is exact either way).
- all-to-all: per MoE layer and micro-batch, four all_to_all_single calls on the ep group (dispatch and
  combine, each again in the backward pass) of k x tokens rows of d_model each way (balanced routing).
  Activations are counted for dense layers only (a MoE layer's are not modelled yet).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import prod
from typing import Any

from trainscale.estimate.params import embedding_tensors, head_tensors, layer_tensors
from trainscale.estimate.pipeline import SCHEDULE, in_flight
from trainscale.placement import (  # where a rank sits: one placement for the planner and the runtime
    MESH_DIMS,
    chunk_len,
    coords,
    local_stage_ids,
    mesh_sizes,
    stage_layers,
    tp_shard_dim,
)
from trainscale.specs import Layout, ModelSpec

__all__ = ["MESH_DIMS", "chunk_len", "coords", "local_stage_ids", "mesh_sizes", "stage_layers", "tp_shard_dim"]

FP32 = 4
INDEX_BYTES = 8  # int64 token ids and targets
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq
ADAM_STEP_BYTES = 4  # torch.optim.AdamW's per-tensor fp32 step counter

# ----------------------------------------------------------------------------- model state


def rank_tensors(m: ModelSpec, layout: Layout, rank: int, optimizer: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(name, local shape) of every parameter tensor ``rank`` holds; with ``optimizer``, of the shard of each
    that its AdamW state covers. They differ under zero1 only (runtime/parallel/zero1.py: whole weights, the
    optimizer on FSDP2's cut of them; Rajbhandari et al. 2020, arXiv 1910.02054 Sec. 5.1)."""
    c = coords(layout, rank)
    n_stages = layout.pp * layout.v
    ranges = stage_layers(m.n_layers, n_stages)
    tensors: list[tuple[str, tuple[int, ...]]] = []
    for s in local_stage_ids(layout, c["pp"]):
        if s == 0:
            tensors += embedding_tensors(m)
        for i in ranges[s]:
            tensors += layer_tensors(m, i)
        if s == n_stages - 1:
            tensors += head_tensors(m)
    fsdp = layout.zero >= (1 if optimizer else 2)  # the ZeRO cut: of the optimizer from zero1, the weights from zero2
    # FSDP's groups (placement.FLAT_DIMS), rank index row-major: dense dp_shard x ep x cp, experts dp_shard x cp
    n_shard, shard_idx = layout.dp_shard * layout.ep * layout.cp, (c["dp_shard"] * layout.ep + c["ep"]) * layout.cp \
        + c["cp"]
    n_expert_shard, expert_idx = layout.dp_shard * layout.cp, c["dp_shard"] * layout.cp + c["cp"]
    out = []
    for name, shape in tensors:
        local = list(shape)
        if is_expert_tensor(name):  # not split by TP; E/ep experts here, FSDP on dim 1
            local[0] = chunk_len(local[0], layout.ep, c["ep"])
            if fsdp:
                local[1] = chunk_len(local[1], n_expert_shard, expert_idx)
            out.append((name, tuple(local)))
            continue
        dim = tp_shard_dim(name, m) if layout.tp > 1 else None
        if dim is not None:
            local[dim] = chunk_len(local[dim], layout.tp, c["tp"])
        if fsdp:
            local[0] = chunk_len(local[0], n_shard, shard_idx)
        out.append((name, tuple(local)))
    return out


def is_expert_tensor(name: str) -> bool:
    """A MoE layer's routed-expert weight (what expert parallelism splits)."""
    return ".moe.experts." in name


@dataclass(frozen=True)
class RankState:
    """Bytes of model state one rank holds (fp32 master weights, gradients, AdamW state)."""

    tensors: int
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def rank_state_bytes(m: ModelSpec, layout: Layout, rank: int, param_bytes: int = FP32) -> RankState:
    """Parameters, gradients and optimizer state of ``rank`` in bytes: numel x dtype for the weights
    and their gradients, 2 moments x numel x dtype + one fp32 step per tensor for AdamW, over the
    optimizer's shards (under zero1 1/(dp_shard x cp) of the weights, each weight one shard, empty or not)."""
    tensors = rank_tensors(m, layout, rank)
    shards = rank_tensors(m, layout, rank, optimizer=True)
    n, n_opt = (sum(prod(s) for _, s in ts) for ts in (tensors, shards))
    return RankState(tensors=len(tensors), parameters=n * param_bytes, gradients=n * param_bytes,
                     optimizer=ADAM_MOMENTS * n_opt * param_bytes + ADAM_STEP_BYTES * len(shards))


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Activations:
    """Bytes autograd saves for one micro-batch's backward on one rank, by where they come from."""

    layers: float
    embedding: float
    head: float
    rope: float
    per_layer: float
    n_layers: int

    @property
    def total(self) -> float:
        return self.layers + self.embedding + self.head + self.rope

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def _norm_saved(m: ModelSpec, rows: float, e: int) -> float:
    """RMSNorm x·rsqrt(mean(x²)+eps)·g saves x, the rsqrt (one per row, fp32) and the normalised x;
    LayerNorm (aten.native_layer_norm) saves x and its fp32 mean and rstd per row."""
    if m.norm == "rmsnorm":
        return rows * m.d_model * e + rows * FP32 + rows * m.d_model * e
    return rows * m.d_model * e + 2 * rows * FP32


def layer_saved_bytes(m: ModelSpec, tokens: int, seq: int, layout: Layout, e: int = FP32) -> float:
    """Bytes one decoder layer saves for backward on one rank, for ``tokens`` = micro-batch x local seq.

    none: the block input, both norms' saved tensors, the projections' (all-gathered, with SP) inputs,
    the attention kernel's q, k, v (K/V heads repeated for GQA only where the runtime repeats them: a window,
    a soft-cap, CP; gathered over the whole sequence with CP),
    its output and per-row log-sum-exp, and the MLP's hidden tensors (SwiGLU: w1 x, w3 x, silu(w1 x) and
    the product; GELU: w1 x and gelu(w1 x)).
    selective: the attention kernel is recomputed, so only its inputs stay (q, and the un-repeated,
    un-gathered k, v) and its output.
    full: the block input only (Chen et al. 2016, arXiv 1604.06174)."""
    tp, cp = layout.tp, layout.cp
    sp = tp > 1 and layout.sp
    rows = tokens / tp if sp else tokens  # residual-stream rows on this rank
    d, hd = m.d_model, m.head_dim
    h_loc, kv_loc = m.n_heads // tp, max(m.n_kv_heads // tp, 1)
    if layout.recompute == "full":
        return rows * d * e
    q = tokens * h_loc * hd * e
    kv_local = tokens * kv_loc * hd * e  # one of k, v as this rank projected them
    norms = _norm_saved(m, rows, e) * 2
    linear_inputs = 2 * tokens * d * e  # attention and MLP inputs (the whole sequence shard, gathered under SP)
    out = tokens * h_loc * hd * e  # the attention output: saved by the kernel and by wo
    ff_loc = m.d_ff // tp
    mlp = tokens * ff_loc * e * (4 if m.mlp == "swiglu" else 2)
    if layout.recompute == "selective":
        core = q + 2 * kv_local + out
    else:
        keys = tokens * cp  # keys a rank attends to: the whole sequence, gathered from the cp group under CP
        # k and v as the kernel gets them: the unmasked causal path hands SDPA the K/V heads as they are
        # (enable_gqa: runtime/model.causal_attention); a window shorter than the sequence, Gemma 2's soft-cap
        # (eager attention) and CP's mask repeat the K/V heads for GQA first
        native = cp == 1 and hd <= 256 and not m.attn_softcap and not (m.sliding_window and m.sliding_window < seq)
        kv_kernel = keys * (kv_loc if native else h_loc) * hd * e
        lse = tokens * h_loc * FP32
        core = q + 2 * kv_kernel + out + lse
        if cp > 1:  # CP's causal mask over global positions, passed to the kernel as an fp32 additive mask
            core += (seq // cp) * seq * FP32
    return norms + linear_inputs + core + mlp


def stage_saved_bytes(m: ModelSpec, micro_batch: int, seq: int, layout: Layout, stage: int,
                      e: int = FP32) -> Activations:
    """Activations one micro-batch leaves for backward on pipeline stage ``stage`` (layers, plus the
    token ids on the first stage, plus the final norm, its gathered input to the head and the fp32
    log-softmax of the cross-entropy loss on the last)."""
    n_stages = layout.pp * layout.v
    layers = stage_layers(m.n_layers, n_stages)[stage]
    s_loc = seq // layout.cp
    tokens = micro_batch * s_loc
    per_layer = layer_saved_bytes(m, tokens, seq, layout, e)
    sp = layout.tp > 1 and layout.sp
    rows = tokens / layout.tp if sp else tokens
    emb = tokens * INDEX_BYTES if stage == 0 else 0.0
    head = 0.0
    if stage == n_stages - 1:
        head = (_norm_saved(m, rows, e) + tokens * m.d_model * e + tokens * m.vocab_size * FP32
                + tokens * INDEX_BYTES)
    # RoPE's cos and sin [s_local, head_dim / 2], fp32, computed once per forward and shared by the layers
    rope = 2 * s_loc * (m.head_dim // 2) * FP32 if (m.positions == "rope" and layers) else 0.0
    return Activations(layers=per_layer * len(layers), embedding=emb, head=head, rope=rope, per_layer=per_layer,
                       n_layers=len(layers))


@dataclass(frozen=True)
class RankMemory:
    """Bytes the heaviest rank holds at its peak (weights, gradients and AdamW state; the activations its stage
    keeps in flight), and the sum over every rank (what the shared RAM of a CPU job must hold)."""

    state: float
    activations: float
    all_ranks: float

    @property
    def per_rank(self) -> float:
        return self.state + self.activations


def heaviest_rank_memory(m: ModelSpec, layout: Layout, seq: int, global_batch: int, act_bytes: int) -> RankMemory:
    """What the heaviest rank of this runtime holds for ``layout``: fp32 weights, gradients and AdamW state
    (``rank_state_bytes``), plus the activations (``stage_saved_bytes`` in ``act_bytes`` per element: 2 in bf16,
    4 in fp32) of the micro-batches its pipeline stage keeps in flight (``pipeline.in_flight``: 1F1B keeps pp - r,
    GPipe all of them). Not counted: the CUDA context, allocator caching and transient gathered weights, so a
    layout that does not fit by this count cannot fit. The first rank of each pipeline stage stands for the stage
    (it holds torch.chunk's largest shards)."""
    micro = global_batch // (layout.dp * layout.mb)
    per_stage: dict[int, tuple[float, float]] = {}
    for r in range(layout.world_size):
        c = coords(layout, r)
        if c["pp"] in per_stage or any(v for k, v in c.items() if k != "pp"):
            continue
        state = float(rank_state_bytes(m, layout, r).total)
        acts = sum(stage_saved_bytes(m, layout.mb, seq, layout, s, act_bytes).total
                   for s in local_stage_ids(layout, c["pp"]))
        held = float(in_flight(SCHEDULE.index(layout.schedule), layout.pp, layout.v, micro, c["pp"]))
        per_stage[c["pp"]] = (state, acts * held)  # held: in whole stages
    worst = max(per_stage.values(), key=sum)
    total = sum(map(sum, per_stage.values())) * (layout.world_size // layout.pp)
    return RankMemory(state=worst[0], activations=worst[1], all_ranks=total)


# ----------------------------------------------------------------------------- FLOPs


def layer_matmul_params(m: ModelSpec, i: int = 0) -> int:
    """Weights of layer ``i``'s matrix multiplies one token goes through (2-D tensors; biases are adds; of a
    MoE layer's routed experts, the k a token is sent to)."""
    n = sum(prod(s) for _, s in layer_tensors(m, i) if len(s) == 2)
    if m.is_moe_layer(i):
        n += m.experts_per_token * expert_matmul_params(m)
    return n


def expert_matmul_params(m: ModelSpec) -> int:
    """Weights of one routed expert's FFN (SwiGLU: w1, w3, w2; GELU: w1, w2)."""
    return (3 if m.mlp == "swiglu" else 2) * m.expert_width * m.d_model


def _moe_params(m: ModelSpec, i: int) -> int:
    """Matmul weights per token of MoE layer ``i``'s router, k routed experts and shared expert."""
    return sum(prod(s) for n, s in layer_tensors(m, i) if len(s) == 2 and ".moe." in n) \
        + m.experts_per_token * expert_matmul_params(m)


def a2a_rows(m: ModelSpec, tokens: float) -> float:
    """Rows one all-to-all of a MoE layer moves from a rank, balanced routing: k per token."""
    return m.experts_per_token * tokens


def attention_matmul_flops(m: ModelSpec, q_tokens: int, keys: int, tp: int = 1) -> tuple[float, float]:
    """(forward, backward) FLOPs of the attention matmuls for ``q_tokens`` queries against ``keys`` keys
    (per sequence: q_tokens is micro-batch x local queries): QK^T and PV, 2 x 2·s_q·s_k·head_dim per head
    forward; the FlashAttention backward recomputes QK^T and does four more (Dao et al. 2022, Alg. 4).
    Dense: the count a FLOP counter makes of the kernel's shapes, masked positions included."""
    heads = m.n_heads // tp
    fwd = 2 * 2.0 * q_tokens * keys * m.head_dim * heads
    return fwd, 2.5 * fwd


def rank_step_flops(m: ModelSpec, layout: Layout, rank: int, seq: int, global_batch: int) -> dict[str, float]:
    """Matmul FLOPs ``rank`` executes in one optimizer step: forward + backward of its stages' layers
    (6 x weights x tokens, Kaplan et al. 2020), the attention kernels, the output head on the last
    stage, and what recomputation adds (full: the layers' forward again; selective: the kernel's)."""
    c = coords(layout, rank)
    n_stages = layout.pp * layout.v
    ranges = stage_layers(m.n_layers, n_stages)
    tokens = global_batch // layout.dp * seq // layout.cp  # this rank's tokens per step
    n_seqs = global_batch // layout.dp
    layer_ids = [i for s in local_stage_ids(layout, c["pp"]) for i in ranges[s]]
    n_layers = len(layer_ids)
    has_head = (n_stages - 1) in local_stage_ids(layout, c["pp"])
    a_fwd, a_bwd = attention_matmul_flops(m, n_seqs * seq // layout.cp, seq, layout.tp)
    sp = layout.tp > 1 and layout.sp
    moe_tokens = tokens / layout.tp if sp else tokens  # a MoE layer routes the residual stream's rows
    dense = rc_dense = counted_dense = 0.0
    for i in layer_ids:
        moe = _moe_params(m, i) if m.is_moe_layer(i) else 0  # run whole on each tp rank, on its rows
        tp_part = (layer_matmul_params(m, i) - moe) / layout.tp
        dense += 6.0 * (tp_part * tokens + moe * moe_tokens)
        counted_dense += 6.0 * (layout.tp * tp_part * tokens + moe * moe_tokens)
        if layout.recompute == "full":
            # torch's checkpoint stops recomputing once every tensor the backward needs exists again
            # (torch.utils.checkpoint early stop): the layer's last matmul (MLP down) is not redone
            last = 0.0 if m.is_moe_layer(i) else m.d_model * m.d_ff / layout.tp
            rc = 2.0 * ((tp_part - last) * tokens + moe * moe_tokens)
            rc_dense += rc
            counted_dense += 2.0 * (layout.tp * (tp_part - last) * tokens + moe * moe_tokens)
    attention = (a_fwd + a_bwd) * n_layers
    head = 6.0 * m.d_model * m.vocab_size / layout.tp * tokens if has_head else 0.0
    rc_attn = a_fwd * n_layers if layout.recompute in ("full", "selective") else 0.0
    total = dense + attention + head + rc_dense + rc_attn
    # torch's FlopCounterMode runs above DTensor's dispatch: the tensor-parallel projections (DTensor inputs)
    # count at their global shapes, i.e. the whole TP group's work, while the attention kernel and the MoE
    # layers get local tensors
    counted = counted_dense + layout.tp * head + attention + rc_attn
    return {"dense": dense, "attention": attention, "head": head, "recompute_dense": rc_dense,
            "recompute_attention": rc_attn, "total": total, "flop_counter": counted}


# ----------------------------------------------------------------------------- all-to-all


def rank_a2a(m: ModelSpec, layout: Layout, rank: int, seq: int, global_batch: int, micro_batch: int,
             mach: Any = None) -> dict[str, float]:
    """The expert-parallel all-to-alls ``rank`` runs in one step: 4 per MoE layer it holds and micro-batch
    (dispatch and combine, and each again backwards; 6 with full recomputation, which redoes the forward's),
    each sending k x its tokens rows of d_model fp32 (the tokens it routes: the micro-batch's local sequence,
    / tp under sequence parallelism), balanced routing assumed. -> calls, bytes sent (this rank's own
    chunk included, as all_to_all_single's input is) and, given a measured machine, seconds (its
    all-to-all row, else its all-gather's: both move (n-1)/n of the buffer per rank)."""
    if layout.ep == 1 or not m.is_moe:
        return {"calls": 0, "bytes": 0.0, "seconds": 0.0}
    c = coords(layout, rank)
    ranges = stage_layers(m.n_layers, layout.pp * layout.v)
    n_moe = sum(m.is_moe_layer(i) for s in local_stage_ids(layout, c["pp"]) for i in ranges[s])
    n_micro = global_batch // layout.dp // micro_batch
    tokens = micro_batch * seq // layout.cp // (layout.tp if layout.tp > 1 and layout.sp else 1)
    one = a2a_rows(m, tokens) * m.d_model * FP32
    calls = (6 if layout.recompute == "full" else 4) * n_moe * n_micro
    out = {"calls": calls, "bytes": calls * one, "seconds": 0.0}
    if mach is not None:
        out["seconds"] = calls * a2a_time(mach, one, layout.ep)
    return out


def a2a_time(mach: Any, nbytes: float, n: int) -> float:
    """Seconds of one all-to-all of ``nbytes`` over ``n`` ranks on a measured machine."""
    try:
        return mach.collective_time("all_to_all", nbytes, n)
    except KeyError:  # calibrate's table has no all-to-all row: an all-gather moves as much per rank
        return mach.collective_time("all_gather", nbytes, n)


# ----------------------------------------------------------------------------- step time


# Non-matmul work (norms, RoPE, head repeats, SiLU, residual adds and their gradients) is memory-bound:
# calibrate measures it on a real layer (its time less its GEMMs and attention kernel) per token; a rank's
# share scales with the activations its layer touches, which layer_saved_bytes counts exactly. Without a
# measurement: 3 passes over those bytes (written in the forward, read and their gradient written in the
# backward) at the copy bandwidth, a roofline memory term (Williams et al. 2009).
ELEMENTWISE_PASSES = 3
# calibrate counts the causal attention kernel as 3 x 2·b·h·s²·d (forward 2, backward 4); the dense count
# of the same shapes here is 14·b·h·s²·d (forward 4, FlashAttention backward 10): a kernel that skips the
# masked half runs at (dense count / 2) / time
_ATTN_COUNT = 6 / 14


def layer_step_time(m: ModelSpec, layout: Layout, micro_batch: int, seq: int, mach: Any) -> dict[str, float]:
    """Seconds of one decoder layer, forward + backward (+ recomputation), for one micro-batch on one rank:
    GEMMs at the measured matmul FLOP/s; the attention kernel at the measured attention FLOP/s (under CP it
    gets an explicit mask and cannot skip the masked half); the memory-bound work between the matmuls
    (ELEMENTWISE_PASSES); the tensor-parallel collectives (2 per layer each way: all-reduces, or all-gather
    + reduce-scatter with SP; Korthikanti et al. 2022 Sec. 4.2.2) and DTensor's measured overhead; the
    context-parallel K/V all-gathers and gradient reduce-scatters (Llama 3 Sec. 3.3.2); the layer's measured
    fixed cost per call (calibrate's ``layer_fixed_seconds``: what a micro-batch costs beyond its tokens).
    Full recomputation runs the forward's share of each again."""
    lo, e = layout, FP32
    tokens = micro_batch * (seq // lo.cp)
    sp = lo.tp > 1 and lo.sp
    w_layer = layer_matmul_params(m) / lo.tp
    last = m.d_model * m.d_ff / lo.tp
    a_fwd, a_bwd = attention_matmul_flops(m, tokens, seq, lo.tp)
    attn_rate = mach.attention_flops / _ATTN_COUNT / (2.0 if lo.cp > 1 else 1.0)  # dense FLOPs per second
    mm = 6.0 * w_layer * tokens / mach.matmul_flops
    attn = (a_fwd + a_bwd) / attn_rate
    none = Layout(**{**lo.model_dump(), "recompute": "none"})
    touched = layer_saved_bytes(m, tokens, seq, none, e)
    if mach.elementwise_seconds_per_token:  # measured on a whole layer at one process's shapes
        whole = layer_saved_bytes(m, tokens * lo.cp, seq, Layout(), e)  # the same tokens unsharded
        elem = mach.elementwise_seconds_per_token * tokens * lo.cp * touched / whole
    else:
        elem = ELEMENTWISE_PASSES * touched / mach.memory_bandwidth
    act = tokens * m.d_model * e
    tp_one_way = (2 * (mach.collective_time("all_gather", act, lo.tp) + mach.collective_time("reduce_scatter", act,
                                                                                               lo.tp))
                  if sp else 2 * mach.collective_time("all_reduce", act, lo.tp))
    tp_extra = mach.tensor_parallel_overhead(lo.tp) * tokens if lo.tp > 1 else 0.0
    kv = micro_batch * seq * 2 * max(m.n_kv_heads // lo.tp, 1) * m.head_dim * e
    cp_fwd = mach.collective_time("all_gather", kv, lo.cp)
    cp_bwd = mach.collective_time("reduce_scatter", kv, lo.cp)
    comm = 2 * tp_one_way + tp_extra + cp_fwd + cp_bwd
    fixed = mach.layer_fixed_seconds
    if lo.recompute == "full":
        fixed += fixed / 3  # the forward's share again (the backward does about twice the forward's work)
        mm += 2.0 * (w_layer - last) * tokens / mach.matmul_flops
        attn += a_fwd / attn_rate
        elem += elem / ELEMENTWISE_PASSES
        comm += tp_one_way + tp_extra / 3 + cp_fwd
    elif lo.recompute == "selective":
        attn += a_fwd / attn_rate
    return {"matmul": mm, "attention": attn, "elementwise": elem, "communication": comm, "fixed": fixed,
            "total": mm + attn + elem + comm + fixed}


def _dp_time(m: ModelSpec, lo: Layout, rank: int, n_micro: int, mach: Any, layers: list[int]) -> tuple[float, int]:
    """(seconds of the data-parallel collectives of one step on ``rank``, the weights its AdamW updates): zero0 one
    all-reduce, zero1 a reduce-scatter and an all-gather, FSDP unit by unit; ``layers`` are the rank's layers."""
    e = FP32
    local = sum(prod(s) for _, s in rank_tensors(m, lo, rank))  # the weights this rank holds
    shard = sum(prod(s) for _, s in rank_tensors(m, lo, rank, optimizer=True))  # the weights its AdamW updates
    n_shard = lo.dp_shard * lo.ep * lo.cp  # the dense FSDP group (a MoE's experts shard over dp_shard x cp)
    full = local * (n_shard if lo.zero >= 2 else 1)  # this rank's share before FSDP's cut
    if lo.zero == 0:
        t_dp = mach.collective_time("all_reduce", full * e, lo.dp * lo.cp)
    elif lo.zero == 1:
        # runtime/parallel/zero1.py: one flat reduce-scatter of the gradients and one all-gather of the updated
        # weights over the shard group, the shards' all-reduce over HSDP's replicas
        t_dp = (mach.collective_time("reduce_scatter", full * e, n_shard)
                + mach.collective_time("all_gather", full * e, n_shard)
                + mach.collective_time("all_reduce", shard * e, lo.dp_replicate))
    else:
        # FSDP2 gathers unit by unit (runtime/parallelize.apply_fsdp: each block, a MoE block's experts, and
        # the rest of the stage): each unit's collective pays its own latency
        units = len(layers) + 1 + sum(map(m.is_moe_layer, layers))
        gathers = (2 if lo.zero == 3 else 1) * n_micro
        # runtime/train.py: a reduce-scatter per micro-batch (each rank accumulates only its gradient shard),
        # HSDP's all-reduce of the shards over the replicas once per step; under a pipeline torch's stage turns
        # the sync off until its last backward (pipelining/stage.py: one reduce-scatter per step)
        scatters = n_micro if lo.pp == 1 else 1
        t_dp = (gathers * units * mach.collective_time("all_gather", full * e / units, n_shard)
                + scatters * units * mach.collective_time("reduce_scatter", full * e / units, n_shard)
                + mach.collective_time("all_reduce", local * e, lo.dp_replicate))
    return t_dp, shard


def rank_step_time(m: ModelSpec, layout: Layout, rank: int, seq: int, global_batch: int, mach: Any,
                   micro_batch: int) -> dict[str, float]:
    """Seconds of one training step on ``rank`` of this runtime on a measured machine (estimate/measured/machine.py).

    Each micro-batch runs the rank's stages' layers (``layer_step_time``), the output head (its logits
    gathered under TP, the loss) on the last stage and the embedding's partial sums under TP on the first,
    and a send and a receive per micro-batch and stage boundary. Through the pipeline: m + (p-1)/v
    stage-times of the slowest stage (Narayanan et al. 2021 Eq. 1). Then the data-parallel traffic (zero0:
    one gradient all-reduce; zero1: one reduce-scatter and one all-gather; FSDP: per-block all-gathers in the
    forward, again in the backward under zero3, and a reduce-scatter per micro-batch, one under a pipeline), the
    gradient-norm all-reduce and AdamW (on the optimizer's shard). On a CPU the collectives share the
    cores with the compute: nothing overlaps."""
    from trainscale.estimate.pipeline import pipeline_time

    c = coords(layout, rank)
    lo, e = layout, FP32
    n_stages = lo.pp * lo.v
    ranges = stage_layers(m.n_layers, n_stages)
    n_micro = global_batch // lo.dp // micro_batch
    tokens = micro_batch * (seq // lo.cp)
    sp = lo.tp > 1 and lo.sp
    act = tokens * m.d_model * e
    t_layer = layer_step_time(m, lo, micro_batch, seq, mach)["total"]
    t_head = (6.0 * m.d_model * m.vocab_size / lo.tp * tokens / mach.head_matmul_flops
              + 2 * mach.collective_time("all_gather", tokens * m.vocab_size * e, lo.tp)
              + ELEMENTWISE_PASSES * tokens * m.vocab_size * FP32 / mach.memory_bandwidth)
    t_embed = 0.0
    if lo.tp > 1:  # the vocabulary-sharded embedding's partial sums
        t_embed = (mach.collective_time("reduce_scatter", act, lo.tp) if sp
                   else mach.collective_time("all_reduce", act, lo.tp))
    t_p2p = 2 * lo.v * mach.collective_time("send_recv", act / (lo.tp if sp else 1), 2) if lo.pp > 1 else 0.0

    # a MoE layer's all-to-alls per micro-batch (rank_a2a), added to its layer time
    a2a_layer = 0.0
    if lo.ep > 1 and m.is_moe:
        rows = a2a_rows(m, tokens / (lo.tp if sp else 1))
        a2a_layer = (6 if lo.recompute == "full" else 4) * a2a_time(mach, rows * m.d_model * e, lo.ep)

    def layers_on(pp_rank: int) -> list[int]:
        """The layers of pipeline rank ``pp_rank``'s stages."""
        return [i for s in local_stage_ids(lo, pp_rank) for i in ranges[s]]

    def micro_time(pp_rank: int) -> float:
        """One micro-batch through the stages of pipeline rank ``pp_rank``."""
        ids = local_stage_ids(lo, pp_rank)
        layers = layers_on(pp_rank)
        t = len(layers) * t_layer + sum(map(m.is_moe_layer, layers)) * a2a_layer + t_p2p
        return t + (t_head if n_stages - 1 in ids else 0.0) + (t_embed if 0 in ids else 0.0)

    t_micro = micro_time(c["pp"])
    # the pipeline runs at its slowest stage (Narayanan et al. 2021 Eq. 1); the ranks meet at the step's end
    t_compute = float(pipeline_time(max(micro_time(r) for r in range(lo.pp)), n_micro, lo.pp, lo.v))

    t_dp, shard = _dp_time(m, lo, rank, n_micro, mach, layers_on(c["pp"]))
    t_norm = mach.collective_time("all_reduce", 8, lo.world_size)
    t_opt = shard * mach.optimizer_seconds_per_param
    total = t_compute + t_dp + t_norm + t_opt
    return {"compute": t_compute, "data_parallel": t_dp, "optimizer": t_opt + t_norm, "total": total,
            "per_microbatch": t_micro,
            "all_to_all": rank_a2a(m, lo, rank, seq, global_batch, micro_batch, mach)["seconds"]}
