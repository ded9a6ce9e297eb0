"""`trainscale report`: a self-contained HTML page with the pictures, for a plan or a real run."""

from __future__ import annotations

from pathlib import Path

import typer

from trainscale.commands._common import (
    catalog_or_file,
    console,
    counted,
    emit_json,
    input_file,
    input_folder,
    number,
    output_path,
)


def register(app: typer.Typer) -> None:
    app.command()(report)


def report(
    out: Path = typer.Option(..., "--out", callback=output_path(folder=True),
                             help="folder for index.html and the figures"),
    model: str = typer.Option("llama3.1-405b", callback=catalog_or_file("model"),
                              help="catalog name, TOML file or HF config.json"),
    gpu: str = typer.Option("h100-sxm", callback=catalog_or_file("GPU"), help="GPU of the cluster"),
    gpus: int = typer.Option(16384, callback=number(gt=0, le=1e8), help="number of GPUs"),
    cluster: str = typer.Option("meta-h100", callback=catalog_or_file("cluster"),
                                help="cluster (servers, racks, links)"),
    layout: str = typer.Option("tp8,cp1,pp16,dp128,mb1,v8,zero2", help="layout to draw ('' for none)"),
    tokens: str = typer.Option(None, callback=counted(1000), help="training tokens, e.g. 2T or 1.56e13; K/M/B/T are "
                               "powers of 1000 (default: Llama 3.1's 15.6T)"),
    mfu: float = typer.Option(0.40, callback=number(gt=0, le=1), help="MFU for time and energy"),
    seq: int = typer.Option(None, callback=number(gt=0, le=1 << 24),
                            help="training sequence length of the attention FLOPs (default 8,192)"),
    run: Path = typer.Option(None, "--run", callback=input_folder("run folder", "metrics.jsonl"),
                             help="a trainscale run folder to report on"),
    plan: Path = typer.Option(None, "--plan", callback=input_file("plan JSON"),
                              help="the JSON of 'trainscale plan --json' (sets model, GPUs, layout, MFU, seq, tokens)"),
    walkthrough: bool = typer.Option(None, "--walkthrough/--no-walkthrough",
                                     help="with --run: add the walkthrough pages (--model on --gpus) after the run "
                                          "(default: only the run)"),
    check: bool = typer.Option(False, help="open the page in headless Chromium and check every image loads"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Write the HTML report (PNG + SVG figures, numbers as text) into --out; opens nothing. With --run the page
    is the run's (loss with held-out points and the unigram baseline, throughput, MFU, every restart marked, its
    layout); --walkthrough adds the pages about --model on --gpus after it."""
    from trainscale.safeio import check_output

    check_output(out, "--out", folder=True, inputs=tuple(x for x in (run,) if x is not None))
    if layout:
        from trainscale.specs import Layout

        Layout.parse(layout)
    from trainscale.errors import TrainscaleError
    from trainscale.report.build import build_report

    page = build_report(out, model=model, gpu=gpu, gpus=gpus, cluster=cluster, layout=layout or None,
                        tokens=tokens, mfu=mfu, run_dir=run, plan_file=plan, seq=seq, walkthrough=walkthrough)
    result = {"page": str(page), "files": sorted(p.name for p in Path(out).iterdir())}
    if check:
        from trainscale.report.browser import check_page

        result["check"] = check_page(page, Path(out) / "screenshot.png")
        if result["check"]["broken_images"] or result["check"]["console_errors"]:
            raise TrainscaleError(f"the page has broken images or console errors: {result['check']}")
    if as_json:
        emit_json(result)
    else:
        console.print(f"report written to [bold]{page}[/bold] ({len(result['files'])} files)")
        if check:
            console.print(f"checked in headless Chromium: {result['check']['images']} images load, no console errors")
