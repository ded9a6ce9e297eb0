"""Apply a Layout to (a pipeline stage of) the model, in one fixed order (torchtitan's):

  1. tensor parallel + sequence parallel  DTensor ``parallelize_module`` (Megatron-LM, Shoeybi et al.
     2019; SP: Korthikanti et al. 2022, arXiv 2205.05198)
  1b. expert parallel                      a MoE's routed experts split over the "ep" mesh dim
                                           (``apply_expert_parallel``; the all-to-alls are runtime/moe.py's)
  2. context parallel                      ``context.apply_context_parallel`` (the attention kernel)
  3. activation checkpointing              none / selective (the attention core) / full (each block)
  4. torch.compile                         each transformer block compiled in place (``--compile``)
  5. data parallel                         FSDP2 ``fully_shard`` (zero2 / zero3: ZeRO, Rajbhandari et al.
                                           2020; HSDP when dp_replicate > 1), or, with zero0, replicated
                                           weights and one gradient all-reduce per step
                                           (``allreduce_gradients``); zero1 keeps zero0's replicated
                                           weights here and shards the optimizer (runtime/parallel/zero1.py)

Precision ("bf16" | "fp32"): where FSDP applies, its ``MixedPrecisionPolicy`` gathers bf16 weights and
computes in bf16 while the sharded master weights, the optimizer and the gradient reduce-scatter stay
fp32 (Micikevicius et al. 2018, arXiv 1710.03740); where it does not (zero0, single process), bf16
autocast around the forward pass over fp32 weights (``autocast_for``). Same on CPU and GPU.

Pipeline parallelism is applied before all of these (runtime/parallel/pipeline.py cuts the model into stages;
each stage is parallelized here). Parameter names never change: no wrapper modules are inserted, so
a state dict (and a checkpoint) has the names of ``estimate.params.tensor_inventory``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import checkpoint

from trainscale import rules
from trainscale.errors import TrainscaleError
from trainscale.placement import EMBEDDINGS, tp_plan
from trainscale.runtime.model import Transformer
from trainscale.runtime.moe import MoE
from trainscale.runtime.parallel import context
from trainscale.runtime.parallel.mesh import ParallelMesh
from trainscale.specs import Layout

CP_RULES = ("cp_window", "cp_softcap")  # rules.py: what context parallelism's attention does not compute

# ----------------------------------------------------------------------------- 1. tensor parallel


def _tp_style(style: str, name: str, sp: bool, n_inputs: int = 1) -> object:
    """One entry of ``placement``'s TP plan as the DTensor ParallelStyle that does it. Under SP the residual
    stream between sub-layers is sharded on the sequence (dim 1), else replicated."""
    seq = Shard(1) if sp else Replicate()
    if style == "colwise":  # the head takes the residual stream and returns whole logits
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate()) if name == "output" else ColwiseParallel()
    if style == "rowwise":  # embeddings take (replicated) token ids; projections take sharded features
        if name in EMBEDDINGS:
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        return RowwiseParallel(output_layouts=seq)
    if style == "sequence":
        return SequenceParallel()
    if style == "gather":  # the sub-layer's first input (the hidden states) made whole; the rest untouched
        rest = (None,) * (n_inputs - 1)
        return PrepareModuleInput(input_layouts=(seq, *rest), desired_input_layouts=(Replicate(), *rest))
    raise ValueError(f"unknown tensor-parallel style {style!r}")


_GATHER_INPUTS = {"attention": 3, "feed_forward": 1}  # positional inputs of Attention(x, cos, sin) and MLP(x)


def apply_tensor_parallel(model: Transformer, mesh: ParallelMesh, sp: bool) -> None:
    """The TP plan of ``trainscale.placement`` (column-parallel Q/K/V and MLP-up, row-parallel attention-out and
    MLP-down: one all-reduce, or with SP one all-gather + one reduce-scatter, per sub-layer; with SP the norms
    and the residual stream between sub-layers hold seq/tp tokens per rank) on this stage's modules."""
    tp = mesh["tp"]
    model_plan, block_plan = tp_plan(sp)
    top = {name: _tp_style(style, name, sp) for name, style in model_plan.items()
           if getattr(model, name, None) is not None and (name != "output" or model.has_head)}
    if top:
        parallelize_module(model, tp, top)
    for block in model.layers.values():
        plan = {name: _tp_style(style, name, sp, _GATHER_INPUTS.get(name, 1)) for name, style in block_plan.items()
                if _has(block, name)}  # w3 only in a gated (SwiGLU) MLP
        parallelize_module(block, tp, plan)
        if getattr(block.attention, "whole_qk_norm", False):  # OLMo-2: this rank's heads' rows of the gains
            for n in ("q_norm", "k_norm"):
                norm = block.attention.get_submodule(n)
                norm.weight = nn.Parameter(distribute_tensor(norm.weight.data, tp, [Shard(0)]))
                norm.group = tp.get_group()  # the sum of squares all-reduced over the projection's shards
        elif _has(block, "attention.q_norm"):  # Qwen3's per-head norms: on this rank's heads (dim 2), gains whole
            parallelize_module(block, tp, {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                                           for n in ("q_norm", "k_norm")})
        if sp and _has(block, "attention_post_norm"):  # Gemma 2's output norms: on this rank's seq/tp tokens
            parallelize_module(block, tp, {n: SequenceParallel(use_local_output=True)
                                           for n in ("attention_post_norm", "ffn_post_norm")})
        if sp and _has(block, "moe"):  # the MoE takes this rank's seq/tp tokens as a plain tensor (see below)
            parallelize_module(block, tp, {"moe": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)})


def _has(module: nn.Module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False


# ----------------------------------------------------------------------------- 1b. expert parallel


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: Transformer, mesh: ParallelMesh, layout: Layout) -> None:
    """Each MoE layer's routed experts split over the mesh's "ep" dim: ``w1``/``w3``/``w2`` become DTensors
    sharded on the expert dim 0 (rank r of the ep group holds experts r E/ep .. (r+1) E/ep - 1), so the
    checkpoint (DCP) stores whole tensors and loads them under any ep. The MoE layer learns its groups:
    the ep group for the all-to-alls, and the groups that hold other tokens of its sequences (the
    balance loss counts per sequence).

    Tensor parallelism does not split a MoE layer (it covers attention and the dense FFNs). Without
    sequence parallelism the tp ranks hold the same tokens and run the MoE layer identically (their
    gradients are equal copies, as for any replicated weight). With SP each tp rank routes its own
    seq/tp tokens (``apply_tensor_parallel`` hands them over as a plain tensor): the MoE weights' gradients
    are then partial sums over the tp ranks, which ``sum_moe_gradients_over_tp`` adds up."""
    layers = moe_layers(model)
    lo = layout
    seq_groups = ([mesh.group("cp")] if lo.cp > 1 else []) + ([mesh.group("tp")] if lo.tp > 1 and lo.sp else [])
    for moe in layers:
        moe.seq_groups = tuple(seq_groups)
        moe.seq_split = lo.tp if lo.tp > 1 and lo.sp else 1
        if lo.ep == 1:
            continue
        moe.ep_group = mesh.group("ep")
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.data, mesh["ep"], [Shard(0)], src_data_rank=None)  # every rank has p whole
            moe.experts.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights (what EP splits; averaged over expert_dp, not dp_cp)."""
    return [p for m in moe_layers(model) for p in m.experts.parameters()]


def sum_moe_gradients_over_tp(params: list[nn.Parameter], mesh: ParallelMesh) -> None:
    """Under sequence parallelism each tp rank ran its MoE layers on its own tokens: add the partial
    gradients of the MoE weights (router, experts, shared expert) over the tp group."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.group("tp"))
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# ----------------------------------------------------------------------------- 3. activation checkpointing


def _checkpointed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """full: keep only each block's input, recompute the block in the backward pass (Chen et al. 2016,
    arXiv 1604.06174). selective: recompute only softmax(QK^T)V, the attention core whose activations
    grow with seq^2 (Korthikanti et al. 2022, Sec. 5). The forward methods are wrapped in place, so no
    module (and no parameter name) is added."""
    if mode == "none":
        return
    for block in model.layers.values():
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        elif mode == "selective":
            block.attention.core = _checkpointed(block.attention.core)
        else:
            raise ValueError(f"recompute mode {mode!r}")


# ----------------------------------------------------------------------------- 4. compile


def apply_compile(model: Transformer) -> None:
    """torch.compile each transformer block in place (``nn.Module.compile``): no wrapper module, so the
    parameter names stay; every block has the same code, so the compiled graph is reused. After TP, CP
    and activation checkpointing (they change what the block computes), before FSDP (whose hooks run
    around the compiled block), as torchtitan orders them."""
    for block in model.layers.values():
        block.compile()


# ----------------------------------------------------------------------------- precision

PRECISIONS = ("auto", "bf16", "fp32")


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto": bf16 on GPUs, fp32 on CPU (where fp32 is as fast and the parity tests are exact)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def mixed_precision_policy(precision: str):
    """FSDP2's policy for ``precision``: bf16 gathered weights and compute, fp32 gradient reduction; None
    for fp32 (FSDP's default: everything in the parameters' dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision != "bf16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast_for(precision: str, layout: Layout, device: torch.device):
    """The context the forward pass runs in: bf16 autocast where bf16 is asked for and FSDP does not
    apply (FSDP's policy casts the weights itself), else nothing."""
    if precision == "bf16" and not uses_fsdp(layout):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- 5. data parallel


def apply_fsdp(model: Transformer, mesh: ParallelMesh, layout: Layout, precision: str = "fp32") -> None:
    """FSDP2: each block is one all-gather / reduce-scatter unit, the rest (embeddings, head) another.
    Gradients and optimizer state are sharded either way. zero3 frees the gathered weights after the
    forward and gathers them again for the backward (reshard_after_forward); zero2 keeps them from the
    forward through the backward. FSDP2 has no ZeRO-1 (whole gradients, sharded optimizer): zero1 is
    runtime/parallel/zero1.py's, on zero0's replicated weights. With bf16,
    ``mixed_precision_policy``: the all-gathers move half the bytes of fp32's."""
    if layout.zero not in (2, 3):
        raise ValueError(f"FSDP2 runs zero2 or zero3, not zero{layout.zero}")
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.fsdp_mesh()
    reshard = layout.zero == 3
    kw = {"mp_policy": policy} if (policy := mixed_precision_policy(precision)) is not None else {}
    for block in model.layers.values():
        if _has(block, "moe"):
            # a MoE layer's routed experts: their own unit, sharded over the ranks that hold the same experts
            # (expert_shard: dp_shard x cp; with HSDP, x dp_replicate replicas), on dim 1, since the ep dim
            # already splits dim 0 (as torchtitan's apply_fsdp does when experts are few). Their gradient is
            # the sum of every ep rank's tokens': divided by all dp x cp ranks, like the dense weights'.
            experts = block.moe.experts
            fully_shard(experts, mesh=mesh.expert_fsdp_mesh(), reshard_after_forward=reshard,
                        shard_placement_fn=lambda _p: Shard(1), **kw)
            experts.set_gradient_divide_factor(float(layout.dp * layout.cp))
            if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM: sum, then divide
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, **kw)


def uses_fsdp(layout: Layout) -> bool:
    """zero2 and zero3 run FSDP2; zero0 and zero1 replicate the weights."""
    return layout.zero >= 2


def gradient_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The group whose ranks hold replicas of the same weights and all-reduce their gradients (zero0): every
    dp and cp rank with this rank's pp and tp coordinate. None otherwise (zero1 reduce-scatters its own,
    runtime/parallel/zero1.py; FSDP2 its own)."""
    lo = mesh.layout
    if lo.zero != 0 or lo.dp * lo.cp == 1:
        return None
    return mesh.group("dp_cp")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def allreduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None,
                        divide: int | None = None) -> None:
    """Replicated data parallel (DDP's math): average gradients over ``group`` in one flat bucket (sum, then
    divide by ``divide``, by default the group's size; ``group`` None: divide only)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= divide if divide is not None else dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def settle_gradient_placements(params: list[nn.Parameter]) -> None:
    """Put every DTensor gradient on its parameter's placement, before the norm and the optimizer.

    DTensor's embedding backward leaves the TP-sharded table's gradient whole (Replicate) or pending
    (Partial): redistributed to the parameter's placement, the rank keeps only its shard (found by
    train --compare-plan: each TP rank held the whole embedding gradient). Any other pending (Partial)
    gradient is reduced (to Replicate)."""
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor):
            continue
        if isinstance(p, DTensor) and g.placements != p.placements and g.device_mesh == p.device_mesh:
            p.grad = g.redistribute(placements=p.placements)
        elif any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, mesh: ParallelMesh) -> torch.Tensor:
    """Clip by the global gradient norm over every shard on every rank, with one all-reduce; -> the norm
    before clipping, a float64 scalar tensor on the gradients' device (read back only when a step logs: no host
    sync here). Reads the gradients' placements, never changes them (``settle_gradient_placements`` does, as its
    own step, before this one).

    Each rank adds the squares of its local gradient shard, weighted by 1 / (number of ranks holding an
    identical copy of that shard), so the world sum counts every element of every gradient once. The clipping
    is done on the device as torch's ``clip_grad_norm_`` does it with foreach: every gradient times
    clamp(max_norm / (norm + 1e-6), max=1), a factor of exactly 1 when the norm is within ``max_norm``."""
    lo = mesh.layout
    replicas = lo.dp * lo.cp * lo.tp  # ranks per pipeline stage
    by_copies: dict[int, list[torch.Tensor]] = {}
    scaled_only: list[torch.Tensor] = []  # a tied embedding's copy on the last pipeline stage: counted on the first
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tied_copy", False):
            scaled_only.append(_local(p.grad))
            continue
        g = p.grad
        copies = replicas
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError("a gradient is still pending a reduction (Partial): call "
                                   "settle_gradient_placements before clip_grad_norm")
            for size, pl in zip(g.device_mesh.shape, g.placements, strict=True):
                if pl.is_shard() or isinstance(pl, _StridedShard):  # FSDP2 and zero1 after TP on one dim
                    copies //= size
        by_copies.setdefault(copies, []).append(_local(g))
    total = torch.zeros((), dtype=torch.float64, device=next(iter(params)).device)
    for copies, grads in by_copies.items():  # one fused norm kernel per group (torch's clip_grad_norm_ does too)
        total += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum() / copies
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm > 0:
        # float64 as the host value was, cast to float32 as a Python scalar is for a float32 kernel (same bits)
        # (a division, as the host's was: a Python number over a tensor is a reciprocal times the number)
        scale = (torch.full_like(norm, max_norm) / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)
        for grads in [*by_copies.values(), scaled_only]:
            if grads:
                torch._foreach_mul_(grads, scale)
    return norm


# ----------------------------------------------------------------------------- the order


def parallelize(model: Transformer, mesh: ParallelMesh, layout: Layout, seq_len: int, precision: str = "fp32",
                compile: bool = False) -> None:
    """TP+SP -> EP -> CP -> activation checkpointing -> compile -> FSDP, in place, on one model (or pipeline
    stage). ``precision`` is resolved ("bf16" or "fp32"; see ``resolve_precision``)."""
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh, sp=layout.sp)
    apply_expert_parallel(model, mesh, layout)
    positions = context.local_positions(seq_len, layout.cp, mesh.cp_rank)
    model.positions = positions
    why = rules.first_broken(rules.case_of([layout], model.spec, seq_len), CP_RULES)
    if why:  # check_layout said it before any rank started; a direct caller (a probe) hears it here
        raise TrainscaleError(why)
    if layout.cp > 1:
        context.apply_context_parallel(model, mesh.group("cp"), positions, layout.cp, seq_len)
    apply_activation_checkpointing(model, layout.recompute)
    if compile:
        apply_compile(model)
    if uses_fsdp(layout):
        apply_fsdp(model, mesh, layout, precision)
