"""The calibration run: for each process count n, start n processes (spawn, one torch thread each on a
CPU -- the way training ranks run under torchrun), have them take every compute measurement at the same
time (the profile keeps the median over the processes), then, for n >= 2, the collectives and the
tensor-parallel layer in one process group; assemble the hardware profile (estimate/profile.py)."""

from __future__ import annotations

import math
import os
import platform
import queue
import socket
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainscale.errors import TrainscaleError
from trainscale.estimate.profile import COMPUTE_KEYS, PROFILE_VERSION
from trainscale.runtime.parallel.mesh import free_port
from trainscale.runtime.probe.calibrate.collectives import (
    collective_times,
    init_group,
    message_sizes,
    summarize_collectives,
)
from trainscale.runtime.probe.calibrate.measure import (
    attention_flops,
    block_seconds,
    elementwise_seconds_per_token,
    gemm_train_flops,
    layer_fixed_seconds,
    layer_kernel_seconds,
    layer_linear_shapes,
    memory_bandwidth,
    optimizer_seconds_per_param,
    tensor_parallel_overhead,
    tp_block_seconds,
)
from trainscale.runtime.probe.calibrate.timing import compute_dtype, device
from trainscale.specs import ModelSpec

# Wall-clock seconds each process spends timing one measurement (default, --quick).
_BUDGET = {"block": (1.5, 0.1), "layer": (1.5, 0.1), "head": (0.8, 0.1), "attention": (0.8, 0.1), "memory": (0.6, 0.05),
           "optimizer": (0.8, 0.1)}
_MEMORY_BYTES = (128 * 2**20, 32 * 2**20)  # per copy buffer; well above a CPU's last-level cache
_OPTIMIZER_PARAMS = (2_000_000, 250_000)
_COLLECTIVE_REPEAT = (9, 5)


def _steps() -> list[tuple[str, str]]:
    return [("layer_seconds", "one decoder layer"), ("layer_seconds_one", "one decoder layer, one sequence"),
            ("matmul_flops", "layer GEMMs"),
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
        "layer_seconds_one": lambda: block_seconds(spec, 1, seq_len, _BUDGET["block"][q], minr),
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
        dev = init_group(rank, world, port)
        raw = collective_times(rank, world, dev, sizes, _COLLECTIVE_REPEAT[q])
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
        "version": PROFILE_VERSION,
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
        fig["layer_fixed_seconds"] = layer_fixed_seconds(fig["layer_seconds"], fig["layer_seconds_one"], micro_batch,
                                                         layer_kernel_seconds(spec, micro_batch, seq_len, fig))
        fig["elementwise_seconds_per_token"] = elementwise_seconds_per_token(spec, micro_batch, seq_len, fig)
        profile["processes"][str(n)] = {k: fig[k] for k in COMPUTE_KEYS}
        if raw is not None:
            profile["collectives"][str(n)] = summarize_collectives(raw["raw"], n)
            if raw["tp_layer_seconds"] is not None:
                profile.setdefault("tensor_parallel", {})[str(n)] = tensor_parallel_overhead(
                    profile, n, spec, seq_len, micro_batch, raw["tp_layer_seconds"])
    profile["machine"]["seconds"] = round(time.perf_counter() - t0, 3)
    return profile
