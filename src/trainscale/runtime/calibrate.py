"""Measure this machine (or the GPU it runs on): matmul FLOP/s at a model's shapes, attention, memory
bandwidth, the optimizer step, and the backend's collectives (all-reduce, all-gather, reduce-scatter,
send/recv) across process counts. The result is a hardware profile (TOML) the planner can use instead
of catalog defaults; ``trainscale calibrate`` writes it.

Every compute figure is what ONE process achieves while ``n`` processes run the same measurement at
the same time, each with one torch thread (CPU) -- the way training ranks run under torchrun -- and
the profile keeps the median over the processes. Each process times a measurement repeatedly for a
fixed wall-clock budget and keeps the median repeat, so all ``n`` contend for the whole window and one
lucky (uncontended) repeat does not set the figure.

Collective bandwidth is reported as *bus bandwidth* (NCCL-tests' convention, PERFORMANCE.md in
NVIDIA/nccl-tests): algbw = bytes / time; busbw = algbw x 2(n-1)/n for all-reduce and
x (n-1)/n for all-gather and reduce-scatter, so that it compares with the link bandwidth whatever
n is. Latency is the time of the smallest message; algbw is the slope between the smallest and the
largest message (bandwidth without the latency). Collectives keep the best of k repeats, not the median:
on a small shared machine their times are bimodal (the backend's cost, or that plus a scheduler stall of
milliseconds), and the median lands on either mode from one run to the next.
"""

from __future__ import annotations

import math
import os
import platform
import queue
import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainscale.errors import TrainscaleError
from trainscale.estimate.machine import COLLECTIVES as COLLECTIVE_OPS
from trainscale.estimate.machine import bus_factor
from trainscale.runtime.mesh import free_port
from trainscale.specs import ModelSpec

# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25).
GRAD_BUCKET_BYTES = 25 * 2**20
SMALL_MESSAGE_BYTES = 4 * 1024

# Wall-clock seconds each process spends timing one measurement (default, --quick).
_BUDGET = {"block": (1.5, 0.1), "layer": (1.5, 0.1), "head": (0.8, 0.1), "attention": (0.8, 0.1), "memory": (0.6, 0.05),
           "optimizer": (0.8, 0.1)}
_MEMORY_BYTES = (128 * 2**20, 32 * 2**20)  # per copy buffer; well above a CPU's last-level cache
_OPTIMIZER_PARAMS = (2_000_000, 250_000)
_COLLECTIVE_REPEAT = (9, 5)

COMPUTE_KEYS = ("matmul_flops", "head_matmul_flops", "attention_flops", "memory_bandwidth",
                "optimizer_seconds_per_param", "optimizer_bytes_per_param", "layer_seconds",
                "elementwise_seconds_per_token")


def _timeit(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _median_seconds(fn: Callable[[], Any], budget_s: float, min_repeat: int = 3, warmup: int = 1,
                    collective: bool = False) -> float:
    """Median time of ``fn`` over as many repeats as fit in ``budget_s`` (at least ``min_repeat``).

    ``collective``: ``fn`` runs collectives, so every rank of the process group must run it the same number
    of times (a rank that stops early leaves the others waiting in a collective it never joins: a hang).
    The ranks then agree after each repeat, outside the timed region, to go on only while all of them still
    have budget left."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while True:
        more = len(times) < min_repeat or (time.perf_counter() < end and len(times) < 10_000)
        if collective:
            flag = torch.tensor([int(more)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            more = bool(flag.item())
        if not more:
            break
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def compute_dtype() -> torch.dtype:
    """bf16 on a GPU (what training uses there), fp32 on a CPU."""
    return torch.bfloat16 if device().type == "cuda" else torch.float32


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def layer_linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(in_features k, out_features n) of every nn.Linear in one decoder layer of runtime/model.py:
    wq, wk, wv, wo, then the MLP (SwiGLU: w1, w3, w2; GELU: w1, w2)."""
    d = spec.d_model
    shapes = [(d, spec.q_dim), (d, spec.kv_dim), (d, spec.kv_dim), (spec.q_dim, d)]
    shapes += [(d, spec.d_ff)] * (2 if spec.mlp == "swiglu" else 1)
    return shapes + [(spec.d_ff, d)]


def linear_train_flops(shapes: list[tuple[int, int]], tokens: int) -> int:
    """FLOPs of forward + backward of linears (k, n) on ``tokens`` rows: forward [m,k]x[k,n], input
    gradient [m,n]x[n,k], weight gradient [k,m]x[m,n] = 3 x 2mkn each (Kaplan et al. 2020, 6N per token)."""
    return sum(6 * tokens * k * n for k, n in shapes)


def layer_matmul_flop_count(spec: ModelSpec, tokens: int) -> int:
    """FLOPs of one decoder layer's GEMMs, forward and backward, for ``tokens`` tokens."""
    return linear_train_flops(layer_linear_shapes(spec), tokens)


def attention_flop_count(spec: ModelSpec, micro_batch: int, seq_len: int) -> int:
    """Causal attention forward + backward: forward QK^T and PV = 4·b·h·s²·d, halved by the causal mask;
    backward twice the forward (Dao 2023, FlashAttention-2 §4 FLOP count), so 3 x 2·b·h·s²·d."""
    return 3 * 2 * micro_batch * spec.n_heads * seq_len**2 * spec.head_dim


def gemm_train_flops(shapes: list[tuple[int, int]], tokens: int, budget_s: float = 1.0, min_repeat: int = 3,
                     dtype: torch.dtype | None = None) -> float:
    """Achieved FLOP/s of the forward and backward GEMMs of linears (k, n) at ``tokens`` rows, laid out as
    nn.Linear runs them (weight [n, k]): y = x w^T, dx = dy w, dw = dy^T x."""
    dev, dtype = device(), dtype or compute_dtype()
    mats = []
    for k, n in shapes:
        x = torch.randn(tokens, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / math.sqrt(k)
        dy = torch.randn(tokens, n, device=dev, dtype=dtype)
        mats.append((x, w, dy, torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w)))

    def run():
        for x, w, dy, y, dx, dw in mats:
            torch.mm(x, w.t(), out=y)
            torch.mm(dy, w, out=dx)
            torch.mm(dy.t(), x, out=dw)
        _sync()

    return linear_train_flops(shapes, tokens) / _median_seconds(run, budget_s, min_repeat)


def attention_flops(spec: ModelSpec, micro_batch: int, seq_len: int, budget_s: float = 1.0, min_repeat: int = 3,
                    dtype: torch.dtype | None = None) -> float:
    """Achieved FLOP/s of causal scaled_dot_product_attention forward + backward on [b, n_heads, s, head_dim]."""
    import torch.nn.functional as F

    dev, dtype = device(), dtype or compute_dtype()
    shape = (micro_batch, spec.n_heads, seq_len, spec.head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=dtype)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
        _sync()

    return attention_flop_count(spec, micro_batch, seq_len) / _median_seconds(run, budget_s, min_repeat)


def memory_bandwidth(nbytes: int = 256 * 2**20, repeat: int = 5, budget_s: float | None = None) -> float:
    """Bytes/s of a large copy: read + write = 2 x bytes moved. Best of ``repeat``, or the median over
    ``budget_s`` seconds when given."""
    dev = device()
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        _sync()

    t = _timeit(run, repeat) if budget_s is None else _median_seconds(run, budget_s)
    return 2.0 * nbytes / t


def tensor_parallel_overhead(profile: dict[str, Any], n: int, spec: ModelSpec, seq_len: int, micro_batch: int,
                             layer_seconds: float) -> dict[str, float]:
    """The measured tensor-parallel layer against the same layer composed from this profile's figures
    (estimate/rank.py: GEMMs, attention, elementwise work, the TP collectives): what is left per token is
    DTensor's own cost (dispatch, redistribution copies), which no FLOP or byte count sees."""
    from trainscale.estimate.machine import machine_from_profile
    from trainscale.estimate.rank import layer_step_time
    from trainscale.specs import Layout

    mach = replace(machine_from_profile(profile, n), tensor_parallel={})
    composed = layer_step_time(spec, Layout(tp=n), micro_batch, seq_len, mach)["total"]
    return {"layer_seconds": layer_seconds, "composed_seconds": composed,
            "overhead_seconds_per_token": max(0.0, layer_seconds - composed) / (micro_batch * seq_len),
            "matmul_flops": profile["processes"][str(n)]["matmul_flops"]}


def elementwise_seconds_per_token(spec: ModelSpec, micro_batch: int, seq_len: int, fig: dict[str, float]) -> float:
    """A real layer's time less its GEMMs and attention kernel (at their measured rates), per token: the
    memory-bound work between the matmuls, which no FLOP count sees."""
    tokens = micro_batch * seq_len
    gemm = layer_matmul_flop_count(spec, tokens) / fig["matmul_flops"]
    attn = attention_flop_count(spec, micro_batch, seq_len) / fig["attention_flops"]
    return max(0.0, fig["layer_seconds"] - gemm - attn) / tokens


def _block_seconds(block: torch.nn.Module, spec: ModelSpec, micro_batch: int, rows: int, seq_len: int,
                   dev: torch.device, budget_s: float, min_repeat: int, collective: bool = False) -> float:
    """Median seconds of ``block`` forward + backward on [micro_batch, rows, d_model] (rows: this rank's share
    of the sequence), RoPE angles for the whole ``seq_len``."""
    from trainscale.runtime.model import rope_angles

    dtype = compute_dtype()
    x = torch.randn(micro_batch, rows, spec.d_model, device=dev, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(x)
    cos, sin = rope_angles(torch.arange(seq_len, device=dev), spec.head_dim, spec.rope_theta)

    def run():
        out = block(x, cos, sin)
        out.backward(dout)
        _sync()

    return _median_seconds(run, budget_s, min_repeat, collective=collective)


def block_seconds(spec: ModelSpec, micro_batch: int, seq_len: int, budget_s: float = 1.0, min_repeat: int = 3) -> float:
    """Median seconds of one real decoder layer (runtime/model.py's Block) forward + backward on
    [micro_batch, seq_len, d_model]: its GEMMs and attention kernel and everything between them (norms,
    RoPE, head repeats, activation function, residual adds) as the runtime runs them."""
    from trainscale.runtime.model import Block

    dev, dtype = device(), compute_dtype()
    with torch.device(dev):
        block = Block(spec).to(dtype)
    return _block_seconds(block, spec, micro_batch, seq_len, seq_len, dev, budget_s, min_repeat)


def tp_block_seconds(spec: ModelSpec, micro_batch: int, seq_len: int, world: int, dev: torch.device,
                     budget_s: float = 1.0, min_repeat: int = 3) -> float | None:
    """Median seconds of one real decoder layer under the runtime's tensor (+ sequence) parallel plan over
    all ``world`` processes of the current group (runtime/parallelize.py: DTensor column/row-parallel
    projections, sequence-sharded norms), forward + backward; None when ``world`` does not divide the heads,
    d_ff or the sequence. Every rank runs it at the same time."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainscale.runtime.model import build_model
    from trainscale.runtime.parallelize import apply_tensor_parallel

    if spec.n_heads % world or spec.n_kv_heads % world or spec.d_ff % world or seq_len % world:
        return None
    dtype = compute_dtype()
    model = build_model(spec.model_copy(update={"n_layers": 1}), dev).to(dtype)
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, {"tp": mesh}, sp=True)
    block = model.layers["0"]
    dist.barrier()
    return _block_seconds(block, spec, micro_batch, seq_len // world, seq_len, dev, budget_s, min_repeat,
                          collective=True)


def optimizer_shapes(spec: ModelSpec, target_params: int) -> list[tuple[int, ...]]:
    """Tensors shaped like one decoder layer's (repeated, or with fewer rows when a layer is larger than
    ``target_params``) adding up to about ``target_params`` parameters."""
    from trainscale.estimate.params import layer_tensors

    shapes = [shape for _, shape in layer_tensors(spec, 0)]
    per_layer = sum(math.prod(s) for s in shapes)
    if per_layer > target_params:
        f = target_params / per_layer
        return [(max(1, round(s[0] * f)), *s[1:]) if len(s) == 2 else s for s in shapes]
    return shapes * max(1, round(target_params / per_layer))


def optimizer_seconds_per_param(spec: ModelSpec, target_params: int = 2_000_000, budget_s: float = 1.0,
                                min_repeat: int = 3) -> float:
    """Seconds per parameter of one torch.optim.AdamW step (default implementation: foreach) over fp32
    parameters shaped like the model's layers."""
    dev = device()
    params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in optimizer_shapes(spec, target_params)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    opt.step()  # the first step allocates exp_avg / exp_avg_sq; not part of the steady state

    def run():
        opt.step()
        _sync()

    return _median_seconds(run, budget_s, min_repeat) / sum(p.numel() for p in params)


# ------------------------------------------------------------------ collectives

BUS_FACTOR = {op: (lambda n, op=op: bus_factor(op, n)) for op in COLLECTIVE_OPS}


def _init_group(rank: int, world: int, port: int) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world
    # a collective that one rank never joins fails in minutes, not after the default half hour
    dist.init_process_group("nccl" if use_nccl else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    return torch.device("cuda", rank) if use_nccl else torch.device("cpu")


def _collective_times(rank: int, world: int, dev: torch.device, sizes: list[int],
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
                _sync()
                t0 = time.perf_counter()
                op()
                _sync()
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


# ------------------------------------------------------------------ calibration


def message_sizes(spec: ModelSpec, tokens: int, quick: bool = False) -> list[int]:
    """Collective message sizes: a small one (latency), one micro-batch's activations (tokens x d_model,
    what TP / pipeline stages exchange) and a gradient bucket (DDP's 25 MiB; 1 MiB with ``quick``)."""
    act = tokens * spec.d_model * torch.empty((), dtype=compute_dtype()).element_size()
    bucket = 2**20 if quick else GRAD_BUCKET_BYTES
    return sorted({SMALL_MESSAGE_BYTES, act, max(bucket, act)})


def _steps() -> list[tuple[str, str]]:
    return [("layer_seconds", "one decoder layer"), ("matmul_flops", "layer GEMMs"),
            ("head_matmul_flops", "lm-head GEMMs"),
            ("attention_flops", "attention"), ("memory_bandwidth", "memory copy"),
            ("optimizer_seconds_per_param", "AdamW step")]


def calibration_steps(processes: list[int]) -> int:
    """How many times ``calibrate`` calls its ``progress`` callback."""
    return sum(len(_steps()) + (n > 1) for n in processes)


def _calibrate_worker(rank: int, world: int, port: int, spec: ModelSpec, seq_len: int, micro_batch: int,
                      quick: bool, sizes: list[int], barrier: Any, out: Any) -> None:
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    q = int(quick)
    tokens = seq_len * micro_batch
    minr = 2 if quick else 3
    d, v = spec.d_model, spec.vocab_size
    measure = {
        "layer_seconds": lambda: block_seconds(spec, micro_batch, seq_len, _BUDGET["block"][q], minr),
        "matmul_flops": lambda: gemm_train_flops(layer_linear_shapes(spec), tokens, _BUDGET["layer"][q], minr),
        "head_matmul_flops": lambda: gemm_train_flops([(d, v)], tokens, _BUDGET["head"][q], minr),
        "attention_flops": lambda: attention_flops(spec, micro_batch, seq_len, _BUDGET["attention"][q], minr),
        "memory_bandwidth": lambda: memory_bandwidth(_MEMORY_BYTES[q], budget_s=_BUDGET["memory"][q]),
        "optimizer_seconds_per_param": lambda: optimizer_seconds_per_param(spec, _OPTIMIZER_PARAMS[q],
                                                                           _BUDGET["optimizer"][q], minr),
    }
    res: dict[str, float] = {}
    for key, label in _steps():
        barrier.wait()  # all processes measure the same thing at the same time
        res[key] = measure[key]()
        if rank == 0:
            out.put(("step", label))
    out.put(("compute", res))
    if world > 1:
        dev = _init_group(rank, world, port)
        raw = _collective_times(rank, world, dev, sizes, _COLLECTIVE_REPEAT[q])
        tp = tp_block_seconds(spec, micro_batch, seq_len, world, dev, _BUDGET["block"][q], minr)
        if rank == 0:
            out.put(("collectives", {"raw": raw, "tp_layer_seconds": tp}))
        dist.barrier()
        dist.destroy_process_group()


def _run_group(n: int, spec: ModelSpec, seq_len: int, micro_batch: int, quick: bool, sizes: list[int],
               progress: Callable[[str], None]) -> tuple[list[dict[str, float]], dict | None]:
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(n, timeout=1800)
    pc = mp.start_processes(_calibrate_worker, args=(n, free_port(), spec, seq_len, micro_batch, quick, sizes,
                                                     barrier, q), nprocs=n, join=False, start_method="spawn")
    compute: list[dict[str, float]] = []
    raw = None
    while len(compute) < n or (n > 1 and raw is None):
        try:
            kind, payload = q.get(timeout=0.5)
        except queue.Empty:
            if pc.join(timeout=0):  # raises if a worker failed
                raise RuntimeError(f"calibration workers ({n} processes) exited without reporting") from None
            continue
        if kind == "step":
            progress(f"{n} process{'es' if n > 1 else ''}: {payload}")
        elif kind == "compute":
            compute.append(payload)
        else:
            raw = payload
            progress(f"{n} processes: collectives")
    while not pc.join():
        pass
    return compute, raw


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _memory_needed(spec: ModelSpec, seq_len: int, micro_batch: int, quick: bool) -> int:
    """Rough peak bytes one calibration process allocates (the largest of its measurements)."""
    es = torch.empty((), dtype=compute_dtype()).element_size()
    m = seq_len * micro_batch
    gemm = sum(2 * (m * k + n * k + m * n) for k, n in layer_linear_shapes(spec)) * es
    head = 2 * (m * spec.d_model + spec.vocab_size * spec.d_model + m * spec.vocab_size) * es
    att = (8 * micro_batch * spec.n_heads * seq_len * spec.head_dim + 3 * micro_batch * spec.n_heads * seq_len**2) * es
    return max(gemm, head, att, 2 * _MEMORY_BYTES[int(quick)], 16 * _OPTIMIZER_PARAMS[int(quick)])


def _check_inputs(spec: ModelSpec, seq_len: int, micro_batch: int, processes: list[int], quick: bool) -> None:
    if not processes:
        raise TrainscaleError("give at least one process count to calibrate with")
    bad = [n for n in processes if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise TrainscaleError(f"process counts must be positive integers, not {bad[0]!r}")
    for name, x in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise TrainscaleError(f"{name} must be a positive integer, not {x!r}")
    need = _memory_needed(spec, seq_len, micro_batch, quick)
    if torch.cuda.is_available():
        per_gpu = math.ceil(max(processes) / torch.cuda.device_count())
        have, where = torch.cuda.get_device_properties(0).total_memory / per_gpu, "GPU memory per process"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(processes)
        where = "memory per process"
    if need > 0.7 * have:
        raise TrainscaleError(f"calibrating {spec.name} at {micro_batch} x {seq_len} tokens needs about "
                              f"{need / 1e9:.1f} GB per process, more than 70% of the {have / 1e9:.1f} GB of {where}; "
                              f"use a smaller micro-batch or sequence length, or fewer processes")


def calibrate(spec: ModelSpec, seq_len: int, micro_batch: int, processes: list[int], quick: bool = False,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this machine at ``spec``'s shapes for ``micro_batch * seq_len`` tokens, with each process
    count in ``processes``. -> the hardware profile: {"machine": {...}, "processes": {"n": {...}},
    "collectives": {"n": {op: {...}}}} (process counts as strings; collectives for n >= 2)."""
    processes = sorted(set(processes)) if processes else []
    _check_inputs(spec, seq_len, micro_batch, processes, quick)
    progress = progress or (lambda _msg: None)
    tokens = seq_len * micro_batch
    dev = device()
    sizes = message_sizes(spec, tokens, quick)
    profile: dict[str, Any] = {
        "machine": {
            "device": dev.type,
            "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else _cpu_name(),
            "host": socket.gethostname(),
            "cores": _cores(),
            "torch": torch.__version__,
            "dtype": str(compute_dtype()).removeprefix("torch."),
            "threads_per_process": 1,
            "model": spec.name,
            "tokens": tokens,
            "seq_len": seq_len,
            "micro_batch": micro_batch,
            "quick": quick,
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
        "processes": {},
        "collectives": {},
    }
    t0 = time.perf_counter()
    for n in processes:
        compute, raw = _run_group(n, spec, seq_len, micro_batch, quick, sizes, progress)
        fig = {k: float(statistics.median(c[k] for c in compute)) for k, _ in _steps()}
        fig["optimizer_bytes_per_param"] = fig["optimizer_seconds_per_param"] * fig["memory_bandwidth"]
        fig["elementwise_seconds_per_token"] = elementwise_seconds_per_token(spec, micro_batch, seq_len, fig)
        profile["processes"][str(n)] = {k: fig[k] for k in COMPUTE_KEYS}
        if raw is not None:
            profile["collectives"][str(n)] = summarize_collectives(raw["raw"], n)
            if raw["tp_layer_seconds"] is not None:
                profile.setdefault("tensor_parallel", {})[str(n)] = tensor_parallel_overhead(
                    profile, n, spec, seq_len, micro_batch, raw["tp_layer_seconds"])
    profile["machine"]["seconds"] = round(time.perf_counter() - t0, 3)
    return profile


# ------------------------------------------------------------------ profile file

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def default_profile_path() -> Path:
    """Where ``trainscale calibrate`` writes (and the planner looks for) this machine's profile."""
    from trainscale.runtime.data import cache_root

    return cache_root() / "profile.toml"


def _toml_key(k: Any) -> str:
    k = str(k)
    return k if _BARE_KEY.match(k) else _toml_str(k)


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_table(table: dict[str, Any], prefix: list[str], lines: list[str]) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
    subs = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    if prefix and (scalars or not subs):
        lines += ["", f"[{'.'.join(prefix)}]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars]
    for k, v in subs:
        _toml_table(v, [*prefix, _toml_key(k)], lines)


def to_toml(profile: dict[str, Any]) -> str:
    """The profile as TOML (floats in repr form, so reading it back gives the same numbers)."""
    lines = ["# trainscale hardware profile, written by `trainscale calibrate`"]
    _toml_table(profile, [], lines)
    return "\n".join(lines) + "\n"


def write_profile(profile: dict[str, Any], path: str | Path) -> Path:
    """Write ``profile`` as TOML to ``path`` (directories created, replaced atomically)."""
    path = Path(path)
    text = to_toml(profile)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        raise TrainscaleError(f"cannot write the profile to {path}: {e.strerror or e}") from None
    return path


def read_profile(path: str | Path) -> dict[str, Any]:
    """Read a hardware profile written by ``write_profile``."""
    import tomllib

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TrainscaleError(f"hardware profile {path} does not exist; `trainscale calibrate` writes one") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TrainscaleError(f"hardware profile {path} cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise TrainscaleError(f"hardware profile {path} is not valid TOML ({e})") from None
    for section in ("machine", "processes"):
        if not isinstance(data.get(section), dict):
            raise TrainscaleError(f"hardware profile {path} has no [{section}] table; is it a trainscale profile?")
    return data
