"""The memory pre-flight of a training job: before any process starts, does the layout fit this machine?

The arithmetic is the runtime's rank model (``estimate.measured.rank.heaviest_rank_memory``, the model
`trainscale compare` checks against real tensors); this module probes the machine (its device memory, its GPU)
and refuses, in one sentence, a layout that cannot fit, naming one of the same process count that would.
"""

from __future__ import annotations

import os
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate.measured.rank import heaviest_rank_memory
from trainscale.runtime.config import TrainConfig
from trainscale.specs import Layout
from trainscale.units import size as gb

DEVICE_MEMORY_ENV = "TRAINSCALE_DEVICE_MEMORY_BYTES"  # for tests and small machines: see device_memory()
CHECKED = 60  # candidate layouts the runtime's memory model checks when naming one that fits


def device_memory() -> tuple[float, str, bool] | None:
    """(bytes, where the figure comes from, whether the ranks share it) of one device of this machine:
    ``TRAINSCALE_DEVICE_MEMORY_BYTES`` when set (for tests, and to stay within part of a small machine: the
    memory of one GPU, or on a machine without one the RAM its ranks share), else the smallest GPU's total
    memory (torch.cuda), else the RAM Linux reports available (/proc/meminfo MemAvailable), which every rank of
    a CPU job shares. None when none of these is known."""
    text = os.environ.get(DEVICE_MEMORY_ENV)
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 < value < 1e18:
            raise TrainscaleError(f"{DEVICE_MEMORY_ENV} must be a positive number of bytes, not {text[:40]!r}")
        return value, DEVICE_MEMORY_ENV, not has_cuda()
    if has_cuda():
        import torch

        n = torch.cuda.device_count()
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(n))
        return float(total), f"{torch.cuda.get_device_name(0)}, torch.cuda", False
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "available RAM, /proc/meminfo", True
    except OSError:
        pass
    return None


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def computes_in_bf16(cfg: TrainConfig) -> bool:
    """The run's activations are bf16: ``precision = "bf16"``, or ``"auto"`` on a GPU."""
    return cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and has_cuda())


def rank_memory(cfg: TrainConfig, lay: Layout, bf16: bool) -> dict[str, float]:
    """``heaviest_rank_memory`` for this config: state, activations, per_rank and all_ranks, in bytes."""
    t = cfg.train
    mem = heaviest_rank_memory(cfg.model, lay, t.seq_len, t.global_batch, 2 if bf16 else 4)
    return {"state": mem.state, "activations": mem.activations, "per_rank": mem.per_rank, "all_ranks": mem.all_ranks}


def preflight(cfg: TrainConfig, lay: Layout, nodes: int = 1) -> dict[str, Any]:
    """Before any process starts: the runtime's memory model for ``lay`` (``rank_memory``) against this machine's
    device (``device_memory``). Refuses in one sentence (TrainscaleError) when it cannot fit, naming a layout of
    the same process count that would (the planner's search of what this runtime trains, each candidate checked
    with the same memory model) or saying that none does. Returns what it compared."""
    dev = device_memory()
    if dev is None:
        return {"checked": False, "why": "this machine's memory is unknown (no GPU, no /proc/meminfo)"}
    cap, source, shared = dev
    bf16 = computes_in_bf16(cfg)
    here = max(1, lay.world_size // max(nodes, 1))  # torchrun's --nproc-per-node
    need = rank_memory(cfg, lay, bf16)
    # a GPU holds one rank; a CPU machine's RAM holds all of its ranks
    per_rank_cap = cap / here if shared else cap
    fits = (need["all_ranks"] / max(nodes, 1) if shared else need["per_rank"]) <= cap
    info = {"checked": True, "fits": fits, "predicted_per_rank_bytes": need["per_rank"],
            "predicted_state_bytes": need["state"], "predicted_activation_bytes": need["activations"],
            "predicted_this_machine_bytes": need["all_ranks"] / max(nodes, 1) if shared else need["per_rank"],
            "capacity_bytes": cap, "capacity_source": source, "shared_by_ranks": shared,
            "ranks_here": here, "bf16": bf16}
    if fits:
        return info
    what = (f"{gb(info['predicted_this_machine_bytes'])} of RAM for its {here} process(es) together" if shared
            else f"{gb(need['per_rank'])} per GPU")
    has = f"this machine has {gb(cap)} ({source})" if shared else f"each GPU has {gb(cap)} ({source})"
    alt = fitting_layout(cfg, lay, per_rank_cap, bf16)
    tail = (f"{alt[0]} would fit ({gb(alt[1])} per process)" if alt else
            f"no layout this runtime trains on {lay.world_size} process(es) fits, so use more GPUs or a machine with "
            "more memory")
    raise TrainscaleError(f"{cfg.model.name} with {lay} does not fit: it needs {what} (weights, gradients and AdamW "
                          f"state {gb(need['state'])} + activations {gb(need['activations'])} on its heaviest rank) "
                          f"but {has}; {tail}")


def fitting_layout(cfg: TrainConfig, lay: Layout, per_rank_cap: float, bf16: bool) -> tuple[str, float] | None:
    """The fastest layout of the same process count that the runtime's memory model fits in ``per_rank_cap``:
    the planner's search (``runnable``) on a device of that memory, its fitting layouts fastest first and then its
    leanest, each checked with ``rank_memory``."""
    from dataclasses import replace

    import numpy as np

    from trainscale.estimate.planner.plan import layout_at, problem

    t = cfg.train
    try:
        p = problem(model=cfg.model, gpu=gpu_name(), gpus=lay.world_size, seq=t.seq_len,
                    global_batch_tokens=t.global_batch * t.seq_len, runnable=True)
        p = replace(p, gpu=p.gpu.model_copy(update={"memory_bytes": per_rank_cap}))
        s = p.search()
    except TrainscaleError:
        return None
    fast = [int(i) for i in s.order[: min(CHECKED, s.n_fit)]]
    lean = [int(i) for i in np.argsort(s.res["mem_total"])[:CHECKED]] if s.n_valid else []
    for i in dict.fromkeys(fast + lean):
        cand = layout_at(s.cfg, i)
        got = rank_memory(cfg, cand, bf16)["per_rank"]
        if got <= per_rank_cap:
            return str(cand), got
    return None


def gpu_name() -> str:
    """This machine's GPU as the catalog names it (its memory is replaced by the measured one); a CPU machine
    plans as an H100 whose memory is the RAM a process has (only the memory decides what fits)."""
    if has_cuda():
        from trainscale.runtime.measure import gpu_peak_flops

        name = gpu_peak_flops()[1]
        return "h100-sxm" if name.startswith("unknown") else name
    return "h100-sxm"
