"""Throughput and utilization of a running job: tokens/s, achieved FLOP/s, MFU.

MFU = model FLOPs per token x tokens/s / peak (Chowdhery et al. 2022, PaLM App. B), with the FLOPs
per token of the one convention the planner, explain and report use (``estimate.flops.FLOP_CONVENTION``,
"6N + 6LHQT": N the matmul weights a token passes through, active ones for a MoE; attention halved for
causal masking), from ``estimate.flops.training_flops_per_token``. The peak is the GPU's datasheet bf16
figure from the catalog, times the GPUs in the job; on CPU it is this machine's peak, measured with a large
fp32 matmul using all cores and cached (the processes of a CPU job share those cores, so the machine is the device).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainscale.errors import TrainscaleError
from trainscale.estimate import flops
from trainscale.safeio import atomic_write_json, read_json_object
from trainscale.specs import ModelSpec, catalog_names, load_gpu

FLOP_CONVENTION = flops.FLOP_CONVENTION  # printed wherever the runtime prints MFU
FLOP_CONVENTION_NAME = flops.FLOP_CONVENTION_NAME


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token of the MFU the runtime reports: the planner's (``flops.training_flops_per_token``)."""
    return flops.training_flops_per_token(spec, seq_len)


def measure_matmul_peak(n: int = 2048, repeat: int = 5, threads: int | None = None) -> float:
    """Best FLOP/s of an [n, n] x [n, n] fp32 matmul (2n^3 FLOPs) on the CPU, using ``threads``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 2.0 * n**3 / best


def cpu_peak_flops(remeasure: bool = False) -> float:
    """This CPU's matmul peak (FLOP/s): $TRAINSCALE_CPU_PEAK, else measured once and cached.

    A machine shared with other work measures low while it is busy, so the cache keeps the highest
    figure any measurement reached (``remeasure`` measures again and keeps the larger)."""
    if os.environ.get("TRAINSCALE_CPU_PEAK"):
        return float(os.environ["TRAINSCALE_CPU_PEAK"])
    from trainscale.runtime.data.corpus import cache_root

    key = f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.__version__}"
    path = cache_root() / "cpu_peak.json"
    cached = 0.0
    try:
        got = read_json_object(path, "CPU peak cache")
        if got.get("key") == key:
            cached = float(got["flops"])
    except (TrainscaleError, ValueError, KeyError, TypeError):  # absent or damaged: measure again
        pass
    if cached and not remeasure:
        return cached
    best = max(cached, measure_matmul_peak(repeat=10))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"key": key, "flops": best,
                                 "how": "highest best-of-10 fp32 2048^3 matmul seen, all cores"}, indent=None)
    except OSError:
        pass
    return best


def gpu_catalog_name(device_name: str) -> str | None:
    """The catalog entry for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100-sxm"): the longest
    entry whose model number appears in the name."""
    name = device_name.lower().replace(" ", "").replace("-", "")
    best = None
    for entry in catalog_names("gpus"):
        key = entry.lower().replace("-sxm", "").replace("-80gb", "").replace("-", "")
        if key in name and (best is None or len(key) > len(best[1])):
            best = (entry, key)
    return best[0] if best else None


def gpu_peak_flops() -> tuple[float, str]:
    """(peak bf16 FLOP/s of this GPU from the catalog, its catalog name)."""
    best = gpu_catalog_name(torch.cuda.get_device_name())
    if best is None:
        return 989e12, "unknown GPU (H100 SXM peak assumed)"
    return load_gpu(best).peak_bf16_flops, best


def job_peak_flops(world_size: int) -> tuple[float, str]:
    """The peak the job's MFU is measured against, and where it comes from."""
    if torch.cuda.is_available():
        peak, name = gpu_peak_flops()
        return peak * world_size, f"{world_size} x {name} bf16 peak"
    return cpu_peak_flops(), "CPU fp32 matmul peak (measured)"


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float) -> float:
    """``estimate.flops.mfu`` for a job whose ``peak`` already counts all its devices."""
    return flops.mfu(tokens_per_s, flops_per_tok, 1, peak)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: the GPU's peak allocation, or on CPU the peak resident set
    (getrusage's ru_maxrss, KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def unigram_entropy(counts) -> float:
    """Entropy (nats/token) of the training tokens' unigram distribution, p = counts / total:
    H = -sum p ln p (Shannon 1948), the loss of the best model that ignores context on the training text
    itself (zero counts add nothing). The report draws it as the baseline a trained model must beat."""
    import numpy as np

    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    if c.size == 0:
        return float("nan")
    p = c / c.sum()
    return float(-(p * np.log(p)).sum())




class StepProfiler:
    """``[profile] steps = [a, b]``: torch.profiler over steps a..b (1-based, inclusive) on the listed ranks,
    written into RUN/profile as a chrome trace (chrome://tracing, Perfetto) per rank; with CUDA, a memory
    snapshot of the same steps (torch.cuda.memory._record_memory_history / _dump_snapshot, for
    pytorch.org/memory_viz); on CPU the profiler's own memory accounting (profile_memory) as a table of the
    operators that allocated most, since there is no allocator snapshot outside CUDA."""

    def __init__(self, steps: tuple[int, int] | None, ranks: tuple[int, ...], rank: int, folder, device: torch.device,
                 log=lambda _m: None) -> None:
        self.window = steps if steps is not None and rank in ranks and folder is not None else None
        self.rank, self.device, self.log = rank, device, log
        self.folder = None if folder is None else folder / "profile"
        self.prof = None
        self.files: list[str] = []

    def before(self, step: int) -> None:
        """Called before step ``step`` (1-based) runs."""
        if self.window is None or self.prof is not None or not self.window[0] <= step <= self.window[1]:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.prof = profile(activities=acts, record_shapes=True, profile_memory=True)
        self.prof.start()
        self.first = step

    def after(self, step: int, last: bool = False) -> None:
        """Called after step ``step``; ends the window at its last step (or at the run's last step)."""
        if self.prof is None or (step < self.window[1] and not last):
            return
        self.prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        tag = f"rank{self.rank}-steps{self.first}-{step}"
        trace = self.folder / f"trace-{tag}.json"
        self.prof.export_chrome_trace(str(trace))
        self.files.append(trace.name)
        if self.device.type == "cuda":
            snap = self.folder / f"memory-{tag}.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.files.append(snap.name)
        else:
            table = self.folder / f"memory-{tag}.txt"
            table.write_text("CPU run: no allocator snapshot outside CUDA; the profiler's memory accounting "
                             "(profile_memory=True), operators by the memory they allocated themselves:\n\n"
                             + self.prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=30))
            self.files.append(table.name)
        self.log(f"profiled steps {self.first}..{step} on rank {self.rank}: {', '.join(self.files)} in {self.folder}")
        self.prof = None


class StepClock:
    """A training step's seconds, without a host sync. On CPU the host's clock around the step: CPU ops run
    synchronously, so that is the step (the numbers are what they always were). On CUDA the host runs ahead of the
    GPU (a step that does not log waits for nothing), so its clock would time kernel launches: there two CUDA
    events on the current stream at the step's start and end, whose elapsed time is read after the next logging
    step's read-back (runtime/job/metrics.Deferred) has waited for them. They time the GPU stream from the step's
    start to its end, the waits for the host inside the step included; the work between steps (metrics, saves,
    evaluation) is not in any step, as on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self):
        """-> the step's start mark (pass it to ``stop``)."""
        if not self.cuda:
            return time.perf_counter()
        begun = torch.cuda.Event(enable_timing=True)
        begun.record()
        return begun

    def stop(self, begun) -> float | Callable[[], float]:
        """-> the step's seconds (CPU), or a function that returns them once the step's kernels ran (CUDA)."""
        if not self.cuda:
            return time.perf_counter() - begun
        end = torch.cuda.Event(enable_timing=True)
        end.record()

        def seconds() -> float:
            end.synchronize()  # done already after the read-back; cheap
            return begun.elapsed_time(end) / 1000.0

        return seconds


def default_profile_path() -> Path:
    """Where ``trainscale calibrate`` writes (and ``train --compare-plan`` and the straggler check look for) this
    machine's hardware profile: $TRAINSCALE_PROFILE, else profile.toml in the cache folder."""
    from trainscale.runtime.data.corpus import cache_root

    return Path(os.environ.get("TRAINSCALE_PROFILE") or cache_root() / "profile.toml")
