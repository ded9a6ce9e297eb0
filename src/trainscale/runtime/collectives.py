"""Small host values through a collective: on the group's device, reduced, read back once.

NCCL takes only tensors on the GPU (gloo, in the tests, takes host tensors too, so a host tensor handed to a
collective passes every CPU test and crashes the first GPU run). Every collective in runtime/ builds its tensor on
``group_device`` (tests/test_runtime_collectives.py reads runtime/ for a tensor made without a device and handed to a
collective); the few numbers a step shares (flags, counts, seconds) go through ``reduce_host``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a collective of ``group`` (default: the world) takes its tensors on: NCCL's GPU, else the host."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_host(values: Sequence[float] | torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``values`` reduced over ``group`` with ``op`` -> a host tensor of the same shape (one copy back). Values
    already on a device stay there until the reduction is done. Without a group of several ranks: the values."""
    t = torch.as_tensor(values, dtype=dtype).to(group_device(group))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t.cpu()
