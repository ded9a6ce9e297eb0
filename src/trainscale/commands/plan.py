"""`trainscale plan`: the best layout (TP x CP x PP x DP, and EP for a mixture of experts) for a model on N GPUs,
or one layout evaluated."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import typer
from rich.table import Table

from trainscale import units as fmt
from trainscale.commands._common import catalog_or_file, console, emit_json, input_file, number, parse_count
from trainscale.errors import TrainscaleError


def register(app: typer.Typer) -> None:
    app.command()(plan)


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
                             help="number of GPUs (default: the layout's world size, else 16,384; with --days, "
                             "--budget-gpu-hours or --max-model: the most to consider, default the cluster's size)"),
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
    precision: str = typer.Option(None, help="bf16 | fp16 | fp8 (fp8: the layers' GEMMs at the GPU's FP8 peak; "
                                  "default: the software's); weights, gradients and Adam state as the software keeps "
                                  "them in that precision"),
    runnable: bool = typer.Option(False, "--runnable", help="search only the layouts trainscale's own runtime "
                                  "trains (rules.RUNNABLE; `train --plan` searches these)"),
    days: float = typer.Option(None, "--days", callback=number(gt=0, le=1e6),
                               help="how many GPUs train --tokens within this many days, and the best layout there"),
    budget_gpu_hours: str = typer.Option(None, "--budget-gpu-hours", help="what this many GPU-hours buy: with "
                                         "--tokens the fastest GPU count within them, else the most tokens "
                                         "(K/M/B are powers of 1000)"),
    max_model: bool = typer.Option(False, "--max-model", help="the largest catalog model of --model's family (e.g. "
                                   "llama3.1-8b/70b/405b) with a layout that fits the GPUs"),
    wide: bool = typer.Option(False, "--wide", help="every layout's figures and breakdowns as wide tables"),
    explain_step: bool = typer.Option(False, "--explain-step", help="the layout's step kernel by kernel: GEMMs, "
                                      "attention, element-wise, each collective (exposed and hidden), bubble, "
                                      "optimizer, per micro-batch and per step"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Find the fastest layout that fits (or evaluate one): memory, step time, MFU, days; or ask backwards."""
    from trainscale.estimate.planner import plan as planner

    gbt = parse_count(global_batch_tokens, "--global-batch-tokens", 1024)
    train = parse_count(tokens, "--tokens", 1000)
    budget = parse_count(budget_gpu_hours, "--budget-gpu-hours", 1000)
    if gbt is None or gbt != int(gbt):
        raise TrainscaleError(f"--global-batch-tokens must be a whole number of tokens, not {global_batch_tokens}")
    asked = [name for name, on in (("--days", days is not None), ("--budget-gpu-hours", budget is not None),
                                   ("--max-model", max_model)) if on]
    if len(asked) > 1 or (asked and layout is not None):
        raise TrainscaleError(f"ask one question at a time: {', '.join(asked + (['--layout'] if layout else []))}")
    if asked and explain_step:
        raise TrainscaleError(f"--explain-step explains the searched layout or the one --layout gives, not an answer "
                              f"to {asked[0]}; ask for that answer's layout with --layout")
    from trainscale.specs import Layout

    lay = Layout.parse(layout) if layout is not None else None
    n = gpus if gpus is not None else lay.world_size if lay is not None else 16384
    p = planner.problem(model=model, gpu=gpu, gpus=n, seq=seq, global_batch_tokens=int(gbt), tokens=train,
                        cluster=cluster, profile=profile, overrides=_settings(set_), software=software,
                        fix=fix, forbid=forbid, max_v=max_v, precision=precision, runnable=runnable)
    if asked:
        if gpus is None:  # the whole cluster is the most there is
            p = replace(p, n_gpus=p.cluster.gpus)
        _inverse(p, asked[0], days, budget, as_json, wide)
    elif lay is not None:
        _one_layout(p, lay, as_json, wide, explain_step)
    else:
        _search(p, top, as_json, wide, explain_step)


def _with_interval(p: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The row with its prediction intervals from the validation residuals of its software and GPU generation
    (estimate/planner/intervals.py)."""
    from trainscale.estimate.planner import intervals

    return intervals.annotate(row, p.software.name, p.gpu.generation)


def _explained(p: Any, cfg: Any, i: int, on: bool) -> dict[str, Any]:
    """{"explain_step": the layout's step kernel by kernel} when asked (estimate/planner/breakdown.py), else {}."""
    from trainscale.estimate.planner import breakdown

    return {"explain_step": breakdown.explain(p, cfg, i)} if on else {}


def _one_layout(p: Any, lay: Any, as_json: bool, wide: bool, explain_step: bool = False) -> None:
    from trainscale.estimate.planner.plan import _cfg

    row = _with_interval(p, p.evaluate_layout(lay))
    row["not_runnable_because"] = p.why_not_runnable(lay)
    sugg = [] if row["fits"] else p.suggestions(lay)
    ex = _explained(p, _cfg([lay]), 0, explain_step)
    if as_json:
        emit_json({**row, **_header(p), "suggestions": sugg, **{k: v.as_dict() for k, v in ex.items()}})
        return
    _print_header(p)
    if wide:
        _wide_rows([row], "Layout")
    else:
        _print_winner(row, "Layout")
        _print_details(row)
    if ex:
        _print_explained(ex["explain_step"])
    if row["not_runnable_because"]:
        _say(f"trainscale's runtime does not train it: {row['not_runnable_because']}.", "")
    if not row["fits"]:
        _say(f"{row['layout']} does not fit: it needs {fmt.gb(row['memory_per_gpu_bytes']['total'])} per GPU of "
             f"{fmt.gb(row['memory_capacity_bytes'])}.", "")
        if sugg:
            console.print("[bold]Nearby layouts that fit[/bold]")
            for k, r in enumerate(sugg, 1):
                _print_brief(k, r)
        else:
            console.print("No nearby layout fits; try more GPUs or rc=full.")


def _search(p: Any, top: int, as_json: bool, wide: bool, explain_step: bool = False) -> None:
    res = p.search()
    b = res.best()
    if b is None:
        raise TrainscaleError(res.nothing_fits())
    rows = [_with_interval(p, p.row(res.cfg, res.res, i)) for i in res.top(top)]
    runners = res.runners_up()
    why = res.why_best()
    search = {"candidates": res.generated, "valid": res.n_valid, "fit": res.n_fit, "seconds": res.seconds}
    ex = _explained(p, res.cfg, b, explain_step)
    if as_json:
        emit_json({**rows[0], **_header(p), "search": search, "why": why, "top": rows, "runners_up": runners,
                   **{k: v.as_dict() for k, v in ex.items()}})
        return
    _print_header(p)
    if wide:
        _wide_rows(rows, f"Best {len(rows)} of {res.n_fit:,} layouts that fit")
    else:
        _print_winner(rows[0], f"Best of {res.n_fit:,} layouts that fit")
        if len(rows) > 1:
            console.print("[bold]Next best[/bold] (step time against the winner's)")
            for k, r in enumerate(rows[1:], 2):
                _print_brief(k, r, rows[0])
        _print_details(rows[0])
    if ex:
        _print_explained(ex["explain_step"])
    console.print("[bold]Why this layout[/bold]")
    for line in why:
        _say(line, "  - ")
    _print_runners(runners)
    console.print(f"Searched {res.generated:,} candidates in {res.seconds:.2f} s.")


def _inverse(p: Any, question: str, days: float | None, budget: float | None, as_json: bool, wide: bool) -> None:
    """--days, --budget-gpu-hours or --max-model: the planner's search on other GPU counts or models."""
    from trainscale.estimate.planner import inverse

    if question == "--days":
        ans = inverse.gpus_for_days(p, float(days or 0))
    elif question == "--budget-gpu-hours":
        ans = inverse.budget(p, float(budget or 0))
    else:
        ans = inverse.max_model(p)
    if ans.point is not None and ans.point.row is not None:
        ans.point.row.update(_with_interval(p, ans.point.row))
    if as_json:
        emit_json({**_header(p), "inverse": ans.as_dict()})
        return
    _print_header(p)
    console.print(f"[bold]{ans.question[0].upper() + ans.question[1:]}[/bold]")
    _say(ans.sentence + ".", "  ")
    if ans.point is not None and ans.point.row is not None:
        _print_winner(ans.point.row, f"Best layout on {ans.point.gpus:,} GPUs"
                      + (f" ({ans.extra['model']})" if ans.extra.get("model") else ""))
        if wide:
            _wide_rows([ans.point.row], "The answer's layout")
        else:
            _print_details(ans.point.row)
    if question != "--max-model":
        _print_counts(ans, wide)


# ------------------------------------------------------------------ the output, readable at 80 columns


def _header(p: Any) -> dict[str, Any]:
    from trainscale.estimate.planner import plan as planner

    return {"inputs": p.inputs(), "topology": p.topo.as_dict(), "efficiencies": p.eff.as_dict(),
            "efficiency_sources": p.eff.sources, "software": p.software.as_dict(),
            "software_sources": p.software.sources, "flop_convention": planner.FLOP_CONVENTION}


def _say(text: str, indent: str, hang: str | None = None) -> None:
    """A sentence wrapped at word boundaries to the terminal, later lines indented under the first."""
    for line in fmt.wrap(text, console.width, indent, hang if hang is not None else " " * len(indent)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _lines(lines: list[str]) -> None:
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _print_header(p: Any) -> None:
    t = p.topo
    pods = f", pods of {t.pod_gpus:,} at 1:{t.oversubscription:g} above" if t.pod_gpus else ""
    _say(f"{p.model.name} on {p.n_gpus:,} x {p.gpu.name} ({t.name}: {t.scale_up_domain}-GPU "
         f"NVLink domains at {t.scale_up_bandwidth / 1e9:,.0f} GB/s, {t.network_bandwidth / 1e9:,.0f} GB/s "
         f"per GPU between them{pods}); seq {p.seq:,}, {p.global_batch_tokens:,} tokens "
         f"({p.global_seqs:,} sequences) per step; software {p.software.name}"
         + (f", {p.software.precision.upper()} GEMMs" if p.software.precision != "bf16" else "")
         + ("; only layouts trainscale's runtime trains (--runnable)" if p.runnable else ""), "")


def _interval(row: dict[str, Any], key: str, unit: str) -> str:
    """The place for a prediction interval: a row that carries ``key`` = (low, high) prints it beside the
    value (another change adds intervals to the planner's rows); none today prints nothing."""
    iv = row.get(key)
    if not iv:
        return ""
    lo, hi = iv
    return f" ({lo:,.2f}-{hi:,.2f})" if unit == "s" else f" ({lo:,.1f}-{hi:,.1f})"


def winner_fields(row: dict[str, Any]) -> list[str]:
    """The winner's figures, each with its unit: memory and fit, step time, MFU, throughput, days, GPU-hours."""
    mem, cap = row["memory_per_gpu_bytes"]["total"], row["memory_capacity_bytes"]
    out = [f"{fmt.gb(mem)} of {fmt.gb(cap)} per GPU, {'fits' if row['fits'] else 'DOES NOT FIT'}",
           f"step {row['step_time_s']:,.2f} s{_interval(row, 'step_time_interval_s', 's')}",
           f"MFU {row['mfu']:.1%}", f"{fmt.count(row['tflops_per_gpu'])} TFLOP/s/GPU",
           f"{fmt.count(row['tokens_per_s'])} tokens/s"]
    if row["days"] is None:
        return [*out, "days and GPU-hours: give --tokens"]
    return [*out, fmt.days(row["days"]) + _interval(row, "days_interval", "days"),
            f"{fmt.count(row['gpu_hours'])} GPU-hours"]


def _print_winner(row: dict[str, Any], title: str) -> None:
    console.print(f"[bold]{title}[/bold]")
    console.print(f"1 [bold]{row['layout']}[/bold]", highlight=False, soft_wrap=True)
    _lines(fmt.pack(winner_fields(row), console.width))


def _print_brief(k: int, r: dict[str, Any], best: dict[str, Any] | None = None) -> None:
    """Another layout in two lines: its name, then memory, step time (and how much slower), MFU, days."""
    console.print(f"{k} {r['layout']}", markup=False, highlight=False, soft_wrap=True)
    step = f"step {r['step_time_s']:,.2f} s"
    if best is not None:
        step += f" ({r['step_time_s'] / best['step_time_s'] - 1:+.1%})"
    fields = [f"{fmt.gb(r['memory_per_gpu_bytes']['total'])}/GPU", step, f"MFU {r['mfu']:.1%}"]
    if r["days"] is not None:
        fields.append(fmt.days(r["days"]))
    _lines(fmt.pack(fields, console.width))


def _print_details(row: dict[str, Any]) -> None:
    """The winner's step time and memory, one item a line (--wide: every layout's, as tables)."""
    parts = row["step_time_parts_s"]
    if row.get("interval_basis"):
        _say(f"Interval: the published runs' leave-one-out errors ({row['interval_basis']}).", "")
    console.print(f"[bold]Step time[/bold], {row['step_time_s']:,.2f} s per step:")
    w = max(len(n) for n in parts) + 2
    for name, v in parts.items():
        extra = f" ({row['bubble_fraction']:.1%} bubble)" if name == "pipeline_bubble" and v else ""
        _lines([f"  {name.replace('_', ' '):<{w}}{v:>8,.2f} s{extra}"])
    mem = row["memory_per_gpu_bytes"]
    console.print(f"[bold]Memory per GPU[/bold] (decimal GB), heaviest pipeline stage "
                  f"{row.get('heaviest_stage', 0)}:", highlight=False)
    items = [(k, v) for k, v in mem.items() if k != "total"] + [("total", mem["total"]),
                                                               ("headroom", row["headroom_bytes"])]
    for name, v in items:
        _lines([f"  {name:<{w}}{v / 1e9:>8,.2f} GB"])


EXPLAIN_NAME = 28  # width of an item's name in --explain-step's table (80 columns in all)


def _explain_line(name: str, per_micro: str, step: str, exposed: str, hidden: str, gb: str, gbs: str) -> str:
    return f"  {name:<{EXPLAIN_NAME}}{per_micro:>8} {step:>7} {exposed:>7} {hidden:>7} {gb:>7} {gbs:>6}".rstrip()


def explain_lines(bd: Any) -> list[str]:
    """--explain-step's table, 80 columns: each item with time per micro-batch (ms, on the critical stage) and per
    step (s), what of it is exposed and hidden, and a collective's bytes per step and bytes over time."""
    out = [_explain_line("", "ms/mb", "step s", "exposed", "hidden", "GB", "GB/s")]
    for it in bd.items:
        if not it.time_s and not it.exposed_s:
            continue
        coll = it.kind == "collective"
        gb = it.bytes
        out.append(_explain_line(
            it.name[:EXPLAIN_NAME], "-" if it.per_micro_s is None else f"{it.per_micro_s * 1e3:,.1f}",
            f"{it.time_s:,.3f}", f"{it.exposed_s:,.3f}", f"{it.hidden_s:,.3f}" if coll else "-",
            f"{gb / 1e9:,.1f}" if gb else "-", f"{gb / it.time_s / 1e9:,.0f}" if gb and it.time_s > 0 else "-"))
    out.append(_explain_line("total", "", "", f"{bd.total_s:,.3f}", f"{bd.hidden_s:,.3f}", "", ""))
    return out


def _print_explained(bd: Any) -> None:
    head = f"{bd.stage_layers} layers" + (f" ({bd.stage_dense} dense, {bd.stage_moe} MoE)" if bd.stage_moe else "") \
        + (" and the output head" if bd.head_on_stage else "")
    console.print("[bold]Step, kernel by kernel[/bold], one GPU of the critical stage:")
    _lines(explain_lines(bd))
    _say(f"ms/mb: one micro-batch through the critical stage ({head}); step: x {bd.micro_batches:,} micro-batches, or "
         f"once a step. Exposed times add up to the step time, {bd.step_time_s:,.3f} s; exposed + hidden is a "
         "collective's whole time. GB: bytes this GPU puts into it per step; GB/s: those bytes over its time "
         "(NCCL-tests' algbw, latency included).", "")


def _print_runners(runners: list[dict[str, Any]]) -> None:
    if not runners:
        return
    console.print("[bold]Why the runners-up lose[/bold]")
    for r in runners:
        console.print(f"  {r['layout']} [dim]({r['differs_in']})[/dim]", highlight=False, soft_wrap=True)
        _say(r["reason"], "    ")


def _print_counts(ans: Any, wide: bool) -> None:
    """The GPU counts the inverse search tried, smallest first: days and GPU-hours (with --tokens)."""
    pts = sorted(ans.searched, key=lambda q: q.gpus)
    t = Table(title="GPU counts searched", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("GPUs", "tokens/s", "days", "GPU-hours"):
        t.add_column(col, justify="right", no_wrap=True)
    if wide:
        t.add_column("layout", no_wrap=True)
    tok = ans.tokens
    for q in pts:
        cells = [f"{q.gpus:,}", fmt.count(q.tokens_per_s) if q.fits else "no fit",
                 fmt.days(q.days(tok)) if q.fits and tok else "-",
                 fmt.count(q.gpu_hours(tok)) if q.fits and tok else "-"]
        t.add_row(*cells, *([q.layout or "-"] if wide else []))
    console.print(t)


def _wide_rows(rows: list[dict[str, Any]], title: str) -> None:
    """--wide: every figure of every layout as full tables, as wide as they need (not cut to the terminal)."""
    from rich.console import Console

    out = Console(width=max(console.width, 400), highlight=False)
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    cells = {
        "#": lambda k, r: str(k), "layout": lambda k, r: r["layout"],
        "memory/GPU": lambda k, r: fmt.gb(r["memory_per_gpu_bytes"]["total"]),
        "fits": lambda k, r: "yes" if r["fits"] else "no", "step": lambda k, r: f"{r['step_time_s']:.2f} s",
        "MFU": lambda k, r: f"{r['mfu']:.1%}", "HFU": lambda k, r: f"{r['hfu']:.1%}",
        "model TFLOP/s/GPU": lambda k, r: fmt.count(r["tflops_per_gpu"]),
        "tokens/s": lambda k, r: fmt.count(r["tokens_per_s"]),
        "days": lambda k, r: "-" if r["days"] is None else fmt.days(r["days"]),
        "GPU-hours": lambda k, r: "-" if r["gpu_hours"] is None else fmt.count(r["gpu_hours"]),
    }
    for col in cells:
        t.add_column(col, no_wrap=True, justify="left" if col == "layout" else "right")
    for k, r in enumerate(rows, 1):
        t.add_row(*(cells[c](k, r) for c in cells))
    out.print(t)
    parts = list(rows[0]["step_time_parts_s"])
    st = Table(title="Step time (s per step)", title_justify="left", show_edge=False, pad_edge=False)
    for name in ["#", *(n.replace("_", " ") for n in parts), "bubble"]:
        st.add_column(name, justify="right", no_wrap=True)
    for k, r in enumerate(rows, 1):
        st.add_row(str(k), *(f"{r['step_time_parts_s'][n]:.2f}" for n in parts), f"{r['bubble_fraction']:.1%}")
    out.print(st)
    mem = [k for k in rows[0]["memory_per_gpu_bytes"] if k != "total"]
    mt = Table(title="Memory per GPU (GB, decimal), heaviest pipeline stage", title_justify="left",
               show_edge=False, pad_edge=False)
    for name in ["#", "stage", *mem, "headroom"]:
        mt.add_column(name, justify="right", no_wrap=True)
    for k, r in enumerate(rows, 1):
        mt.add_row(str(k), str(r.get("heaviest_stage", 0)),
                   *(f"{r['memory_per_gpu_bytes'][n] / 1e9:,.2f}" for n in mem), f"{r['headroom_bytes'] / 1e9:,.2f}")
    out.print(mt)
