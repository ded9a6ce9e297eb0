"""The backend's collectives as FSDP, DDP, tensor parallelism and pipeline stages call them (all-reduce,
all-gather, reduce-scatter, send/recv), timed at a few message sizes, and reported as *bus bandwidth*
(NCCL-tests' convention, PERFORMANCE.md in NVIDIA/nccl-tests): algbw = bytes / time; busbw = algbw x
2(n-1)/n for all-reduce and x (n-1)/n for all-gather and reduce-scatter, so that it compares with the
link bandwidth whatever n is. Latency is the time of the smallest message; algbw is the slope between
the smallest and the largest message (bandwidth without the latency). Collectives keep the best of k
repeats, not the median: on a small shared machine their times are bimodal (the backend's cost, or that
plus a scheduler stall of milliseconds), and the median lands on either mode from one run to the next."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainscale.estimate.measured.machine import bus_factor
from trainscale.estimate.profile import COLLECTIVES
from trainscale.runtime.probe.calibrate.timing import compute_dtype, sync
from trainscale.specs import ModelSpec

# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25).
GRAD_BUCKET_BYTES = 25 * 2**20
SMALL_MESSAGE_BYTES = 4 * 1024

BUS_FACTOR = {op: (lambda n, op=op: bus_factor(op, n)) for op in COLLECTIVES}


def init_group(rank: int, world: int, port: int) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world
    # a collective that one rank never joins fails in minutes, not after the default half hour
    dist.init_process_group("nccl" if use_nccl else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    return torch.device("cuda", rank) if use_nccl else torch.device("cpu")


def collective_times(rank: int, world: int, dev: torch.device, sizes: list[int],
                     repeat: int) -> dict[str, dict[int, float]]:
    """{op: {bytes: best seconds on this rank}}; every rank runs the same ops in the same order."""
    res: dict[str, dict[int, float]] = {k: {} for k in BUS_FACTOR}
    for nbytes in sizes:
        numel = max(world, nbytes // 4) // world * world
        x = torch.ones(numel, device=dev)
        chunk = torch.empty(numel // world, device=dev)
        for name, op in _ops(x, chunk, rank, world).items():
            op()  # warm-up: connections, buffers
            times = []
            for _ in range(repeat):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                op()
                sync()
                times.append(time.perf_counter() - t0)
            res[name][numel * 4] = min(times)
    return res


def _ops(x: torch.Tensor, chunk: torch.Tensor, rank: int, world: int) -> dict:
    """The flat-tensor collectives FSDP and DDP call (all_gather_into_tensor, reduce_scatter_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: gather(x, chunk),
        "reduce_scatter": lambda: _reduce_scatter(scatter, chunk, x),
        "send_recv": lambda: _ping(x, rank, world),
    }


def _reduce_scatter(scatter: Callable, out: torch.Tensor, full: torch.Tensor) -> None:
    try:
        scatter(out, full)
    except RuntimeError:  # a backend without reduce_scatter: all-reduce, keep our shard (same bytes on the wire x2)
        dist.all_reduce(full)
        out.copy_(full.chunk(dist.get_world_size())[dist.get_rank()])


def _ping(x: torch.Tensor, rank: int, world: int) -> None:
    """Pairs (0,1), (2,3), ... exchange x once each way: point-to-point as pipeline stages use it."""
    peer = rank ^ 1
    if peer >= world:
        return
    if rank % 2 == 0:
        dist.send(x, peer)
        dist.recv(x, peer)
    else:
        dist.recv(x, peer)
        dist.send(x, peer)


def bandwidth_fit(times: dict[int, float]) -> tuple[float, float]:
    """(latency_s, algbw) from {bytes: seconds}: the smallest message's time, and the slope between the
    smallest and the largest (bytes / time of the largest if noise makes the slope non-positive)."""
    small, big = min(times), max(times)
    t_small, t_big = times[small], times[big]
    alg = (big - small) / (t_big - t_small) if t_big > t_small else big / t_big
    return t_small, alg


def summarize_collectives(raw: dict[str, dict[int, float]], world: int) -> dict[str, Any]:
    """{op: {"latency_s", "bus_bandwidth", "algbw", "times": {str(bytes): seconds}}}; send_recv's round
    trip is halved for the one-way figure."""
    out: dict[str, Any] = {}
    for op, times in raw.items():
        if op == "send_recv":
            times = {b: t / 2 for b, t in times.items()}
        latency, alg = bandwidth_fit(times)
        out[op] = {"latency_s": latency, "bus_bandwidth": alg * BUS_FACTOR[op](world), "algbw": alg,
                   "times": {str(b): t for b, t in sorted(times.items())}}
    return out


def message_sizes(spec: ModelSpec, tokens: int, quick: bool = False) -> list[int]:
    """Collective message sizes: a small one (latency), one micro-batch's activations (tokens x d_model,
    what TP / pipeline stages exchange) and a gradient bucket (DDP's 25 MiB; 1 MiB with ``quick``)."""
    act = tokens * spec.d_model * torch.empty((), dtype=compute_dtype()).element_size()
    bucket = 2**20 if quick else GRAD_BUCKET_BYTES
    return sorted({SMALL_MESSAGE_BYTES, act, max(bucket, act)})
