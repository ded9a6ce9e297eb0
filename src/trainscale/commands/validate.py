"""`trainscale validate`: the planner's predictions against published training runs, with the errors."""

from __future__ import annotations

import typer
from rich.table import Table

from trainscale.commands._common import console, emit_json


def register(app: typer.Typer) -> None:
    app.command()(validate)


def validate(
    runs: str = typer.Option(None, help="TOML file of [[run]] tables (default: the catalog's published runs)"),
    set_: list[str] = typer.Option(None, "--set", help="override one planner constant for every run, key=value "
                                   "(e.g. sustained_clock_fraction=1 for the unfitted model)"),
    loo: bool = typer.Option(False, "--loo", help="add each row's in-sample and leave-one-out errors: the constants "
                             "catalog/planner.toml marks FITTED refit on every row, and on every other row"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Predict published training runs from their own layouts and software; show predicted vs published."""
    from trainscale.commands.plan import _settings
    from trainscale.estimate.planner.validate import CONVENTION_LABELS, CONVENTIONS, FIGURE_LABELS
    from trainscale.estimate.planner.validate import validate as run_validation

    # the catalog's own claim always comes with its leave-one-out figures (a constant marked FITTED is judged on rows
    # it was not fitted to); another runs file or --set adds them with --loo (per-row columns only then)
    summary = loo or (runs is None and not set_)
    out = run_validation(runs, _settings(set_) or None, loo=summary)
    if as_json:
        emit_json(out)
        return
    t = Table(title="Predicted vs published (error on throughput; + = predicted faster)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("run", "figure", "FLOPs", "reported", "predicted", "error") + (("in-sample", "LOO") if loo else ()):
        t.add_column(col, justify="left" if col in ("run", "figure", "FLOPs") else "right", no_wrap=True)
    for r in out["runs"]:
        err = r["error"]
        conv = CONVENTION_LABELS[r["flop_convention"]] + ("?" if r["flop_convention_source"].startswith("ASSUMED")
                                                          else "")
        extra = (_pct(r["in_sample_error"]), _pct(r["loo_error"])) if loo else ()
        t.add_row(r["id"], FIGURE_LABELS[r["figure"]], conv, f"{r['published']:,.0f}",
                  f"{r['predicted']:,.0f}", _pct(err), *extra)
    console.print(t)
    console.print(f"mean |error| {out['mean_abs_error']:.1%}, worst {out['worst_abs_error']:.1%} "
                  f"({out['worst_run']}); {len(out['runs'])} runs.")
    if summary:
        _print_loo(out)
    mem = [r for r in out["runs"] if r["memory_error"] is not None]
    if mem:
        console.print("Peak memory per GPU where published: " + ", ".join(
            f"{r['id']} {r['memory_per_gpu_bytes'] / 2**30:.1f} vs {r['published_memory_gib']:.1f} GiB "
            f"({r['memory_error']:+.0%})" for r in mem) + ".")
    alt = [r for r in out["runs"] if r["alt_convention"]]
    if alt:
        console.print("Read with another FLOP convention: " + ", ".join(
            f"{r['id']} ({r['alt_convention']['flop_convention']}) {r['alt_convention']['error']:+.1%}" for r in alt)
            + ".")
    console.print("FLOPs = the source's own FLOP count, used to read its TFLOP/s and checked against its MFU "
                  "(? = assumed, the source does not say): "
                  + "; ".join(f"{CONVENTION_LABELS[k]} ({k}) = {v[0]}" for k, v in CONVENTIONS.items() if k in
                              {r["flop_convention"] for r in out["runs"]})
                  + ". Constants: catalog/planner.toml per GPU generation; software: catalog/software.toml; sources "
                    "per run: --json.")


def _pct(err: float) -> str:
    style = "green" if abs(err) <= 0.05 else "yellow" if abs(err) <= 0.10 else "red"
    return f"[{style}]{err:+.1%}[/{style}]"


def _print_loo(out: dict) -> None:
    from trainscale.estimate.planner.validate import loo_by_software

    for k, what in (("in_sample", "in-sample (fit on every row)"), ("loo", "leave-one-out (fit without the row)")):
        s = out[k]
        console.print(f"{what}: mean |error| {s['mean_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} "
                      f"({s['worst_run']}).")
    fits = "; ".join(f"{f['key']} ({f['scope']}) catalog {f['catalog']:g}, refit on its {f['rows']} rows "
                     + (f"({f['rows_moved']} moved by it) " if f["rows_moved"] < f["rows"] else "")
                     + f"in-sample {f['fit_all_rows']:.3f}, leave-one-out {f['loo_min']:.3f}-{f['loo_max']:.3f}"
                     for f in out["fit"])
    console.print(f"Fitted (rule: {out['fit_rule']}): "
                  + (fits or "nothing (in-sample = leave-one-out = the catalog's prediction)") + ".")
    by = {f"{sw}/{gen}": v for (sw, gen), v in loo_by_software(out["runs"]).items()}
    console.print("Leave-one-out mean |error| by software/generation: " + ", ".join(
        f"{k} {sum(v) / len(v):.1%} ({len(v)})" for k, v in sorted(by.items())) + ".")
