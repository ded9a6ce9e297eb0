"""A measured machine: what ``trainscale calibrate`` wrote, as the step-time model uses it.

The profile (TOML; its tables and figures are described once, in estimate/profile.py) holds, per
number of processes sharing the machine, what one process achieves (``[processes.N]``: matmul and
attention FLOP/s at a model's shapes, the non-matmul time of a real layer per token, memory
bandwidth, AdamW seconds per parameter), and per group size the backend's collectives
(``[collectives.N.op]``: latency and bus bandwidth). Collective time follows the ring model of
estimate/comms.py with the measured figures: latency + factor x bytes / bus bandwidth, factor
2(n-1)/n for all-reduce and (n-1)/n for all-gather and reduce-scatter (NCCL-tests PERFORMANCE.md),
1 for a point-to-point send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate.profile import COLLECTIVES, REQUIRED_COMPUTE_KEYS


def bus_factor(op: str, n: int) -> float:
    """Bytes a ring moves per rank, per byte of the buffer: 2(n-1)/n all-reduce, (n-1)/n all-gather and
    reduce-scatter, 1 send (NCCL-tests PERFORMANCE.md: bus bandwidth = algorithm bandwidth x this)."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "send_recv": 1.0}[op]


def _nearest(table: dict[str, Any], n: int, what: str) -> tuple[int, Any]:
    if not table:
        raise TrainscaleError(f"the profile has no {what} measurements")
    keys = sorted(int(k) for k in table)
    best = min(keys, key=lambda k: (abs(k - n), -k))
    return best, table[str(best)]


@dataclass(frozen=True)
class Machine:
    """One process's view of a measured machine while ``processes`` share it."""

    processes: int
    matmul_flops: float
    attention_flops: float
    memory_bandwidth: float
    optimizer_seconds_per_param: float
    head_matmul_flops: float
    elementwise_seconds_per_token: float = 0.0  # a layer's non-matmul work per token (0: not measured)
    layer_fixed_seconds: float = 0.0  # a layer's fwd+bwd cost per call, whatever its tokens (0: not measured)
    collectives: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)  # n -> op -> (lat, busbw)
    tensor_parallel: dict[int, tuple[float, float]] = field(default_factory=dict)  # tp -> (s/token, its FLOP/s)
    measured_processes: int = 0  # the process count of the [processes.N] table used (nearest measured)
    device: str = "cpu"

    def collective_time(self, op: str, nbytes: float, n: int) -> float:
        """Seconds of one ``op`` over ``n`` ranks moving ``nbytes`` (the full buffer: the all-reduced tensor,
        the all-gather's result, the reduce-scatter's input, the message sent)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if not self.collectives:
            raise TrainscaleError("the profile has no collective measurements (calibrate with --processes 1,2,...)")
        # the table measured with as many processes as the job runs: with more processes than cores a
        # collective waits for its peers to be scheduled, whatever the group's size
        _, table = _nearest({str(k): v for k, v in self.collectives.items()}, max(n, self.processes), "collective")
        lat, busbw = table[op]
        return lat + bus_factor(op, n) * nbytes / busbw


    def tensor_parallel_overhead(self, tp: int) -> float:
        """Seconds per token of DTensor's own work in one TP layer (calibrate: the measured TP layer less the
        composed one), at the nearest measured degree; slowed like the compute when more processes than
        that share the machine."""
        if not self.tensor_parallel:
            return 0.0
        _, (per_token, flops) = _nearest({str(k): v for k, v in self.tensor_parallel.items()}, tp, "tensor-parallel")
        return per_token * max(1.0, flops / self.matmul_flops)


def machine_from_profile(profile: dict[str, Any], processes: int) -> Machine:
    """The figures of ``profile`` for ``processes`` processes at once (the nearest count measured)."""
    try:
        n, row = _nearest(profile.get("processes", {}), processes, "per-process compute")
        missing = [k for k in REQUIRED_COMPUTE_KEYS if k not in row]
        if missing:
            raise TrainscaleError(f"the profile's [processes.{n}] lacks {', '.join(missing)}")
        coll = {int(k): {op: (float(v[op]["latency_s"]), float(v[op]["bus_bandwidth"]))
                         for op in COLLECTIVES if op in v} for k, v in profile.get("collectives", {}).items()}
        return Machine(processes=processes, matmul_flops=float(row["matmul_flops"]),
                       attention_flops=float(row["attention_flops"]), memory_bandwidth=float(row["memory_bandwidth"]),
                       optimizer_seconds_per_param=float(row["optimizer_seconds_per_param"]),
                       head_matmul_flops=float(row.get("head_matmul_flops", row["matmul_flops"])),
                       elementwise_seconds_per_token=float(row.get("elementwise_seconds_per_token", 0.0)),
                       layer_fixed_seconds=float(row.get("layer_fixed_seconds", 0.0)),
                       collectives=coll, tensor_parallel={
                           int(k): (float(v["overhead_seconds_per_token"]), float(v["matmul_flops"]))
                           for k, v in profile.get("tensor_parallel", {}).items()},
                       measured_processes=n, device=str(profile.get("machine", {}).get("device", "cpu")))
    except (KeyError, TypeError, ValueError) as e:
        raise TrainscaleError(f"the hardware profile is malformed ({e}); run trainscale calibrate again") from None
