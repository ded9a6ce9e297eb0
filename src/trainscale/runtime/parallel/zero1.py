"""ZeRO stage 1: the optimizer state sharded over the data-parallel ranks, whole weights and gradients on every
rank (Rajbhandari et al. 2020, arXiv 1910.02054 Sec. 5.1, "P_os"), as Megatron-LM's distributed optimizer runs
it (megatron/core/optimizer/distrib_optimizer.py: reduce-scatter the gradients to the rank that owns each
range, step the optimizer on that range, all-gather the updated weights).

The weights stay replicated on the dp ranks exactly as under zero0 (plain tensors, or TP/EP DTensors); for
each one, this rank's optimizer sees a *shard*: a DTensor whose local tensor is a view of this rank's chunk
of the weight, cut as FSDP2 cuts it (``torch.chunk`` over the dp_shard x cp ranks on dim 0, dim 1 for a MoE
layer's routed experts; a replica dim first with HSDP; ``_StridedShard`` where TP already split that dim),
on the mesh FSDP2 would put it on. ``torch.optim.AdamW`` runs on those shards, so its state has FSDP2's
shapes, placements and parameter names: a checkpoint written under zero1 loads under zero0/2/3 and any dp
degree, and back (``shadow``: a module holding the shards under the weights' names, for
torch.distributed.checkpoint.state_dict). The shard is a view, so the step updates this rank's chunk of its
weight in place; the all-gather then brings every other rank's chunk. No fp32 main-weight copy: the weights
are fp32 (bf16 runs autocast around the forward pass, as zero0 does).

A step: ``reduce_gradients`` (one flat reduce-scatter per shard group, the replicas' all-reduce with HSDP;
each rank's reduced chunk written into its own chunk of the whole gradient, which the shard's gradient
views), the norm and clipping over the shards (``shards``), ``step`` (AdamW on the shards, then one flat
all-gather per group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from trainscale.placement import chunk_len
from trainscale.runtime.parallel.mesh import ParallelMesh
from trainscale.runtime.parallel.parallelize import _local, expert_parameters


def _shards_dim(pl: Placement, dim: int) -> bool:
    return isinstance(pl, (Shard, _StridedShard)) and pl.dim == dim


@dataclass
class _Group:
    """The ranks one kind of weight is sharded over: ``shard`` (dp_shard x cp, or expert_shard for routed
    experts) inside ``replicate`` (HSDP's replica groups, None without), and the DTensor mesh of the shard."""

    mesh: DeviceMesh  # 1-D (shard) or 2-D (replicate, shard): ParallelMesh.fsdp_mesh / expert_fsdp_mesh
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    size: int
    index: int


@dataclass
class _Slot:
    """One weight, the dim its optimizer state is cut on, and this rank's shard of it (with its DTensor mesh and
    placements, ``_shard_spec``)."""

    param: nn.Parameter
    dim: int
    group: _Group
    shard: nn.Parameter | None = None
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()

    def __post_init__(self) -> None:
        self.mesh, self.placements = _shard_spec(self)
        self.shard = nn.Parameter(self.dtensor(self.chunk(self.local)), requires_grad=self.param.requires_grad)
        self.param.zero1_shard = self.shard  # what the gradient norm sees of it (pipeline.TiedEmbedding marks it)

    def dtensor(self, view: torch.Tensor) -> DTensor:
        """``view`` (this rank's chunk of the weight, or of its gradient) as a DTensor of the weight's shape."""
        p = self.param
        return DTensor.from_local(view, self.mesh, self.placements, run_check=False, shape=p.shape, stride=p.stride())

    @property
    def local(self) -> torch.Tensor:
        return _local(self.param).detach()

    @property
    def piece(self) -> int:
        """Rows of dim ``dim`` per rank (torch.chunk's ceil; the last ranks' chunks short or empty)."""
        n = self.local.shape[self.dim]
        return -(-n // self.group.size) if n else 0

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``t`` (the local weight's shape) on ``dim``: a view."""
        n = t.shape[self.dim]
        start = min(n, self.group.index * self.piece)
        return t.narrow(self.dim, start, chunk_len(n, self.group.size, self.group.index))

    def padded_rows(self, t: torch.Tensor, parts: int) -> torch.Tensor:
        """``t`` padded on ``dim`` to parts x piece rows, as [parts, piece x the other dims] (rank-major)."""
        n = t.shape[self.dim]
        if parts * self.piece > n:
            pad = list(t.shape)
            pad[self.dim] = parts * self.piece - n
            t = torch.cat([t, t.new_zeros(pad)], dim=self.dim)
        return t.movedim(self.dim, 0).reshape(parts, -1)

    def unpad(self, flat: torch.Tensor, parts: int) -> torch.Tensor:
        """The inverse of ``padded_rows``: [parts, piece x rest] -> parts x piece rows on ``dim`` (still padded)."""
        moved = list(self.local.movedim(self.dim, 0).shape)
        moved[0] = parts * self.piece
        return flat.reshape(moved).movedim(0, self.dim)

    def numel_piece(self) -> int:
        rest = prod(s for i, s in enumerate(self.local.shape) if i != self.dim)
        return self.piece * rest


def _shard_spec(slot: _Slot) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements FSDP2 gives a weight's shard (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
    ``_init_sharding_spec_tp``): the dp mesh (x the weight's own TP/EP mesh); Replicate on HSDP's replica dim,
    Shard on ``dim`` (``_StridedShard`` where TP/EP split that dim first), then the weight's own placements."""
    p, g = slot.param, slot.group
    mesh, inner, split = g.mesh, (), 1
    if isinstance(p, DTensor):
        mesh = DeviceMesh._concatenate([g.mesh, p.device_mesh])
        inner = tuple(p.placements)
        split = prod(p.device_mesh.size(i) for i, pl in enumerate(inner) if _shards_dim(pl, slot.dim))
    dp = _StridedShard(slot.dim, split_factor=split) if split > 1 else Shard(slot.dim)
    return mesh, ((Replicate(),) if g.replicate is not None else ()) + (dp, *inner)


def adamw_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (the norms' gains and the biases take none). Each of the two is split by
    the mesh its weights are DTensors on (plain tensors apart): AdamW's foreach and fused kernels take one list of
    tensors per call, and DTensor refuses a call that mixes plain tensors with DTensors, or two meshes (expert
    parallelism holds the routed experts on another mesh). One group each where they are all alike."""
    groups = []
    for decay, wanted in ((weight_decay, [p for p in params if p.ndim >= 2]),
                          (0.0, [p for p in params if p.ndim < 2])):
        by_mesh: dict[object, list[nn.Parameter]] = {}
        for p in wanted:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        groups += [{"params": ps, "weight_decay": decay} for ps in by_mesh.values()] or [
            {"params": [], "weight_decay": decay}]
    return groups


def _groups(mesh: ParallelMesh) -> tuple[_Group, _Group]:
    """(dense, routed experts): the shard groups FSDP2 would use (runtime/parallel/parallelize.apply_fsdp)."""
    rep = mesh.group("dp_replicate") if mesh.layout.dp_replicate > 1 else None

    def group(flat: str, dp_mesh: DeviceMesh) -> _Group:
        return _Group(dp_mesh, mesh.group(flat), rep, mesh[flat].size(), mesh.coord(flat))

    return group("dp_shard_cp", mesh.fsdp_mesh()), group("expert_shard", mesh.expert_fsdp_mesh())


class Zero1AdamW(torch.optim.AdamW):
    """AdamW on this rank's shards of one model part's weights (see the module docstring)."""

    def __init__(self, part: nn.Module, mesh: ParallelMesh, weight_decay: float, **adamw: object) -> None:
        self.layout = mesh.layout
        dense, experts = _groups(mesh)
        expert_ids = {id(p) for p in expert_parameters(part)}
        named = list(part.named_parameters())
        self.slots = [_Slot(p, 1, experts) if id(p) in expert_ids else _Slot(p, 0, dense) for _, p in named]
        self.shadow = _shadow_module([(name, s.shard) for (name, _), s in zip(named, self.slots, strict=True)])
        super().__init__(adamw_groups(self.shards, weight_decay), **adamw)

    @property
    def shards(self) -> list[nn.Parameter]:
        return [s.shard for s in self.slots]

    def _buckets(self) -> list[list[_Slot]]:
        """The slots by shard group (one flat collective each)."""
        by: dict[int, list[_Slot]] = {}
        for s in self.slots:
            by.setdefault(id(s.group.shard), []).append(s)
        return list(by.values())

    def reduce_gradients(self) -> None:
        """Average the whole gradients over the dp x cp ranks, each rank receiving only its chunk (reduce-scatter
        over the shard group, then all-reduce over the replicas), written into its chunk of the whole gradient;
        the shards' gradients are views of those chunks. Call after ``settle_gradient_placements``."""
        divide = self.layout.dp * self.layout.cp
        for slots in self._buckets():
            g = slots[0].group
            for s in slots:  # a weight no token reached here may have one elsewhere: every rank sends every chunk
                if s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
            grads = [_local(s.param.grad) for s in slots]
            flat = torch.cat([s.padded_rows(t, g.size) for s, t in zip(slots, grads, strict=True)], dim=1)
            if g.size > 1:
                mine = flat.new_empty(flat.shape[1])
                dist.reduce_scatter_single(mine, flat.reshape(-1), group=g.shard)
            else:
                mine = flat[0]
            if g.replicate is not None:
                dist.all_reduce(mine, group=g.replicate)
            mine /= divide
            offset = 0
            for s, t in zip(slots, grads, strict=True):
                n = s.numel_piece()
                chunk = s.chunk(t)
                chunk.copy_(s.unpad(mine[offset:offset + n], 1).narrow(s.dim, 0, chunk.shape[s.dim]))
                offset += n
                s.shard.grad = s.dtensor(chunk)

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every rank's updated chunks into every rank's whole weights (one all-gather per shard group)."""
        for bucket in self._buckets():
            g = bucket[0].group
            if g.size == 1:
                continue
            mine = torch.cat([_padded_chunk(s) for s in bucket])
            out = mine.new_empty(g.size * mine.numel())
            dist.all_gather_single(out, mine, group=g.shard)
            rows = out.view(g.size, -1)
            offset = 0
            for s in bucket:
                n = s.numel_piece()
                whole = s.unpad(rows[:, offset:offset + n], g.size)
                s.local.copy_(whole.narrow(s.dim, 0, s.local.shape[s.dim]))
                offset += n

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """AdamW on the shards (which updates this rank's chunks in place), then the all-gather."""
        loss = super().step(closure)
        self.gather_weights()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for s in self.slots:
            s.param.grad = None


def _padded_chunk(s: _Slot) -> torch.Tensor:
    """This rank's (short or empty) chunk padded to ``piece`` rows, flat."""
    chunk = s.chunk(s.local)
    pad = list(chunk.shape)
    pad[s.dim] = s.piece - chunk.shape[s.dim]
    return torch.cat([chunk, chunk.new_zeros(pad)], dim=s.dim).movedim(s.dim, 0).reshape(-1)


def _shadow_module(named: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """An empty module tree holding ``named`` parameters under their dotted names, so that
    torch.distributed.checkpoint.state_dict names the optimizer's state as it names FSDP2's."""
    root = nn.Module()
    for name, p in named:
        *path, leaf = name.split(".")
        mod = root
        for key in path:
            if key not in mod._modules:
                mod.add_module(key, nn.Module())
            mod = mod._modules[key]
        mod.register_parameter(leaf, p)
    return root


def optimizer_module(part: nn.Module, opt: torch.optim.Optimizer) -> nn.Module:
    """The module whose parameters ``opt`` steps (for get/set_optimizer_state_dict): the shards' under zero1."""
    return opt.shadow if isinstance(opt, Zero1AdamW) else part
