"""`trainscale explain`: the seed article's walkthrough, every figure with its formula and source."""

from __future__ import annotations

import typer
from rich.table import Table

from trainscale.commands._common import catalog_or_file, console, counted, emit_json, number
from trainscale.units import short_source


def register(app: typer.Typer) -> None:
    app.command()(explain)


def explain(
    model: str = typer.Option("llama3.1-405b", callback=catalog_or_file("model"),
                              help="catalog name, TOML file or HF config.json"),
    tokens: str = typer.Option(None, callback=counted(1000), help="training tokens, e.g. 2T or 1.56e13; K/M/B/T are "
                               "powers of 1000 (default: Llama 3.1's 15.6T)"),
    gpu: str = typer.Option("h100-sxm", callback=catalog_or_file("GPU"), help="the cluster's GPU"),
    gpus: int = typer.Option(None, callback=number(gt=0, le=1e8), help="GPUs in the cluster (default: Meta's 16,384)"),
    mfu: float = typer.Option(0.40, callback=number(gt=0, le=1),
                              help="model FLOPs utilization for the what-if figures"),
    home_gpu: str = typer.Option("rtx4090", callback=catalog_or_file("GPU"), help="the one card at home"),
    home_model: str = typer.Option("llama3.1-8b", callback=catalog_or_file("model"), help="the model to run at home"),
    gpu_hours: float = typer.Option(None, callback=number(gt=0, le=1e13),
                                    help="reported GPU-hours (default: Meta's 30.84M for 405B)"),
    seq: int = typer.Option(None, callback=number(gt=0, le=1 << 24),
                            help="training sequence length of the attention FLOPs (default: Llama 3's 8,192)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Walk through why training takes a data center, every figure with its formula and source."""
    from trainscale.estimate.walkthrough import walkthrough
    from trainscale.units import value

    w = walkthrough(model=model, tokens=tokens, gpu=gpu, gpus=gpus, mfu=mfu, home_gpu=home_gpu,
                    home_model=home_model, gpu_hours=gpu_hours, seq=seq)
    if as_json:
        emit_json(w)
        return
    inp = w["inputs"]
    console.print(f"[bold]Why training {inp['model']} takes a data center[/bold] "
                  f"({inp['tokens']:.3g} tokens of seq {inp['seq']:,}, {inp['gpus']:,} x {inp['gpu']}, "
                  f"home: {inp['home_gpu']})")
    console.print(f"FLOPs counted as {w['flop_convention']}")
    for sec in w["sections"]:
        t = Table(title=sec["title"], title_justify="left", show_edge=False, pad_edge=False)
        t.add_column("figure")
        t.add_column("value", justify="right")
        t.add_column("how")
        t.add_column("source", overflow="fold", max_width=48)
        for f in sec["figures"]:
            t.add_row(f["label"], value(f["value"], f["unit"]), f["formula"], short_source(f["source"]))
        console.print(t)
