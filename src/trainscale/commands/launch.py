"""`trainscale launch --slurm`: the training job as a Slurm batch script (runtime/job/slurm.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from trainscale.commands._common import console, emit_json, input_file, number, output_path
from trainscale.errors import TrainscaleError


def register(app: typer.Typer) -> None:
    app.command()(launch)


def _slurm_time(value: str) -> str:
    from trainscale.runtime.job.slurm import time_limit_s

    time_limit_s(value)  # sbatch's forms, each field within its clock: 99:99 is refused here
    return value


def launch(
    config: Path = typer.Option(..., "--config", callback=input_file("config"), help="training config TOML"),
    layout: str = typer.Option(None, help="parallel layout; its world size must equal nodes x GPUs per node "
                                          "(default: the config's run.layout)"),
    slurm: bool = typer.Option(False, "--slurm", help="write a Slurm sbatch script"),
    nodes: int = typer.Option(..., callback=number(gt=0, le=100_000), help="machines"),
    gpus_per_node: int = typer.Option(8, callback=number(gt=0, le=1024), help="GPUs (training processes) per machine"),
    cpu: bool = typer.Option(False, "--cpu", help="CPU processes: request no GPUs (--gpus-per-node counts processes)"),
    cpus_per_gpu: int = typer.Option(8, callback=number(gt=0, le=1024),
                                      help="CPU cores per training process (srun --cpus-per-task, OMP threads)"),
    mem: str = typer.Option(None, help="memory per node in Slurm syntax, e.g. 480G (default: the partition's)"),
    partition: str = typer.Option(None, help="Slurm partition"),
    account: str = typer.Option(None, help="Slurm account"),
    time_limit: str = typer.Option("24:00:00", "--time", callback=_slurm_time,
                                   help="Slurm time limit: MINUTES, H:MM:SS or DAYS-HH:MM:SS"),
    signal_before: int = typer.Option(120, callback=number(ge=0, le=86400),
                                       help="seconds before the time limit to write a checkpoint (0: off)"),
    setup: str = typer.Option(None, help="a shell line run first on the node, e.g. 'source ~/venv/bin/activate'; "
                                         "the one value run as shell, on purpose: it is written as you give it "
                                         "(through eval), so give only a line you would type there yourself"),
    python: str = typer.Option(None, help="the Python on the cluster that has trainscale (default: found on the "
                                          "compute node: $TRAINSCALE_PYTHON, else python3 or python on $PATH; the "
                                          "job checks it imports trainscale); passed as is, like every value but "
                                          "--setup: no $VARIABLE expansion"),
    env: list[str] = typer.Option(None, "--env", metavar="KEY=VALUE",
                                  help="KEY=VALUE exported on the node, repeatable (e.g. "
                                                      "NCCL_IB_HCA=mlx5, NCCL_SOCKET_IFNAME=ib0); the value is passed "
                                                      "as is, never run. Defaults where the environment sets none: "
                                                      "TORCH_NCCL_ASYNC_ERROR_HANDLING=1, NCCL_DEBUG=WARN"),
    max_restarts: int = typer.Option(3, callback=number(ge=0, le=100),
                                      help="torchrun restarts after a failure inside one allocation"),
    max_resubmits: int = typer.Option(30, callback=number(ge=0, le=10000),
                                       help="times the job requeues itself after its checkpoint before the time limit"),
    steps: int = typer.Option(None, callback=number(gt=0, le=1e9), help="optimizer steps (default: the config's)"),
    inject: str = typer.Option(None, help="faults to inject, as for `trainscale train --inject`"),
    out: Path = typer.Option(None, callback=output_path(folder=True, remote=True),
                             help="run folder on the cluster (default: the config's run.out); passed as is, "
                                  "no $VARIABLE expansion"),
    script: Path = typer.Option(None, callback=output_path(folder=False),
                                help="where to write the script (default: stdout); the Slurm log goes beside "
                                     "it"),
    as_json: bool = typer.Option(False, "--json", help="print the script and its settings as JSON"),
    sets: list[str] = typer.Option(None, "--set", metavar="SECTION.KEY=VALUE",
                                   help="override a config value, e.g. --set train.lr=1e-4 (repeatable); the config "
                                   "with them is written beside --script, as SCRIPT.config.toml, for the job to read"),
) -> None:
    """Write the batch script that runs this training job across nodes (torchrun c10d rendezvous) in this folder;
    it is requeueable (always --resume), checkpoints before the time limit and then requeues itself."""
    from trainscale.runtime.init import resolved_config
    from trainscale.runtime.job.launch import batch_script
    from trainscale.runtime.job.slurm import parse_env

    if not slurm:
        raise TrainscaleError("say which scheduler: --slurm (the only one supported)")
    sets = list(sets or [])
    cfg = resolved_config(config, {"train": {"steps": steps}} if steps else None, sets=sets)
    done = batch_script(config, cfg, layout=layout, sets=sets, steps=steps, out=out, script=script,
                        nodes=nodes, procs_per_node=gpus_per_node, gpus=not cpu, partition=partition,
                        account=account, time_limit=time_limit, cpus_per_proc=cpus_per_gpu, mem=mem, setup=setup,
                        python=python, inject=inject, max_restarts=max_restarts, signal_before_s=signal_before,
                        env=parse_env(env or ()), max_resubmits=max_resubmits)
    lay, job, log_dir = done.layout, done.job, done.log_dir
    if as_json:
        emit_json({"script": done.text, "path": str(script) if script else None, "layout": str(lay),
                   "processes": lay.world_size, "nodes": nodes, "procs_per_node": gpus_per_node, "gpus": not cpu,
                   "log": f"{log_dir}/{job.job_name}-%j.out", "out": job.out, "chdir": job.workdir,
                   "max_resubmits": max_resubmits})
        return
    if script is None:
        sys.stdout.write(done.text)
        return
    console.print(f"wrote {script}: sbatch {script}  ({lay.world_size} processes, layout {lay}; "
                  f"log {log_dir}/{job.job_name}-<job id>.out)")
