"""`trainscale train`: run a training config under a layout on this machine (torchrun, one process per
rank), with a live progress bar. (`trainscale launch --slurm` is commands/launch.py.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import typer

from trainscale.commands._common import (
    console,
    emit_json,
    input_file,
    number,
    parse_layout,
    preflight,
    prepare_job_env,
)
from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output


def register(app: typer.Typer) -> None:
    app.command()(train)


def _resolve(config: Path, layout: str | None, steps: int | None, plan: bool, sets: list[str] | None = None):
    from trainscale.runtime.config import check_layout, load_config

    if steps is not None and steps <= 0:
        raise TrainscaleError(f"--steps must be positive, not {steps}")
    cfg = load_config(config, {"train": {"steps": steps}} if steps else None, sets=sets or ())
    why = None
    if plan:
        if layout:
            raise TrainscaleError("give either --layout or --plan, not both")
        from trainscale.runtime.job.launch import plan_layout

        layout, why = plan_layout(cfg)
    layout = layout if layout is not None else cfg.run.layout
    lay = parse_layout(layout)
    check_layout(cfg, lay)
    return cfg, layout, lay, why


def train(
    config: Path = typer.Option(..., "--config", callback=input_file("config"),
                                help="training config TOML (see configs/)"),
    layout: str = typer.Option(None, help="parallel layout, e.g. dp2,tp2,pp2 (default: the config's run.layout)"),
    steps: int = typer.Option(None, callback=number(gt=0, le=1e9),
                              help="optimizer steps (default: the config's train.steps)"),
    out: Path = typer.Option(None, help="run folder (default: the config's run.out)"),
    plan: bool = typer.Option(False, "--plan", help="ask the planner for the best layout for this machine"),
    nnodes: str = typer.Option("1", help="machines in the job (run the same command on each); MIN:MAX makes it "
                               "elastic: it goes on after losing machines, down to MIN"),
    fallback_layout: str = typer.Option(None, help="elastic jobs: the layout for a re-formed job whose world size "
                                        "the layout's own rule (same tp/cp/pp, fewer dp) cannot serve"),
    rdzv_endpoint: str = typer.Option(None, help="HOST:PORT of the first machine, for a multi-node rendezvous"),
    rdzv_timeout: int = typer.Option(600, callback=number(gt=0, le=86400),
                                     help="multi-node: seconds to wait for the other machines to join"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run folder's newest good checkpoint, on "
                                "the run's own learning-rate schedule, to --steps (default: the run's total)"),
    extend: bool = typer.Option(False, "--extend", help="with --resume: go past the run's total (the schedule is laid "
                                "out again where the steps so far are unchanged by it, as in WSD's stable phase; "
                                "else the extra steps train at its final learning rate)"),
    sets: list[str] = typer.Option(None, "--set", metavar="SECTION.KEY=VALUE",
                                   help="override a config value, e.g. --set train.lr=1e-4 (a TOML value; "
                                   "repeatable); it is part of the run's config.toml"),
    inject: str = typer.Option(None, help="faults to inject, e.g. 'crash@step=7,rank=1' (crash, hang, slow, "
                               "kill-during-save); checkpoints come from the config's [checkpoint] section"),
    max_restarts: int = typer.Option(3, callback=number(ge=0, le=1000),
                                     help="torchrun restarts after a failure (each resumes from a checkpoint)"),
    compile: bool = typer.Option(False, "--compile", help="torch.compile each transformer block (after TP, CP "
                                 "and activation checkpointing, before FSDP); or [train] compile = true"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the layout and the torchrun command, run nothing"),
    as_json: bool = typer.Option(False, "--json", help="no progress bar; print run.json at the end"),
    compare_plan: bool = typer.Option(False, "--compare-plan", help="the same as `trainscale compare`: measure the "
                                      "layout(s) instead of training, next to the prediction"),
    profile: Path = typer.Option(None, callback=input_file("hardware profile"),
                                 help="hardware profile for the step-time prediction (default: the one "
                                 "`trainscale calibrate` wrote; measured first if there is none)"),
) -> None:
    """Train a model with real 4D parallelism (torch.distributed: TP+SP, CP, PP, FSDP) on this machine."""
    from trainscale.runtime.job.launch import torchrun_command

    sets = list(sets or [])
    if compare_plan:  # the same as `trainscale compare` (commands/compare.py), kept for scripts that use it
        if sets:
            raise TrainscaleError("--set does not apply to --compare-plan; give the values in the config file")
        from trainscale.commands.compare import compare_layouts

        compare_layouts(config, layout, steps, profile, as_json)
        return
    from trainscale.runtime.job.launch import parse_nnodes

    _, max_nodes = parse_nnodes(nnodes)
    if fallback_layout is not None:
        from trainscale.specs import Layout as _Layout

        _Layout.parse(fallback_layout)  # a bad fallback is a one-line error here, not in every worker later
    if extend and not resume:
        raise TrainscaleError("--extend continues a run past its total steps: use it with --resume and --steps")
    cfg, layout_text, lay, why = _resolve(config, layout, steps, plan, sets)
    run_dir = out or Path(cfg.run.out)
    check_output(run_dir, "the run folder", folder=True)
    from trainscale.runtime.job.faults import parse_faults

    parse_faults(inject, lay.world_size)  # a bad fault spec is a one-line error here, not a crash in every worker
    if max_restarts < 0:
        raise TrainscaleError(f"--max-restarts must be >= 0, not {max_restarts}")
    memory = preflight(cfg, lay, max_nodes)  # refuses, in one sentence, a layout this machine cannot hold
    cmd = torchrun_command(config, layout_text, run_dir, lay.world_size, steps, nnodes, rdzv_endpoint,
                           max_restarts=max_restarts, inject=inject, resume=resume, fallback_layout=fallback_layout,
                           compile=compile, rdzv_timeout=rdzv_timeout)
    cmd += [a for s in sets for a in ("--set", s)] + (["--extend"] if extend else [])
    multi_node = max_nodes > 1 or rdzv_endpoint is not None
    total = cfg.train.steps
    if resume and not multi_node:  # read-only: a refused --resume leaves the run folder as it was
        from trainscale.runtime.job import runfolder

        ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        total = runfolder.check_resume(run_dir, ckpt_root, cfg, steps, extend)
    if dry_run:
        info = {"layout": str(lay), "world_size": lay.world_size, "why": why, "command": cmd, "memory": memory}
        if as_json:
            emit_json(info)
        else:
            if why:
                console.print(f"layout {lay} ({why})")
            console.print(_memory_line(memory), markup=False, highlight=False, soft_wrap=True)
            console.print(" ".join(cmd), soft_wrap=True, markup=False, highlight=False)
        return
    if why and not as_json:
        console.print(f"[bold]plan:[/bold] {lay} ({why})")
    from trainscale.runtime.job import runfolder

    # one machine: this process holds the run folder's lock for the whole job (restarts included) and
    # names the run; on several machines rank 0 of the job does both (the folder may be shared)
    lock = runfolder.RunLock(run_dir).acquire() if not multi_node else None
    # the ranks' one-sentence error goes outside the run folder: a full disk there must not swallow it
    err_dir = Path(tempfile.mkdtemp(prefix="trainscale-job-"))
    try:
        err_file = err_dir / runfolder.ERROR
        run_id = None
        if lock is not None:
            ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
            run_id = runfolder.claim(run_dir, ckpt_root, cfg, resume)
        env = prepare_job_env(cfg)
        if run_id is not None:
            env[runfolder.ENV_RUN_ID] = run_id
            env[runfolder.ENV_ERROR_FILE] = str(err_file)
        if not multi_node:  # this invocation is one launch of the job (goodput leaves out the time between)
            env[runfolder.ENV_LAUNCH] = uuid.uuid4().hex
        if "trainscale.runtime.job.launch" in cmd:  # our torchrun wrapper ends with this process (PDEATHSIG)
            env[runfolder.ENV_PARENT] = str(os.getpid())
        else:
            env.pop(runfolder.ENV_PARENT, None)
        run_dir.mkdir(parents=True, exist_ok=True)
        # every node keeps its own log: in a shared run folder the nodes would otherwise overwrite one file
        log_path = run_dir / (f"train-{socket.gethostname()}-{os.getpid()}.log" if multi_node else "train.log")
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and not resume and not multi_node:  # rank 0's node truncates it (runtime/train.py)
            metrics.unlink()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                rows = _follow(proc, metrics, total, cfg.run.log_every,
                               str(lay), quiet=as_json, error_file=err_file if lock is not None else None)
            except BaseException:
                _stop(proc)
                raise
        if proc.returncode != 0 or err_file.exists():
            _raise_failure(err_file, log_path, proc.returncode)
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)
        if lock is not None:
            lock.release()
    if multi_node and not (run_dir / "run.json").exists():
        # this node did not run rank 0 and the run folder is not shared: rank 0's node wrote the results
        note = {"status": "done", "node": socket.gethostname(), "rank0_here": False, "log": str(log_path)}
        if as_json:
            emit_json(note)
        else:
            console.print(f"this node's ranks finished; the node that ran rank 0 wrote the run folder "
                          f"(metrics.jsonl, run.json, final/); this node's log is {log_path}")
        return
    info = json.loads((run_dir / "run.json").read_text())
    if as_json:
        emit_json(info)
        return
    events = [ln for ln in log_path.read_text(errors="replace").splitlines()
              if ln.startswith(("[fault]", "initialised from", "resumed from", "checkpoint ",
                                "no complete checkpoint"))]
    for ln in events:
        console.print(ln, style="yellow", highlight=False, markup=False)
    _summary(info, rows, run_dir)


def _memory_line(mem: dict[str, Any]) -> str:
    """--dry-run: the pre-flight's prediction against this machine's memory."""
    from trainscale.units import size as gb

    if not mem.get("checked"):
        return f"memory: not checked ({mem.get('why')})"
    pred = (f"{gb(mem['predicted_this_machine_bytes'])} for the {mem['ranks_here']} process(es) on this machine"
            if mem["shared_by_ranks"] else f"{gb(mem['predicted_per_rank_bytes'])} per GPU")
    has = (f"{gb(mem['capacity_bytes'])} of RAM available" if mem["shared_by_ranks"] else
           f"{gb(mem['capacity_bytes'])} per GPU")
    return (f"memory: {pred} predicted (heaviest rank: weights, gradients and AdamW state "
            f"{gb(mem['predicted_state_bytes'])} + activations {gb(mem['predicted_activation_bytes'])}, "
            f"{'bf16' if mem['bf16'] else 'fp32'}) against {has} ({mem['capacity_source']}): fits")


def _stop(proc: subprocess.Popen) -> None:
    """End the torchrun agent (it stops its ranks on SIGTERM), then make sure."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _raise_failure(err_file: Path, log_path: Path, code: int) -> None:
    """The one sentence that failed the job: a rank's recorded error (exit 2 for bad input such as a refused
    checkpoint, 1 for a failed job such as a full disk), else the last rank failure in the log."""
    from trainscale.errors import JobFailed
    from trainscale.safeio import read_json_object

    if err_file.exists():
        try:
            got = read_json_object(err_file, "error record")
        except TrainscaleError:
            got = {}
        if isinstance(got.get("error"), str):
            if got.get("exit") == 1:
                raise JobFailed(got["error"])
            raise TrainscaleError(got["error"])
    lines = log_path.read_text(errors="replace").splitlines()
    err = next((ln for ln in reversed(lines) if "trainscale: error:" in ln), None)
    if err:
        raise JobFailed(err.split("trainscale: error:", 1)[1].strip())
    if any("RendezvousTimeoutError" in ln for ln in lines):
        raise JobFailed(f"the other machines did not join the rendezvous in time (--rdzv-timeout); the whole log is "
                        f"{log_path}")
    cause = next((ln.split("failed: ", 1)[1] for ln in reversed(lines)
                  if "trainscale: rank" in ln and "failed: " in ln), None)
    raise JobFailed(f"training failed (exit {code}{'; ' + cause if cause else ''}); the whole log is {log_path}")


def _follow(proc: subprocess.Popen, metrics: Path, total: int, log_every: int, layout: str,
            quiet: bool, error_file: Path | None = None) -> list[dict[str, Any]]:
    """Tail rank 0's metrics.jsonl into a progress bar until the job ends (or a rank records a
    deterministic error, which a restart would only repeat: then the job is stopped)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trainscale.runtime.job.runfolder import console_line
    from trainscale.units import duration_text

    rows: list[dict[str, Any]] = []
    pos = metrics.stat().st_size if metrics.exists() else 0  # a resumed run's earlier lines are not news
    columns = [TextColumn("[bold]train[/bold] {task.fields[layout]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
               TextColumn("{task.fields[flops]} GFLOP/s"), TextColumn("MFU {task.fields[mfu]}"), TimeElapsedColumn(),
               TextColumn("ETA {task.fields[eta]}")]
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        task = progress.add_task("train", total=total, layout=layout, loss="-", tps="-", flops="-", mfu="-", eta="-")
        while True:
            done = proc.poll() is not None
            if metrics.exists():
                pos = 0 if metrics.stat().st_size < pos else pos  # a fresh run truncated an old run's file
                with open(metrics) as f:
                    f.seek(pos)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                pos += len(complete.encode())
                for line in complete.splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    text = console_line(row, log_every, total)
                    if text is not None and not quiet:
                        progress.console.print(text, highlight=False, markup=False, soft_wrap=True)
                    if "loss" not in row:
                        continue
                    rows.append(row)
                    progress.update(task, completed=row["step"], loss=f"{row['loss']:.4f}",
                                    tps=f"{row['tokens_per_s']:,.0f}", flops=f"{row['flops_per_s'] / 1e9:.2f}",
                                    mfu=f"{row['mfu']:.1%}", eta=duration_text(row.get("eta_s")))
            if done:
                break
            if error_file is not None and error_file.exists():
                _stop(proc)
                break
            time.sleep(0.2)
    return rows


def _summary(info: dict[str, Any], rows: list[dict[str, Any]], run_dir: Path) -> None:
    from rich.table import Table

    t = Table(title=f"run {run_dir}", title_justify="left", show_header=False, show_edge=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("layout", f"{info['layout']} on {info['world_size']} process(es), {info['backend']}")
    t.add_row("model", f"{info['model'].get('name')} ({info['params'] / 1e6:.2f}M parameters)")
    t.add_row("steps", f"{info['steps']} in {info['seconds']:.1f} s")
    t.add_row("final train loss", f"{info['final_loss']:.4f}")
    if info.get("eval_loss") is not None:
        t.add_row("held-out loss", f"{info['eval_loss']:.4f} (unigram baseline {info['unigram_loss']:.4f})")
    t.add_row("tokens/s", f"{info['tokens_per_s']:,.0f}")
    t.add_row("MFU", f"{info['mfu']:.1%} of {info['peak_flops'] / 1e9:,.1f} GFLOP/s ({info['peak_source']}), FLOPs "
              f"counted as {info.get('flop_convention', 'the planner counts them')}")
    if "goodput" in info:
        t.add_row("goodput", f"{info['goodput']:.1%} ({info['useful_step_s']:.1f} s of useful steps in "
                  f"{info['wall_s']:.1f} s wall)")
        t.add_row("recovery", f"{info['restarts']} restart(s), {info['lost_steps']} step(s) recomputed, "
                  f"{info['checkpoints']} checkpoint(s) in {info['checkpoint_s']:.1f} s, "
                  f"{info['restart_and_startup_s']:.1f} s starting/restarting")
    moe = [r for r in rows if r.get("expert_tokens")]
    if moe:
        t.add_row("experts", _expert_summary(moe))
    if (run_dir / "final").exists():
        t.add_row("model folder", str(run_dir / "final"))
    console.print(t)


def _expert_summary(rows: list[dict[str, Any]]) -> str:
    """A MoE run in one line: how unevenly the router spread the last step's tokens (the busiest expert
    over the mean, per layer, worst layer) and the expert all-to-all's median share of the step."""
    last = rows[-1]["expert_tokens"]
    worst = max(max(c) / (sum(c) / len(c)) for c in last.values() if sum(c))
    shares = sorted(r["a2a_share"] for r in rows if r.get("a2a_share") is not None)
    a2a = f"; all-to-all {shares[len(shares) // 2]:.0%} of a step (median)" if shares else ""
    return f"{len(last)} MoE layer(s); busiest expert {worst:.2f}x the mean (last step){a2a}"

