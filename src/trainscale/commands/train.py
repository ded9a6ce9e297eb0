"""`trainscale train`: run a training config under a layout on this machine (torchrun, one process per
rank), with a live progress bar. (`trainscale launch --slurm` is commands/launch.py.)"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import typer

from trainscale.commands._common import console, emit_json, input_file, number, output_path
from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output


def register(app: typer.Typer) -> None:
    app.command()(train)


def _resolve(config: Path, layout: str | None, steps: int | None, plan: bool, sets: list[str] | None = None):
    from trainscale.runtime.config import check_layout
    from trainscale.runtime.init import resolved_config

    cfg = resolved_config(config, {"train": {"steps": steps}} if steps else None, sets=sets or ())
    why = None
    if plan:
        if layout:
            raise TrainscaleError("give either --layout or --plan, not both")
        from trainscale.runtime.job.launch import plan_layout

        layout, why = plan_layout(cfg)
    layout = layout if layout is not None else cfg.run.layout
    from trainscale.specs import Layout

    lay = Layout.parse(layout)
    check_layout(cfg, lay)
    return cfg, layout, lay, why


def train(
    config: Path = typer.Option(..., "--config", callback=input_file("config"),
                                help="training config TOML (see configs/)"),
    layout: str = typer.Option(None, help="parallel layout, e.g. dp2,tp2,pp2 (default: the config's run.layout)"),
    steps: int = typer.Option(None, callback=number(gt=0, le=1e9),
                              help="optimizer steps (default: the config's train.steps)"),
    out: Path = typer.Option(None, callback=output_path(folder=True, what="the run folder"),
                             help="run folder (default: the config's run.out)"),
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
    sets = list(sets or [])
    if compare_plan:  # the same as `trainscale compare` (commands/compare.py), kept for scripts that use it
        if sets:
            raise TrainscaleError("--set does not apply to --compare-plan; give the values in the config file")
        from trainscale.commands.compare import compare_layouts

        compare_layouts(config, layout, steps, profile, as_json)
        return
    job = _job(config, layout, steps, plan, sets, out, nnodes, fallback_layout, rdzv_endpoint, rdzv_timeout, resume,
               extend, inject, max_restarts, compile)
    cfg, lay, why, run_dir, cmd, memory, multi_node, total = job
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
    from trainscale.runtime.job.local import run_local

    done = run_local(cmd, cfg, run_dir, resume=resume, multi_node=multi_node, status=console.status,
                     watch=lambda: _progress(str(lay), total, cfg.run.log_every, quiet=as_json))
    if multi_node and not (run_dir / "run.json").exists():
        # this node did not run rank 0 and the run folder is not shared: rank 0's node wrote the results
        note = {"status": "done", "node": socket.gethostname(), "rank0_here": False, "log": str(done.log)}
        if as_json:
            emit_json(note)
        else:
            console.print(f"this node's ranks finished; the node that ran rank 0 wrote the run folder "
                          f"(metrics.jsonl, run.json, final/); this node's log is {done.log}")
        return
    info = json.loads((run_dir / "run.json").read_text())
    if as_json:
        emit_json(info)
        return
    events = [ln for ln in done.log.read_text(errors="replace").splitlines()
              if ln.startswith(("[fault]", "initialised from", "resumed from", "checkpoint ",
                                "no complete checkpoint"))]
    for ln in events:
        console.print(ln, style="yellow", highlight=False, markup=False)
    _summary(info, done.rows, run_dir)


class _Job(NamedTuple):
    """A training job checked and ready to start."""

    cfg: Any  # runtime.config.TrainConfig
    lay: Any  # specs.Layout
    why: str | None  # why the planner chose the layout (--plan)
    run_dir: Path
    cmd: list[str]  # torchrun's command line
    memory: dict[str, Any]  # the pre-flight's comparison (runtime/job/preflight.py)
    multi_node: bool
    total: int  # the step the run stops at


def _job(config: Path, layout: str | None, steps: int | None, plan: bool, sets: list[str], out: Path | None,
         nnodes: str, fallback_layout: str | None, rdzv_endpoint: str | None, rdzv_timeout: int, resume: bool,
         extend: bool, inject: str | None, max_restarts: int, compile: bool) -> _Job:
    """Everything checked before anything starts: the config and layout, the run folder, the faults, the memory
    pre-flight and a --resume; -> the job (its torchrun command, the steps it runs to, ...)."""
    from trainscale.runtime.job import runfolder
    from trainscale.runtime.job.faults import parse_faults
    from trainscale.runtime.job.launch import parse_nnodes, torchrun_command
    from trainscale.runtime.job.preflight import preflight

    min_nodes, max_nodes = parse_nnodes(nnodes)
    if extend and not resume:
        raise TrainscaleError("--extend continues a run past its total steps: use it with --resume and --steps")
    cfg, layout_text, lay, why = _resolve(config, layout, steps, plan, sets)
    if fallback_layout is not None:  # checked here, not when a machine is lost
        from trainscale.runtime.job.elastic import check_fallback

        check_fallback(cfg, lay, fallback_layout, min_nodes, max_nodes)
    from trainscale.runtime.data.corpus import check_data

    check_data(cfg)  # the config's own inputs before the run folder's checks: a wrong path is named as one
    run_dir = out or Path(cfg.run.out)
    check_output(run_dir, "the run folder", folder=True)
    parse_faults(inject, lay.world_size)  # a bad fault spec is a one-line error here, not a crash in every worker
    memory = preflight(cfg, lay, max_nodes)  # refuses, in one sentence, a layout this machine cannot hold
    cmd = torchrun_command(config, layout_text, run_dir, lay.world_size, steps, nnodes, rdzv_endpoint,
                           max_restarts=max_restarts, inject=inject, resume=resume, fallback_layout=fallback_layout,
                           compile=compile, rdzv_timeout=rdzv_timeout)
    cmd += [a for s in sets for a in ("--set", s)] + (["--extend"] if extend else [])
    multi_node = max_nodes > 1 or rdzv_endpoint is not None
    total = cfg.train.steps
    if resume and not multi_node:  # read-only: a refused --resume leaves the run folder as it was
        total = runfolder.check_resume(run_dir, runfolder.checkpoint_root(run_dir, cfg.checkpoint.dir), cfg, steps,
                                       extend)
    return _Job(cfg, lay, why, run_dir, cmd, memory, multi_node, total)


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


@contextmanager
def _progress(layout: str, total: int, log_every: int, quiet: bool) -> Iterator[Callable[[dict[str, Any]], None]]:
    """The live view of a job (runtime/job/local.follow feeds it rank 0's metrics rows): a progress bar, and the
    console line of each row that has one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trainscale.runtime.job.runfolder import console_line
    from trainscale.units import duration_text

    columns = [TextColumn("[bold]train[/bold] {task.fields[layout]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
               TextColumn("{task.fields[flops]} GFLOP/s"), TextColumn("MFU {task.fields[mfu]}"), TimeElapsedColumn(),
               TextColumn("ETA {task.fields[eta]}")]
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        task = progress.add_task("train", total=total, layout=layout, loss="-", tps="-", flops="-", mfu="-", eta="-")

        def show(row: dict[str, Any]) -> None:
            text = console_line(row, log_every, total)
            if text is not None and not quiet:
                progress.console.print(text, highlight=False, markup=False, soft_wrap=True)
            if "loss" in row:
                progress.update(task, completed=row["step"], loss=f"{row['loss']:.4f}",
                                tps=f"{row['tokens_per_s']:,.0f}", flops=f"{row['flops_per_s'] / 1e9:.2f}",
                                mfu=f"{row['mfu']:.1%}", eta=duration_text(row.get("eta_s")))

        yield show


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

