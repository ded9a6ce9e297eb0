"""`trainscale compare`: what the planner predicts for a layout next to what this runtime measures, rank by rank
(parameter, gradient and optimizer bytes, saved activations, FLOPs, step time on the hardware profile).

The measuring itself is runtime/probe/compare.py (one torchrun job per world size, the layouts in turn); this module
checks the input, loads or makes the hardware profile and prints. `train --compare-plan` is the same command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer

from trainscale.commands._common import console, emit_json, input_file, number
from trainscale.errors import TrainscaleError


def register(app: typer.Typer) -> None:
    app.command()(compare)


def compare(
    config: Path = typer.Option(..., "--config", callback=input_file("config"),
                                help="training config TOML (see configs/)"),
    layouts: str = typer.Option(None, "--layout", "--layouts",
                                help="layout(s) to measure, separated by ';' (default: the config's run.layout)"),
    steps: int = typer.Option(None, callback=number(gt=0, le=1e9), help="timed steps per layout (default 3)"),
    profile: Path = typer.Option(None, callback=input_file("hardware profile"),
                                 help="hardware profile for the step-time prediction (default: the one "
                                 "`trainscale calibrate` wrote; measured first if there is none)"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
) -> None:
    """Measure layouts on this machine next to the plan: per-rank state bytes, saved activations, FLOPs, step
    time."""
    compare_layouts(config, layouts, steps, profile, as_json)


def compare_layouts(config: Path, layouts: str | None, steps: int | None, profile: Path | None,
                    as_json: bool) -> None:
    """Run each layout under the measuring worker (runtime/probe/compare.py), print predicted vs measured."""
    from trainscale.runtime.config import check_layout
    from trainscale.runtime.init import resolved_config
    from trainscale.runtime.job.local import job_env
    from trainscale.runtime.probe.compare import compare as compare_one
    from trainscale.runtime.probe.compare import compare_command

    cfg = resolved_config(config)
    texts = [x.strip() for x in (layouts if layouts is not None else cfg.run.layout).split(";")]
    if len(texts) > 1 and not all(texts):
        raise TrainscaleError("compare: a layout between ';' is empty; give each one, e.g. 'dp2;tp2'")
    if len(texts) > 64:
        raise TrainscaleError(f"compare measures at most 64 layouts at once, not {len(texts)}")
    from trainscale.specs import Layout

    lays = [Layout.parse(x) for x in texts]
    for lay in lays:
        check_layout(cfg, lay)
    prof = _load_profile(cfg, config, profile, max(lay.world_size for lay in lays), quiet=as_json)
    env = job_env(cfg, console.status)
    env["OMP_NUM_THREADS"] = "1"  # one thread per rank, as torchrun gives multi-process jobs and calibrate measures

    by_world: dict[int, list[str]] = {}
    for text, lay in zip(texts, lays, strict=True):
        by_world.setdefault(lay.world_size, []).append(text)
    measured: dict[str, Any] = {}
    for world, group in by_world.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "measured.json"
            cmd = compare_command(config, group, out, steps=steps or 3)
            with console.status(f"measuring {'; '.join(group)} on {world} process(es)", spinner="dots"):
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not out.exists():
                err = next((ln for ln in reversed(proc.stderr.splitlines()) if "trainscale: error:" in ln), None)
                if err:
                    raise TrainscaleError(err.split("trainscale: error:", 1)[1].strip())
                sys.stderr.write("\n".join((proc.stdout + proc.stderr).splitlines()[-15:]) + "\n")
                raise TrainscaleError(f"measuring layouts {'; '.join(group)} failed (exit {proc.returncode})")
            measured.update(json.loads(out.read_text()))
    results = []
    for text, lay in zip(texts, lays, strict=True):
        res = compare_one(cfg, lay, measured[text], prof)
        results.append(res)
        if not as_json:
            _print_comparison(res)
    if as_json:
        emit_json({"config": str(config), "results": results})
    elif len(results) > 1:
        _print_step_summary(results)


def _load_profile(cfg, config: Path, profile: Path | None, world: int, quiet: bool) -> dict[str, Any]:
    from trainscale.estimate.profile import read_profile, write_profile
    from trainscale.runtime.probe.calibrate import calibrate, default_profile_path

    if profile is not None:
        return read_profile(profile)
    path = default_profile_path()
    if path.exists():
        got = read_profile(path)
        if got.get("machine", {}).get("model") == cfg.model.name and str(world) in got.get("processes", {}):
            return got
    procs = sorted({1, 2, world})
    if not quiet:
        console.print(f"no hardware profile for {cfg.model.name} at {path}: calibrating this machine first "
                      f"(trainscale calibrate --config {config} --processes {','.join(map(str, procs))})")
    with console.status("calibrating", spinner="dots"):
        got = calibrate(cfg.model, cfg.train.seq_len, cfg.train.global_batch, procs)
    write_profile(got, path)
    return got


def _mb(x: float) -> str:
    return f"{x / 1e6:,.3f} MB"


def _diff(pred: float, got: float, unit: str = "") -> str:
    if pred == got:
        return "exact"
    if unit and got and abs(pred - got) / got < 1e-4:  # a few bytes (a scalar) apart
        return f"{pred - got:+,.0f} {unit}"
    return f"{(pred - got) / got:+.2%}" if got else "-"


def _print_comparison(res: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"layout {res['layout']}: {res['world_size']} process(es), micro-batch {res['micro_batch']}",
              title_justify="left")
    for col, just in (("figure", "left"), ("ranks", "left"), ("predicted", "right"), ("measured", "right"),
                      ("difference", "right")):
        t.add_column(col, justify=just)

    def grouped(key) -> list[tuple[list[int], Any]]:
        groups: dict[str, tuple[list[int], Any]] = {}
        for r in res["ranks"]:
            val = key(r)
            groups.setdefault(json.dumps(val, sort_keys=True), ([], val))[0].append(r["rank"])
        return list(groups.values())

    def ranks(ids: list[int]) -> str:
        return "all" if len(ids) == res["world_size"] else ",".join(map(str, ids))

    for what in ("parameters", "gradients", "optimizer"):
        for ids, v in grouped(lambda r, w=what: r["state"][w]):
            t.add_row(f"{what} bytes", ranks(ids), _mb(v["predicted"]), _mb(v["measured"]),
                      _diff(v["predicted"], v["measured"]))
    for ids, acts in grouped(lambda r: r["activations"]):
        for a in acts:
            t.add_row(f"activations saved, stage {a['stage']}", ranks(ids), _mb(a["predicted"]), _mb(a["measured"]),
                      _diff(a["predicted"], a["measured"], "B"))
    for ids, v in grouped(lambda r: {k: r["flops"][k] for k in ("predicted", "measured")}):
        t.add_row("FLOPs per step (FlopCounterMode)", ranks(ids), f"{v['predicted'] / 1e9:,.2f} G",
                  f"{v['measured'] / 1e9:,.2f} G", _diff(v["predicted"], v["measured"]))
    if "step_time_predicted_s" in res:
        t.add_row("step time (slowest rank)", "all", f"{res['step_time_predicted_s'] * 1e3:,.1f} ms",
                  f"{res['step_time_measured_s'] * 1e3:,.1f} ms",
                  _diff(res["step_time_predicted_s"], res["step_time_measured_s"]))
    console.print(t)


def _print_step_summary(results: list[dict[str, Any]]) -> None:
    from statistics import median

    from rich.table import Table

    t = Table(title="step time, predicted from the hardware profile vs measured", title_justify="left")
    for col in ("layout", "processes", "predicted ms", "measured ms", "error"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    errs = []
    for r in results:
        if "step_time_predicted_s" not in r:
            continue
        errs.append(abs(r["step_time_error"]))
        t.add_row(r["layout"], str(r["world_size"]), f"{r['step_time_predicted_s'] * 1e3:,.1f}",
                  f"{r['step_time_measured_s'] * 1e3:,.1f}", f"{r['step_time_error']:+.1%}")
    console.print(t)
    if errs:
        console.print(f"median |error| {median(errs):.1%} over {len(errs)} layouts; model state exact on "
                      f"{sum(r['state_exact'] for r in results)}/{len(results)}")


