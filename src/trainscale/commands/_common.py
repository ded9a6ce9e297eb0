"""What every sub-command shares: the console, JSON output, short citations."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import typer
from rich.console import Console

from trainscale.errors import TrainscaleError

console = Console()


def short_source(src: str) -> str:
    """A citation for a table cell: the first clause, without long parenthetical figure lists."""
    first = src.split(";")[0]
    return re.sub(r" \([^)]{40,}\)", "", first)


def emit_json(obj: Any) -> None:
    """Machine output: one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


# ------------------------------------------------------------------ the edge: option domains and paths

def _opt(param: Any) -> str:
    """The option's name as the user typed it (--seq-len), or the argument's (CHECKPOINT)."""
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return max(opts, key=len) if opts else str(getattr(param, "name", "value")).upper()


def number(gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None):
    """A typer callback: the option is finite and within the bounds; else one sentence (TrainscaleError:
    exit code 2). Upper bounds are where a larger value cannot be meant."""
    import math


    def check(param: typer.CallbackParam, value: Any) -> Any:
        if value is None:
            return value
        name, v = _opt(param), value
        if isinstance(v, float) and not math.isfinite(v):
            raise TrainscaleError(f"{name} must be a finite number, not {v}")
        low_ok = (gt is None or v > gt) and (ge is None or v >= ge)
        high_ok = (lt is None or v < lt) and (le is None or v <= le)
        if low_ok and high_ok:
            return value
        hi = le if le is not None else lt
        if hi is not None and hi <= 1 and (gt is not None or ge is not None):  # a fraction: name the interval
            lo = gt if gt is not None else ge
            raise TrainscaleError(f"{name} must be in {'(' if gt is not None else '['}{lo:g}, {hi:g}"
                                  f"{']' if le is not None else ')'}, not {v:g}")
        if not low_ok:
            kind = "integer" if isinstance(v, int) else "number"
            if gt == 0:
                raise TrainscaleError(f"{name} must be a positive {kind}, not {v:g}")
            if ge == 0:
                raise TrainscaleError(f"{name} must be a non-negative {kind}, not {v:g}")
            raise TrainscaleError(f"{name} must be {'>' if gt is not None else '>='} {gt if gt is not None else ge:g}, "
                                  f"not {v:g}")
        raise TrainscaleError(f"{name} must be at most {hi:g}{'' if le is not None else ' (exclusive)'}, not {v:g}")

    return check


def input_file(what: str):
    """A typer callback: an existing, readable regular file (never a FIFO or device)."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        from trainscale.safeio import check_regular

        check_regular(value, what)
        return value

    return check


def catalog_or_file(what: str):
    """A typer callback for 'a catalog name or a file': a value that names an existing path must be a
    regular file (a folder with config.json is fine too)."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        from pathlib import Path

        from trainscale.safeio import check_regular

        if "\0" in str(value) or len(str(value)) > 4096:
            raise TrainscaleError(f"{what} must be a name or a path")
        p = Path(value)
        try:
            exists = p.exists()
        except OSError:
            exists = False
        if exists:
            check_regular(p / "config.json" if p.is_dir() else p, what)
        return value

    return check


SEED = number(ge=0, lt=2**63)


MAX_PROCESSES = 100_000_000  # more GPUs than any cluster has or will soon


def parse_layout(text: str) -> Any:
    """``Layout.parse`` with a bound: a layout asking for more processes than any cluster is refused."""
    from trainscale.specs import Layout

    lay = Layout.parse(text)
    degrees = (lay.tp, lay.cp, lay.pp, lay.dp, lay.mb, lay.v, lay.hsdp)
    if max(degrees) > MAX_PROCESSES or lay.world_size > MAX_PROCESSES:
        raise TrainscaleError(f"layout '{text}' asks for {lay.world_size:.3g} processes; at most "
                              f"{MAX_PROCESSES:,} are supported")
    return lay


def input_folder(what: str, holding: str | None = None):
    """A typer callback: an existing folder (holding the regular file ``holding``, if given)."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        import os

        try:
            ok = os.path.isdir(value)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise TrainscaleError(f"{what} {str(value)[:200]} is not an existing folder")
        if holding is not None:
            from trainscale.safeio import check_regular

            check_regular(os.path.join(value, holding), f"{what}'s")
        return value

    return check


def prepare_job_env(cfg: Any) -> dict[str, str]:
    """The environment of a job's ranks (train, compare): the corpus tokenised and the CPU peak measured here,
    once, before the ranks start."""
    from trainscale.runtime import measure
    from trainscale.runtime.data.corpus import corpus_for

    with console.status("preparing the corpus and tokenizer (cached after the first run)"):
        corpus_for(cfg)
    env = dict(os.environ)
    import torch

    if not torch.cuda.is_available():
        with console.status("measuring this CPU's matmul peak (once)"):
            env["TRAINSCALE_CPU_PEAK"] = repr(measure.cpu_peak_flops(remeasure=True))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ------------------------------------------------------------------ pre-flight: does the layout fit this machine?

DEVICE_MEMORY_ENV = "TRAINSCALE_DEVICE_MEMORY_BYTES"  # for tests and small machines: see device_memory()
_PREFLIGHT_CHECKED = 60  # candidate layouts the runtime's memory model checks when naming one that fits


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
        import torch

        return value, DEVICE_MEMORY_ENV, not torch.cuda.is_available()
    import torch

    if torch.cuda.is_available():
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


def rank_memory(cfg: Any, lay: Any, bf16: bool) -> dict[str, float]:
    """What the heaviest rank of this runtime holds for ``lay`` (estimate/measured/rank.py, the model
    `trainscale compare` checks against real tensors): fp32 weights, gradients and AdamW state, plus the
    activations of the micro-batches its pipeline stage keeps in flight (the planner's in_flight: 1F1B keeps
    pp - r, GPipe all of them), in bf16 when the run computes in bf16 (else fp32). Not counted: the CUDA context,
    allocator caching and transient gathered weights, so a layout refused here cannot fit. Also the sum over
    ranks (what a CPU job's shared RAM must hold)."""
    from trainscale.estimate.measured import rank as R
    from trainscale.estimate.planner.candidates import SCHEDULE
    from trainscale.estimate.planner.stage_memory import in_flight

    m, t = cfg.model, cfg.train
    micro = t.global_batch // (lay.dp * lay.mb)
    per_stage = {}
    for r in range(lay.world_size):  # the first rank of each pipeline stage holds torch.chunk's largest shards
        c = R.coords(lay, r)
        if c["pp"] in per_stage or any(v for k, v in c.items() if k != "pp"):
            continue
        state = R.rank_state_bytes(m, lay, r).total
        acts = sum(R.stage_saved_bytes(m, lay.mb, t.seq_len, lay, s, 2 if bf16 else 4).total
                   for s in R.local_stage_ids(lay, c["pp"]))
        held = float(in_flight(SCHEDULE.index(lay.schedule), lay.pp, lay.v, micro, c["pp"]))
        per_stage[c["pp"]] = {"state": float(state), "activations": acts * held}  # held: in whole stages
    worst = max(per_stage.values(), key=lambda d: d["state"] + d["activations"])
    total = sum(d["state"] + d["activations"] for d in per_stage.values()) * (lay.world_size // lay.pp)
    return {**worst, "per_rank": worst["state"] + worst["activations"], "all_ranks": total}


def preflight(cfg: Any, lay: Any, nodes: int = 1) -> dict[str, Any]:
    """Before any process starts: the runtime's memory model for ``lay`` (``rank_memory``) against this machine's
    device (``device_memory``). Refuses in one sentence (TrainscaleError) when it cannot fit, naming a layout of
    the same process count that would (the planner's search of what this runtime trains, each candidate checked
    with the same memory model) or saying that none does. Returns what it compared."""
    from trainscale.report.fmt import size as gb

    dev = device_memory()
    if dev is None:
        return {"checked": False, "why": "this machine's memory is unknown (no GPU, no /proc/meminfo)"}
    cap, source, shared = dev
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and _has_cuda())
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
    alt = _fitting_layout(cfg, lay, per_rank_cap, bf16)
    tail = (f"{alt[0]} would fit ({gb(alt[1])} per process)" if alt else
            f"no layout this runtime trains on {lay.world_size} process(es) fits, so use more GPUs or a machine with "
            "more memory")
    raise TrainscaleError(f"{cfg.model.name} with {lay} does not fit: it needs {what} (weights, gradients and AdamW "
                          f"state {gb(need['state'])} + activations {gb(need['activations'])} on its heaviest rank) "
                          f"but {has}; {tail}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _fitting_layout(cfg: Any, lay: Any, per_rank_cap: float, bf16: bool) -> tuple[str, float] | None:
    """The fastest layout of the same process count that the runtime's memory model fits in ``per_rank_cap``:
    the planner's search (``runnable``) on a device of that memory, its fitting layouts fastest first and then its
    leanest, each checked with ``rank_memory``."""
    from dataclasses import replace

    import numpy as np

    from trainscale.estimate.planner.plan import layout_at, problem

    t = cfg.train
    try:
        p = problem(model=cfg.model, gpu=_gpu_name(), gpus=lay.world_size, seq=t.seq_len,
                    global_batch_tokens=t.global_batch * t.seq_len, runnable=True)
        p = replace(p, gpu=p.gpu.model_copy(update={"memory_bytes": per_rank_cap}))
        s = p.search()
    except TrainscaleError:
        return None
    fast = [int(i) for i in s.order[: min(_PREFLIGHT_CHECKED, s.n_fit)]]
    lean = [int(i) for i in np.argsort(s.res["mem_total"])[:_PREFLIGHT_CHECKED]] if s.n_valid else []
    for i in dict.fromkeys(fast + lean):
        cand = layout_at(s.cfg, i)
        got = rank_memory(cfg, cand, bf16)["per_rank"]
        if got <= per_rank_cap:
            return str(cand), got
    return None


def _gpu_name() -> str:
    """This machine's GPU as the catalog names it (its memory is replaced by the measured one); a CPU machine
    plans as an H100 whose memory is the RAM a process has (only the memory decides what fits)."""
    if _has_cuda():
        from trainscale.runtime.measure import gpu_peak_flops

        name = gpu_peak_flops()[1]
        return "h100-sxm" if name.startswith("unknown") else name
    return "h100-sxm"
