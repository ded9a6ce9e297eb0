"""Timing helpers of the calibration: where it runs (device, dtype) and how a measurement is timed -- the
best of a few repeats, or the median over a wall-clock budget (every process of a measurement contends
for the whole window, so one lucky uncontended repeat does not set the figure)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainscale.runtime.collectives import reduce_host


def best_seconds(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    """The fastest of ``repeat`` timed runs of ``fn`` (after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def median_seconds(fn: Callable[[], Any], budget_s: float, min_repeat: int = 3, warmup: int = 1,
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
            more = bool(reduce_host([int(more)], op=dist.ReduceOp.MIN)[0])
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


def sync() -> None:
    """Wait for the GPU's queued work (a no-op on a CPU), so a timer sees it finished."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
