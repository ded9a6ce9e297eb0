"""Context parallelism: the sequence split over ``cp`` ranks, attention over all of it.

Each rank holds ``seq / cp`` of every sequence's tokens and computes attention for its own queries
against the keys and values of the whole sequence, which it all-gathers from the cp group
(all-gather in the forward pass, reduce-scatter of the K/V gradients in the backward pass: each
rank's keys were used by every rank's queries). This is the all-gather form of context parallelism
Llama 3 trained with (arXiv 2407.21783, Sec. 3.3.2); torch's experimental ``context_parallel``
does ring attention on GPUs only.

Load balance under the causal mask: the sequence is cut into ``2 * cp`` chunks and rank r holds
chunks r and 2cp-1-r, so every rank has one early (cheap) and one late (expensive) chunk and all
ranks do the same attention work (Llama 3, Sec. 3.3.2; Megatron-LM's CP). The model's
``forward(tokens, positions)`` is given the global positions of the local tokens (RoPE angles),
and the attention mask compares query positions with the gathered key positions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def local_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens rank ``cp_rank`` holds: chunks r and 2cp-1-r of 2cp."""
    if cp == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} must be divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def shard_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The local slice [batch, seq/cp] of a [batch, seq] tensor (tokens or targets)."""
    return x[:, positions.to(x.device)]


class _GatherSeq(torch.autograd.Function):
    """[b, h, s_local, d] -> [b, h, cp * s_local, d] in cp-rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        xs = x.permute(2, 0, 1, 3).contiguous()  # seq first: the collective concatenates along dim 0
        out = xs.new_empty((n * xs.shape[0], *xs.shape[1:]))
        dist.all_gather_single(out, xs, group=group)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        gs = grad.permute(2, 0, 1, 3).contiguous()
        out = gs.new_empty((gs.shape[0] // n, *gs.shape[1:]))
        dist.reduce_scatter_single(out, gs, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.permute(1, 2, 0, 3), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherSeq.apply(x, group)


class ContextParallelAttention:
    """Drop-in for ``Attention.core``: local queries against all-gathered keys and values."""

    def __init__(self, group: dist.ProcessGroup, positions: torch.Tensor, cp: int, seq_len: int) -> None:
        self.group = group
        q_pos = positions
        k_pos = torch.cat([local_positions(seq_len, cp, r) for r in range(cp)])  # gathered order
        self.mask = k_pos[None, :] <= q_pos[:, None]  # [s_local, seq]: causal over global positions

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = gather_sequence(k, self.group), gather_sequence(v, self.group)
        if k.shape[1] != q.shape[1]:  # GQA: gather the few K/V heads, repeat after
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.mask.device != q.device:
            self.mask = self.mask.to(q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup, positions: torch.Tensor, cp: int,
                           seq_len: int) -> None:
    """Swap every layer's attention kernel for the context-parallel one."""
    core = ContextParallelAttention(group, positions, cp, seq_len)
    for block in model.layers.values():
        block.attention.core = core
