"""Measure this machine (or the GPU it runs on): matmul FLOP/s at a model's shapes, attention, memory
bandwidth, the optimizer step, and the backend's collectives (all-reduce, all-gather, reduce-scatter,
send/recv) across process counts. The result is a hardware profile (TOML, described in
estimate/profile.py) the planner can use instead of catalog defaults; ``trainscale calibrate`` writes it.

Every compute figure is what ONE process achieves while ``n`` processes run the same measurement at
the same time, each with one torch thread (CPU) -- the way training ranks run under torchrun -- and
the profile keeps the median over the processes.

- timing.py       where it runs (device, dtype) and how one measurement is timed
- measure.py      the compute measurements and the FLOP counts they divide by
- collectives.py  the backend's collectives, as bus bandwidth and latency
- driver.py       the processes per count, the profile they make (``calibrate``)
"""

from trainscale.estimate.profile import COLLECTIVES as COLLECTIVE_OPS
from trainscale.estimate.profile import COMPUTE_KEYS, read_profile, to_toml, write_profile
from trainscale.runtime.measure import default_profile_path
from trainscale.runtime.probe.calibrate.collectives import (
    BUS_FACTOR,
    GRAD_BUCKET_BYTES,
    SMALL_MESSAGE_BYTES,
    bandwidth_fit,
    message_sizes,
    summarize_collectives,
)
from trainscale.runtime.probe.calibrate.driver import calibrate, calibration_steps
from trainscale.runtime.probe.calibrate.measure import (
    attention_flop_count,
    attention_flops,
    block_seconds,
    elementwise_seconds_per_token,
    gemm_train_flops,
    layer_fixed_seconds,
    layer_kernel_seconds,
    layer_linear_shapes,
    layer_matmul_flop_count,
    linear_train_flops,
    memory_bandwidth,
    optimizer_seconds_per_param,
    optimizer_shapes,
    tensor_parallel_overhead,
    tp_block_seconds,
)
from trainscale.runtime.probe.calibrate.timing import compute_dtype, device

__all__ = ["BUS_FACTOR", "COLLECTIVE_OPS", "COMPUTE_KEYS", "GRAD_BUCKET_BYTES", "SMALL_MESSAGE_BYTES",
           "attention_flop_count", "attention_flops", "bandwidth_fit", "block_seconds", "calibrate",
           "calibration_steps", "compute_dtype", "default_profile_path", "device",
           "elementwise_seconds_per_token", "gemm_train_flops", "layer_fixed_seconds",
           "layer_kernel_seconds", "layer_linear_shapes",
           "layer_matmul_flop_count", "linear_train_flops", "memory_bandwidth", "message_sizes",
           "optimizer_seconds_per_param", "optimizer_shapes", "read_profile", "summarize_collectives",
           "tensor_parallel_overhead", "to_toml", "tp_block_seconds", "write_profile"]
