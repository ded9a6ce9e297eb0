"""`trainscale reliability`: interruptions, checkpoint interval and effective training time of a big run."""

from __future__ import annotations

from math import isfinite
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from trainscale.commands._common import SEED, catalog_or_file, console, emit_json, number, output_path
from trainscale.errors import TrainscaleError
from trainscale.units import short_source


def register(app: typer.Typer) -> None:
    app.command()(reliability)


def reliability(
    model: str = typer.Option("llama3.1-405b", callback=catalog_or_file("model"),
                              help="catalog name, TOML file or HF config.json (sets checkpoint size)"),
    gpus: int = typer.Option(None, callback=number(gt=0, le=1e8), help="GPUs in the job (default: Meta's 16,384)"),
    days: float = typer.Option(None, callback=number(gt=0, le=36_500),
                               help="wall-clock length of the run, days (default: Meta's 54-day snapshot)"),
    interval_min: float = typer.Option(None, callback=number(gt=0, le=1e7),
                                       help="compute minutes between checkpoints (default: Daly's optimum)"),
    mtbf_h: float = typer.Option(None, callback=number(gt=0, le=1e9),
                                 help="job mean time between unexpected failures, hours (overrides the rate)"),
    fail_rate_per_gpu_hour: float = typer.Option(
        None, callback=number(ge=0, le=1),
        help="unexpected failures per GPU-hour (default: Meta's 419 / (16,384 x 54 x 24 h))"),
    planned_per_day: float = typer.Option(None, callback=number(ge=0, le=1e4),
                                          help="planned interruptions per day (default: Meta's 47 in 54 days)"),
    ckpt_write_s: float = typer.Option(None, callback=number(ge=0, le=1e7),
                                       help="seconds to write one checkpoint (default: size / bandwidth)"),
    storage_bw: float = typer.Option(None, callback=number(gt=0, le=1e15),
                                     help="checkpoint write bandwidth, bytes/s (default: Tectonic's 2e12)"),
    restart_min: float = typer.Option(None, callback=number(ge=0, le=1e6),
                                      help="minutes to restart after an interruption (default: 10, assumed)"),
    trials: int = typer.Option(1000, callback=number(gt=0, le=100_000), help="Monte Carlo trials"),
    seed: int = typer.Option(0, callback=SEED, help="random seed"),
    sweep: bool = typer.Option(False, "--sweep", help="also simulate a range of checkpoint intervals"),
    plot: Path = typer.Option(None, callback=output_path(folder=False),
                              help="write the interval sweep as a PNG (implies --sweep)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Failure rate, checkpoint size and interval (Young, Daly), and a Monte Carlo of the run's effective time."""
    from trainscale.estimate import reliability as rel

    if plot is not None and plot.suffix.lower() != ".png":
        raise TrainscaleError(f"--plot must name a .png file, not {plot}")
    if plot is not None:
        from trainscale.safeio import check_output

        check_output(plot, "--plot", folder=False)
    rep = rel.reliability_report(
        model=model, gpus=gpus, days=days,
        interval_s=None if interval_min is None else interval_min * 60,
        mtbf_s=None if mtbf_h is None else mtbf_h * 3600,
        rate_per_gpu_hour=fail_rate_per_gpu_hour, planned_per_day=planned_per_day,
        ckpt_write_s=ckpt_write_s, storage_bw=storage_bw,
        restart_s=None if restart_min is None else restart_min * 60,
        trials=trials, seed=seed,
        sweep_intervals_s=[m * 60 for m in rel.DEFAULT_SWEEP_MIN] if (sweep or plot is not None) else None,
    )
    if plot is not None:
        plot_sweep(rep, plot)
        rep["plot"] = str(plot)
    if as_json:
        emit_json(_finite(rep))
        return
    _print(rep)


def _finite(obj: Any) -> Any:
    """JSON has no infinity: an infinite MTBF (no failures) becomes null."""
    if isinstance(obj, float) and not isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _t(s: float) -> str:
    from trainscale.units import seconds

    if not isfinite(s):
        return "never"
    if 60 <= s < 3600:
        return f"{s / 60:,.1f} min"
    return seconds(s)


def _table(title: str, rows: list[tuple[str, str, str]]) -> Table:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("how / source", overflow="fold", max_width=64)
    for r in rows:
        t.add_row(*r)
    return t


def _print(rep: dict[str, Any]) -> None:
    from trainscale.units import bytes_

    inp, f, c, iv, sim = rep["inputs"], rep["failures"], rep["checkpoint"], rep["intervals"], rep["simulation"]
    console.print(f"[bold]Reliability of a {inp['days']:g}-day run of {inp['model']} on {inp['gpus']:,} GPUs[/bold]")
    console.print(_table("Interruptions", [
        ("unexpected failures per GPU-hour", f"{f['rate_per_gpu_hour']:.3g}",
         "Meta's 419 / (16,384 x 54 x 24 h)" if f["rate_from"] == "Meta"
         else f"{f['rate_from']} (Meta's: {f['meta_rate_per_gpu_hour']:.3g})"),
        ("job MTBF (unexpected)", _t(f["job_mtbf_s"]), "1 / (rate x GPUs)"),
        ("time between planned stops", _t(f["planned_mtbi_s"]), "Meta: 47 in 54 days, per job"),
        ("expected unexpected", f"{f['expected_unexpected']:,.0f}", "run length / MTBF"),
        ("expected planned", f"{f['expected_planned']:,.0f}", "run length / planned interval"),
        ("expected interruptions", f"{f['expected_total']:,.0f}",
         f"one every {_t(f['mean_time_between_interruptions_s'])}; {short_source(f['source'])}"),
    ]))
    causes = Table(title="Expected unexpected failures by cause (Llama 3 Table 5, scaled)", title_justify="left",
                   show_edge=False, pad_edge=False)
    for col, just in (("cause", "left"), ("category", "left"), ("Meta count", "right"), ("share", "right"),
                      ("published %", "right"), ("expected here", "right")):
        causes.add_column(col, justify=just)
    for r in f["causes"]:
        causes.add_row(r["cause"], r["category"], str(r["meta_count"]), f"{r['share']:.1%}",
                       f"{r['published_percent']:.1f}%", f"{r['expected']:,.1f}")
    console.print(causes)
    bw = c["storage_bandwidth"]
    console.print(_table("Checkpoint", [
        ("checkpoint size", bytes_(c["bytes"]), f"{c['bytes_per_param']:g} B/param x {inp['params']:,} params: "
         + c["contents"]),
        ("write bandwidth", "-" if bw is None else f"{bw / 1e12:,.2f} TB/s",
         c["bandwidth_from"] + ("" if bw is None else f"; {short_source(c['storage_source'])}")),
        ("write time (delta)", _t(c["write_s"]), "size / bandwidth" if bw is not None else "given"),
        ("restart time (R)", _t(c["restart_s"]), c["restart_source"]),
        ("Young interval", _t(iv["young_s"]), iv["young_source"]),
        ("Daly interval", _t(iv["daly_s"]), iv["daly_source"]),
    ]))
    sec = sim["seconds_mean"]
    total = sum(sec.values())
    console.print(_table(f"Simulation ({sim['trials']:,} trials, checkpoint every {_t(sim['interval_s'])} of compute"
                         f", {inp['interval_from']})", [
        ("effective time p5 / p50 / p95", f"{sim['effective_p5']:.1%} / {sim['effective_p50']:.1%} / "
         f"{sim['effective_p95']:.1%}", "useful compute / wall-clock time"),
        ("analytic (Daly)", f"{sim['analytic']:.1%}", "Daly 2006 expected wall time, x (1 - (delta + R) / planned)"),
        ("Meta reported", f"> {sim['meta_effective_min']:.0%}", short_source(sim["meta_effective_source"])),
        ("lost work", f"{sec['lost'] / total:.1%}", f"{_t(sec['lost'])} recomputed after failures"),
        ("restarting", f"{sec['restart'] / total:.1%}", _t(sec["restart"])),
        ("checkpointing", f"{sec['checkpoint'] / total:.1%}", f"{sim['checkpoints_mean']:,.0f} checkpoints"),
        ("failures / planned stops", f"{sim['failures_mean']:,.0f} / {sim['planned_mean']:,.0f}", "mean per trial"),
    ]))
    if "sweep" in rep:
        console.print(_sweep_table(rep["sweep"], iv))
    if "plot" in rep:
        console.print(f"plot: {rep['plot']}")


def _sweep_table(sweep: list[dict[str, Any]], iv: dict[str, Any]) -> Table:
    t = Table(title="Checkpoint interval sweep", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("interval", "p5", "p50", "p95", "analytic", "lost", "checkpointing"):
        t.add_column(col, justify="right")
    for r in sweep:
        mark = " (Daly)" if r["interval_s"] == iv["daly_s"] else " (Young)" if r["interval_s"] == iv["young_s"] \
            else ""
        t.add_row(_t(r["interval_s"]) + mark, f"{r['effective_p5']:.1%}", f"{r['effective_p50']:.1%}",
                  f"{r['effective_p95']:.1%}", f"{r['analytic']:.1%}", _t(r["lost_s_mean"]),
                  _t(r["checkpoint_s_mean"]))
    return t


def plot_sweep(rep: dict[str, Any], path: Path) -> None:
    """Effective time vs checkpoint interval: simulated median with its p5-p95 band, Daly's curve, Young and Daly."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = rep["sweep"]
    x = np.array([r["interval_s"] for r in rows]) / 60
    p5, p50, p95 = (np.array([r[k] for r in rows]) * 100 for k in ("effective_p5", "effective_p50", "effective_p95"))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ax.fill_between(x, p5, p95, alpha=0.25, label="simulated p5-p95")
    ax.plot(x, p50, "o-", ms=3, label="simulated median")
    ax.plot(x, [r["analytic"] * 100 for r in rows], "--", color="gray", label="Daly 2006 (analytic)")
    iv = rep["intervals"]
    ax.axvline(iv["young_s"] / 60, color="tab:green", ls=":", label=f"Young √(2δM) = {iv['young_s'] / 60:.1f} min")
    ax.axvline(iv["daly_s"] / 60, color="tab:red", ls="-.", label=f"Daly optimum = {iv['daly_s'] / 60:.1f} min")
    ax.axhline(rep["simulation"]["meta_effective_min"] * 100, color="black", lw=0.8, label="Meta: > 90%")
    ax.set_xscale("log")
    ax.set_xlabel("compute between checkpoints τ (minutes, log scale)")
    ax.set_ylabel("effective training time (% of wall clock)")
    inp, f, c = rep["inputs"], rep["failures"], rep["checkpoint"]
    ax.set_title(f"{inp['model']} on {inp['gpus']:,} GPUs, {inp['days']:g} days: job MTBF "
                 f"{f['job_mtbf_s'] / 3600:.2f} h, checkpoint δ = {c['write_s']:.3g} s, restart R = "
                 f"{c['restart_s'] / 60:.3g} min", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise TrainscaleError(f"cannot write plot {path}: {e}") from None
    finally:
        plt.close(fig)
