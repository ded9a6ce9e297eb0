"""Starting a training job: the torchrun command for this machine (or a multi-node rendezvous) and the
layout to use when asked to plan one (the Slurm batch script is runtime/slurm.py).

Imports no torch at module level: ``trainscale train --help`` and ``launch --slurm`` stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import TrainConfig, check_layout
from trainscale.specs import Layout


def parse_nnodes(nnodes: int | str) -> tuple[int, int]:
    """``N`` or torchrun's elastic range ``MIN:MAX`` -> (min, max)."""
    text = str(nnodes).strip()
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise TrainscaleError(f"--nnodes must be N or MIN:MAX (an elastic range), not {text!r}") from None
    if not 0 < a <= b <= 4096:
        raise TrainscaleError(f"--nnodes {text}: need 1 <= MIN <= MAX <= 4096")
    return a, b


def torchrun_command(config: str | Path, layout: str, out: str | Path, world: int, steps: int | None = None,
                     nnodes: int | str = 1, rdzv_endpoint: str | None = None, rdzv_id: str = "trainscale",
                     python: str = sys.executable, max_restarts: int = 0, inject: str | None = None,
                     resume: bool = False, fallback_layout: str | None = None) -> list[str]:
    """``python -m torch.distributed.run ... -m trainscale.runtime.train ...``: standalone on one machine,
    c10d rendezvous at ``rdzv_endpoint`` across ``nnodes`` machines (run the same command on each).
    ``nnodes = "MIN:MAX"`` makes the job elastic: it goes on with as few as MIN machines after one is lost
    (each re-formed job re-plans its layout for the processes left, runtime/elastic.py)."""
    lo, hi = parse_nnodes(nnodes)
    if world % hi:
        raise TrainscaleError(f"the layout's {world} processes do not split evenly over {hi} nodes")
    cmd = [python, "-m", "torch.distributed.run"]
    if hi == 1 and rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        if rdzv_endpoint is None:
            raise TrainscaleError("a multi-node run needs --rdzv-endpoint HOST:PORT (the first node's address)")
        cmd += ["--nnodes", f"{lo}:{hi}" if lo != hi else str(hi), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    cmd += ["--nproc-per-node", str(world // hi), "--max-restarts", str(max_restarts),
            "-m", "trainscale.runtime.train", "--config", str(config), "--layout", layout, "--out", str(out)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if inject:
        cmd += ["--inject", inject]
    if resume:
        cmd += ["--resume"]
    if fallback_layout:
        cmd += ["--fallback-layout", fallback_layout]
    return cmd


def plan_layout(cfg: TrainConfig) -> tuple[str, str]:
    """-> (layout string, why) for this machine.

    GPUs: the planner (``estimate.plan``) searches every layout for the model on this many GPUs of
    this kind, and the fastest one that fits and that the runtime supports is taken. CPU: one
    process, because every process of a CPU job shares the same cores, so splitting the model adds
    communication without adding compute."""
    import torch

    if not torch.cuda.is_available():
        return "", ("no GPU here: one process (on a CPU all processes share the same cores, so any split only adds "
                    "communication)")
    from trainscale.estimate.plan import layout_at, problem
    from trainscale.runtime.measure import gpu_peak_flops

    n = torch.cuda.device_count()
    _, gpu = gpu_peak_flops()
    if gpu.startswith("unknown"):
        gpu = "h100-sxm"
    t = cfg.train
    result = problem(model=cfg.model, gpu=gpu, gpus=n, seq=t.seq_len, global_batch_tokens=t.global_batch * t.seq_len
                     ).search()
    for i in result.top(200):
        lay = layout_at(result.cfg, i)
        try:
            check_layout(cfg, lay)
        except TrainscaleError:
            continue
        tps = float(result.res["tokens_per_s"][i])
        return layout_string(lay), f"planner's fastest fitting layout on {n} x {gpu}: {tps:,.0f} tokens/s predicted"
    raise TrainscaleError(f"the planner found no layout for {cfg.model.name} on {n} x {gpu} that fits and that the "
                          "runtime supports; " + (result.nothing_fits() if not result.n_fit else "try another batch"))


def layout_string(lay: Layout) -> str:
    """The layout as ``Layout.parse`` reads it, micro-batch included."""
    return str(lay)
