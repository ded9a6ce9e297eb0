"""Starting a training job: the torchrun command for this machine (or a multi-node rendezvous), the
sbatch script for a Slurm cluster, and the layout to use when asked to plan one.

Imports no torch at module level: ``trainscale train --help`` and ``launch --slurm`` stay fast.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import TrainConfig, check_layout
from trainscale.specs import Layout


def torchrun_command(config: str | Path, layout: str, out: str | Path, world: int, steps: int | None = None,
                     nnodes: int = 1, rdzv_endpoint: str | None = None, rdzv_id: str = "trainscale",
                     python: str = sys.executable, max_restarts: int = 0, inject: str | None = None,
                     resume: bool = False, compile: bool = False) -> list[str]:
    """``python -m torch.distributed.run ... -m trainscale.runtime.train ...``: standalone on one machine,
    c10d rendezvous at ``rdzv_endpoint`` across ``nnodes`` machines (run the same command on each)."""
    if world % nnodes:
        raise TrainscaleError(f"the layout's {world} processes do not split evenly over {nnodes} nodes")
    cmd = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        if rdzv_endpoint is None:
            raise TrainscaleError("a multi-node run needs --rdzv-endpoint HOST:PORT (the first node's address)")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    cmd += ["--nproc-per-node", str(world // nnodes), "--max-restarts", str(max_restarts),
            "-m", "trainscale.runtime.train", "--config", str(config), "--layout", layout, "--out", str(out)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if inject:
        cmd += ["--inject", inject]
    if resume:
        cmd += ["--resume"]
    if compile:
        cmd += ["--compile"]
    return cmd


def sbatch_script(config: str | Path, layout: str, out: str | Path, nodes: int, gpus_per_node: int,
                  job_name: str = "trainscale", partition: str | None = None, time_limit: str = "24:00:00",
                  steps: int | None = None, cpus_per_gpu: int = 8, port: int = 29500) -> str:
    """A Slurm batch script: one task per node, each running torchrun with a c10d rendezvous on the
    first node of the allocation (torchrun's documented multi-node pattern)."""
    world = Layout.parse(layout).world_size
    if nodes * gpus_per_node != world:
        raise TrainscaleError(f"layout {layout} needs {world} processes, but {nodes} nodes x {gpus_per_node} GPUs "
                              f"= {nodes * gpus_per_node}")
    train = ["-m", "trainscale.runtime.train", "--config", str(config), "--layout", layout, "--out", str(out)]
    if steps is not None:
        train += ["--steps", str(steps)]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_gpu * gpus_per_node}",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={out}/slurm-%j.out",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        "",
        "# written by `trainscale launch --slurm`",
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(str(out))}",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export OMP_NUM_THREADS={cpus_per_gpu}",
        "srun torchrun \\",
        '  --nnodes "$SLURM_NNODES" \\',
        f"  --nproc-per-node {gpus_per_node} \\",
        '  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d \\',
        f'  --rdzv-endpoint "$head:{port}" \\',
        "  " + " ".join(shlex.quote(a) for a in train),
        "",
    ]
    return "\n".join(lines)


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
