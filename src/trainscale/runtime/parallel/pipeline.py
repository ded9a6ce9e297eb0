"""Pipeline parallelism: the layers cut into ``pp * v`` stages, run by torch.distributed.pipelining.

Stage s holds the contiguous run of layers ``trainscale.placement`` gives it (the planner's cut: as even
as the layer count allows, the first and last stages the shorter ones, as Llama 3 places them); the
first stage also holds the embeddings, the last the final norm and the output head. A stage is the same Transformer
class sharing the full model's modules, so parameter names (``layers.17.attention.wq.weight``) are
those of the unsplit model. With ``v`` virtual stages per rank (interleaved 1F1B, Narayanan et al.
2021, arXiv 2104.04473), rank r holds stages r, r + pp, r + 2pp, ... ("looped" placement,
``placement.local_stage_ids``).

Schedules (torch.distributed.pipelining.schedules): GPipe (all forwards, then all backwards; Huang
et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2019) and interleaved 1F1B. Each splits the
rank's local batch into ``local_batch / mb`` microbatches; the loss of each is its mean token loss
and the schedule divides the accumulated gradients by the number of microbatches
(``scale_grads``), so the gradient is that of the mean over the local batch, as without a pipeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from trainscale.placement import MESH_DIMS, holds_embedding, holds_head, local_stage_ids, n_stages, stage_layers
from trainscale.runtime.model import Transformer, lm_loss
from trainscale.runtime.parallel.mesh import ParallelMesh
from trainscale.specs import Layout


def split_model(model: Transformer, layout: Layout, pp_rank: int) -> list[tuple[int, Transformer]]:
    """-> [(stage index, stage module)] for the stages this rank runs."""
    ranges = stage_layers(model.spec.n_layers, n_stages(layout))
    return [(s, model.stage(ranges[s], first=holds_embedding(s), last=holds_head(layout, s)))
            for s in local_stage_ids(layout, pp_rank)]


class Pipeline:
    """The stages this rank runs and the schedule that drives them."""

    def __init__(self, parts: list[tuple[int, Transformer]], layout: Layout, mesh: ParallelMesh,
                 device: torch.device, n_microbatches: int) -> None:
        group = mesh.group("pp")
        self.stages = [PipelineStage(mod, idx, n_stages(layout), device, group=group) for idx, mod in parts]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.tied = TiedEmbedding(parts, layout, mesh)
        if layout.schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches, loss_fn=lm_loss)
        elif layout.schedule == "gpipe":
            self.schedule = ScheduleGPipe(self.stages[0], n_microbatches, loss_fn=lm_loss)
        else:
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches, loss_fn=lm_loss)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward over all microbatches; -> the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return torch.stack([x.detach() for x in losses]).mean()
        self.schedule.step(*args, return_outputs=False)
        return None


def embedding_groups(mesh: ParallelMesh) -> list[list[int]]:
    """For every pipeline (the ranks with one dp / cp / tp coordinate), its first and its last stage's ranks
    (Megatron-LM's embedding group, parallel_state.initialize_model_parallel)."""
    ranks = mesh.world.mesh.movedim(MESH_DIMS.index("pp"), -1).reshape(-1, mesh.layout.pp)
    return [[int(row[0]), int(row[-1])] for row in ranks]


class TiedEmbedding:
    """A tied model's embedding under a pipeline: the first stage embeds with it, the last stage holds a copy
    (``Transformer.stage``) as its head. Megatron-LM's scheme (Shoeybi et al. 2019; its
    ``_allreduce_word_embedding_grads``): the copy starts equal to the first stage's table (an all-reduce in
    which the copy is zero) and after every backward the two gradients are summed over the embedding group, so
    both hold the gradient of the one tied weight and their AdamW steps stay equal. Gradient clipping counts
    the weight once (the copy is marked ``tied_copy``)."""

    def __init__(self, parts: list[tuple[int, Transformer]], layout: Layout, mesh: ParallelMesh) -> None:
        self.group: dist.ProcessGroup | None = None
        self.weight: torch.nn.Parameter | None = None
        if not parts or not parts[0][1].spec.tied_embeddings:
            return
        holders = [m for _, m in parts if m.tok_embeddings is not None and (m.embeds_tokens or m.has_head)]
        if layout.pp == 2:
            self.group = mesh.group("pp")  # the pipeline's two ranks are its embedding group: no new group
        else:
            for ranks in embedding_groups(mesh):  # every rank creates every group, in one order
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    self.group = g
        if not holders:
            return
        self.weight = holders[0].tok_embeddings.weight
        local = _local(self.weight)
        with torch.no_grad():
            if not holders[0].embeds_tokens:  # the last stage's copy: made equal to the first stage's table
                self.weight.tied_copy = True
                if getattr(self.weight, "zero1_shard", None) is not None:  # zero1: the norm runs over its shards
                    self.weight.zero1_shard.tied_copy = True
                local.zero_()
            dist.all_reduce(local, group=self.group)

    def sum_gradients(self) -> None:
        """Add the first and last stages' gradients of the tied weight (after each stage's own data-parallel
        reduction, on each rank's shard: both stages shard the table alike)."""
        if self.weight is not None and self.weight.grad is not None:
            dist.all_reduce(_local(self.weight.grad), group=self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
