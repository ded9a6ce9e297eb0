"""Measure this machine (or the GPU it runs on): matmul FLOP/s at a model's shapes, memory
bandwidth, and the backend's collectives (all-reduce, all-gather, reduce-scatter, send/recv)
across process counts. The result is a hardware profile the planner can use instead of catalog
defaults.

Collective bandwidth is reported as *bus bandwidth* (NCCL-tests' convention, PERFORMANCE.md in
NVIDIA/nccl-tests): algbw = bytes / time; busbw = algbw x 2(n-1)/n for all-reduce and
x (n-1)/n for all-gather and reduce-scatter, so that it compares with the link bandwidth whatever
n is. Latency is the time of the smallest message; bandwidth is fitted from the largest.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainscale.specs import ModelSpec


def _timeit(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_flops(m: int, k: int, n: int, dtype: torch.dtype | None = None, repeat: int = 5) -> float:
    """Achieved FLOP/s of one [m,k] x [k,n] matmul: 2mkn / best time."""
    dev = device()
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    a = torch.randn(m, k, device=dev, dtype=dtype)
    b = torch.randn(k, n, device=dev, dtype=dtype)

    def run():
        torch.mm(a, b)
        _sync()

    return 2.0 * m * k * n / _timeit(run, repeat)


def model_matmul_shapes(spec: ModelSpec, tokens: int) -> dict[str, tuple[int, int, int]]:
    """The forward matmuls of one layer for ``tokens`` tokens: (m, k, n)."""
    d = spec.d_model
    return {"qkv": (tokens, d, spec.q_dim + 2 * spec.kv_dim), "attn_out": (tokens, spec.q_dim, d),
            "mlp_up": (tokens, d, spec.d_ff * (2 if spec.mlp == "swiglu" else 1)), "mlp_down": (tokens, spec.d_ff, d),
            "lm_head": (tokens, d, spec.vocab_size)}


def memory_bandwidth(nbytes: int = 256 * 2**20, repeat: int = 5) -> float:
    """Bytes/s of a large copy: read + write = 2 x bytes moved."""
    dev = device()
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        _sync()

    return 2.0 * nbytes / _timeit(run, repeat)


# ------------------------------------------------------------------ collectives

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeat: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res: dict[str, dict[int, float]] = {k: {} for k in BUS_FACTOR}
    for nbytes in sizes:
        numel = max(world, nbytes // 4) // world * world
        x = torch.ones(numel)
        shards = [torch.empty(numel // world) for _ in range(world)]
        chunk = torch.empty(numel // world)
        for name, op in _ops(x, shards, chunk, rank, world).items():
            def run(op=op):
                dist.barrier()
                op()
            res[name][numel * 4] = _timeit(run, repeat, warmup=1)
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _ops(x: torch.Tensor, shards: list[torch.Tensor], chunk: torch.Tensor, rank: int, world: int) -> dict:
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather(shards, chunk),
        "reduce_scatter": lambda: _reduce_scatter(chunk, list(x.chunk(world))),
        "send_recv": lambda: _ping(x, rank, world),
    }


def _reduce_scatter(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    try:
        dist.reduce_scatter(out, inputs)
    except RuntimeError:  # gloo has no reduce_scatter: all-reduce, keep our shard (same bytes on the wire x2)
        full = torch.cat(inputs)
        dist.all_reduce(full)
        out.copy_(full.chunk(len(inputs))[dist.get_rank()])


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_collectives(world: int, sizes: list[int] | None = None, repeat: int = 3) -> dict[str, Any]:
    """Time each collective with ``world`` gloo processes on this machine.

    -> {op: {"latency_s", "bus_bandwidth", "times": {bytes: seconds}}}; send_recv time is a round trip,
    halved for the one-way figure.
    """
    sizes = sizes or [4 * 1024, 4 * 2**20]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_collective_worker, args=(world, free_port(), sizes, repeat, q), nprocs=world, join=True,
                       start_method="spawn")
    raw = q.get(timeout=5)
    out: dict[str, Any] = {}
    for op, times in raw.items():
        if op == "send_recv":
            times = {b: t / 2 for b, t in times.items()}
        small, big = min(times), max(times)
        t_small, t_big = times[small], times[big]
        alg = (big - small) / max(t_big - t_small, 1e-9)  # slope: bandwidth without the latency
        out[op] = {"latency_s": t_small, "algbw": alg, "bus_bandwidth": alg * BUS_FACTOR[op](world),
                   "times": {str(b): t for b, t in times.items()}}
    return out
