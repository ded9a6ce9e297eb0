"""`trainscale plan`: the best layout (TP x CP x PP x DP, and EP for a mixture of experts) for a model on N GPUs,
or one layout evaluated."""

from __future__ import annotations

import re
from typing import Any

import typer
from rich.table import Table

from trainscale.commands._common import catalog_or_file, console, emit_json, input_file, number, parse_layout
from trainscale.errors import TrainscaleError

_SUFFIX = {"k": 1, "m": 2, "g": 3, "b": 3, "t": 4}


def register(app: typer.Typer) -> None:
    app.command()(plan)


def parse_count(text: str | None, what: str, base: int) -> float | None:
    """'16M' -> 16 x base^2, '15.6T' -> 15.6 x base^4, plain numbers as they are."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgbt]?)\s*", text.lower())
    if not m:
        raise TrainscaleError(f"{what} '{text}' is not a number (suffixes K, M, G/B, T are allowed)")
    value = float(m.group(1)) * base ** _SUFFIX.get(m.group(2), 0)
    if not 0 < value <= 1e18:  # also refuses 1e400 (inf) and 0
        raise TrainscaleError(f"{what} must be a positive number of at most 1e18, not '{text}'")
    return value


def _settings(pairs: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs or []:
        key, sep, val = pair.partition("=")
        if not sep:
            raise TrainscaleError(f"--set takes key=value, not '{pair}'")
        try:
            out[key.strip()] = float(val)
        except ValueError:
            raise TrainscaleError(f"--set {key.strip()} needs a number, not '{val}'") from None
    return out


def plan(
    model: str = typer.Option("llama3.1-405b", callback=catalog_or_file("model"),
                              help="catalog name, TOML file or HF config.json"),
    gpu: str = typer.Option(None, callback=catalog_or_file("GPU"), help="GPU (default: the cluster's, else h100-sxm)"),
    gpus: int = typer.Option(None, callback=number(gt=0, le=1e8),
                             help="number of GPUs (default: the layout's world size, else 16,384)"),
    seq: int = typer.Option(8192, callback=number(gt=0, le=1 << 24), help="sequence length, tokens"),
    global_batch_tokens: str = typer.Option(
        "16M", help="tokens per optimizer step; K/M/G are powers of 1024 (Llama 3's '16M' is 2^24)"),
    tokens: str = typer.Option(None, help="training tokens for days and GPU-hours; K/M/B/T are powers of 1000"),
    cluster: str = typer.Option(None, callback=catalog_or_file("cluster"),
                                help="cluster topology (default: a catalog cluster of this GPU)"),
    layout: str = typer.Option(None, help="evaluate this layout instead of searching, e.g. "
                               "tp8,cp1,pp16,dp128,mb1,v8,zero2,rc=selective"),
    top: int = typer.Option(5, callback=number(gt=0, le=10_000), help="layouts to show"),
    profile: str = typer.Option(None, callback=input_file("profile"),
                                help="TOML/JSON of measured efficiencies replacing the catalog defaults"),
    set_: list[str] = typer.Option(None, "--set", help="override one planner setting, key=value (repeatable)"),
    software: str = typer.Option("trainscale", help="software preset (catalog/software.toml) or a TOML file: "
                                 "kernels, grad dtypes, overlaps and what the search may use"),
    fix: str = typer.Option(None, help="search only layouts with these choices, e.g. tp=8,pp=16"),
    forbid: str = typer.Option(None, help="search without these, e.g. cp,zero3,interleaved,rc=full"),
    max_v: int = typer.Option(None, "--max-v", help="at most this many virtual stages per GPU"),
    precision: str = typer.Option(None, help="bf16 | fp8: the layers' GEMMs at the GPU's FP8 peak (default: the "
                                  "software's); weights, gradients and Adam state as the software keeps them"),
    runnable: bool = typer.Option(False, "--runnable", help="search only the layouts trainscale's own runtime "
                                  "trains (rules.RUNNABLE; `train --plan` searches these)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Find the fastest layout that fits (or evaluate one): memory, step time, MFU, days."""
    from trainscale.estimate.planner import plan as planner

    gbt = parse_count(global_batch_tokens, "--global-batch-tokens", 1024)
    train = parse_count(tokens, "--tokens", 1000)
    if gbt is None or gbt != int(gbt):
        raise TrainscaleError(f"--global-batch-tokens must be a whole number of tokens, not {global_batch_tokens}")
    if top <= 0:
        raise TrainscaleError(f"--top must be positive, not {top}")
    lay = parse_layout(layout) if layout is not None else None
    if gpus is None:
        gpus = lay.world_size if lay is not None else 16384
    p = planner.problem(model, gpu, gpus, seq, int(gbt), train, cluster, profile, _settings(set_), software,
                        fix, forbid, max_v, precision, runnable)
    head = _header(p)
    if lay is not None:
        row = p.evaluate_layout(lay)
        row["not_runnable_because"] = p.why_not_runnable(lay)
        sugg = [] if row["fits"] else p.suggestions(lay)
        if as_json:
            emit_json({**row, **head, "suggestions": sugg})
            return
        _print_header(p)
        _print_rows([row], "Layout")
        if row["not_runnable_because"]:
            console.print(f"trainscale's runtime does not train it: {row['not_runnable_because']}.")
        if not row["fits"]:
            console.print(f"[bold red]{row['layout']} does not fit[/bold red]: it needs "
                          f"{_gb(row['memory_per_gpu_bytes']['total'])} per GPU of "
                          f"{_gb(row['memory_capacity_bytes'])}.")
            if sugg:
                _print_rows(sugg, "Nearby layouts that fit", breakdown=False)
            else:
                console.print("No nearby layout fits; try more GPUs or rc=full.")
        return
    res = p.search()
    b = res.best()
    if b is None:
        raise TrainscaleError(res.nothing_fits())
    rows = [p.row(res.cfg, res.res, i) for i in res.top(top)]
    runners = res.runners_up()
    why = res.why_best()
    search = {"candidates": res.generated, "valid": res.n_valid, "fit": res.n_fit, "seconds": res.seconds}
    if as_json:
        emit_json({**rows[0], **head, "search": search, "why": why, "top": rows, "runners_up": runners})
        return
    _print_header(p)
    _print_rows(rows, f"Best {len(rows)} of {res.n_fit:,} layouts that fit")
    console.print("[bold]Why this layout[/bold]")
    for line in why:
        console.print(f"  - {line}")
    if runners:
        t = Table(title="Why the runners-up lose", title_justify="left", show_edge=False, pad_edge=False)
        t.add_column("layout", no_wrap=True, min_width=max(len(r["layout"]) for r in runners))
        t.add_column("differs in")
        t.add_column("reason")
        for r in runners:
            t.add_row(r["layout"], r["differs_in"], r["reason"])
        console.print(t)
    console.print(f"Searched {res.generated:,} candidates in {res.seconds:.2f} s.")


def _header(p: Any) -> dict[str, Any]:
    from trainscale.estimate.planner import plan as planner

    return {"inputs": p.inputs(), "topology": p.topo.as_dict(), "efficiencies": p.eff.as_dict(),
            "efficiency_sources": p.eff.sources, "software": p.software.as_dict(),
            "software_sources": p.software.sources, "flop_convention": planner.FLOP_CONVENTION}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def _print_header(p: Any) -> None:
    t = p.topo
    pods = f", pods of {t.pod_gpus:,} at 1:{t.oversubscription:g} above" if t.pod_gpus else ""
    console.print(f"[bold]{p.model.name}[/bold] on {p.n_gpus:,} x {p.gpu.name} ({t.name}: {t.scale_up_domain}-GPU "
                  f"NVLink domains at {t.scale_up_bandwidth / 1e9:,.0f} GB/s, {t.network_bandwidth / 1e9:,.0f} GB/s "
                  f"per GPU between them{pods}); seq {p.seq:,}, {p.global_batch_tokens:,} tokens "
                  f"({p.global_seqs:,} sequences) per step; software {p.software.name}"
                  + (f", {p.software.precision.upper()} GEMMs" if p.software.precision != "bf16" else "")
                  + ("; only layouts trainscale's runtime trains (--runnable)" if p.runnable else ""))


def _print_rows(rows: list[dict[str, Any]], title: str, breakdown: bool = True) -> None:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    width = max(len(r["layout"]) for r in rows)
    cells = {
        "#": lambda k, r: str(k), "layout": lambda k, r: r["layout"],
        "memory/GPU": lambda k, r: _gb(r["memory_per_gpu_bytes"]["total"]),
        "fits": lambda k, r: "yes" if r["fits"] else "no", "step": lambda k, r: f"{r['step_time_s']:.2f} s",
        "MFU": lambda k, r: f"{r['mfu']:.1%}", "HFU": lambda k, r: f"{r['hfu']:.1%}",
        "model TFLOP/s/GPU": lambda k, r: f"{r['tflops_per_gpu']:.0f}",
        "tokens/s": lambda k, r: f"{r['tokens_per_s']:,.0f}",
        "days": lambda k, r: "-" if r["days"] is None else f"{r['days']:,.1f}",
        "GPU-hours": lambda k, r: "-" if r["gpu_hours"] is None else f"{r['gpu_hours'] / 1e6:,.2f}M",
    }
    cols = list(cells)

    def need(cs: list[str]) -> int:
        return sum(max(len(c), *(len(cells[c](k, r)) for k, r in enumerate(rows, 1))) + 3 for c in cs)

    # a narrow terminal drops detail columns (all are in --json), never the layout
    for drop in ("GPU-hours", "HFU", "tokens/s", "fits", "days", "model TFLOP/s/GPU"):
        if need(cols) <= console.width:
            break
        cols.remove(drop)
    for col in cols:
        if col == "layout":  # the answer is never truncated
            t.add_column(col, no_wrap=True, min_width=width)
        else:
            t.add_column(col, justify="right", no_wrap=True)
    for k, r in enumerate(rows, 1):
        t.add_row(*(cells[c](k, r) for c in cols))
    console.print(t)
    if not breakdown:
        return
    parts = list(rows[0]["step_time_parts_s"])
    st = Table(title="Step time (s per step)", title_justify="left", show_edge=False, pad_edge=False)
    st.add_column("#")
    for name in parts:
        st.add_column(name.replace("_", " "), justify="right")
    st.add_column("bubble", justify="right")
    for k, r in enumerate(rows, 1):
        st.add_row(str(k), *(f"{r['step_time_parts_s'][n]:.2f}" for n in parts), f"{r['bubble_fraction']:.1%}")
    console.print(st)
    mem = [k for k in rows[0]["memory_per_gpu_bytes"] if k != "total"]
    mt = Table(title="Memory per GPU (GB, decimal), heaviest pipeline stage", title_justify="left",
               show_edge=False, pad_edge=False)
    mt.add_column("#")
    mt.add_column("stage", justify="right")
    for name in mem:
        mt.add_column(name, justify="right")
    mt.add_column("headroom", justify="right")
    for k, r in enumerate(rows, 1):
        mt.add_row(str(k), str(r.get("heaviest_stage", 0)),
                   *(f"{r['memory_per_gpu_bytes'][n] / 1e9:,.2f}" for n in mem),
                   f"{r['headroom_bytes'] / 1e9:,.2f}")
    console.print(mt)
