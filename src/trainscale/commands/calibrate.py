"""`trainscale calibrate`: measure this machine at a model's shapes and write a hardware profile (TOML)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from trainscale.commands._common import catalog_or_file, console, emit_json, input_file, number, output_path
from trainscale.errors import TrainscaleError

DEFAULT_CONFIG = Path("configs/small.toml")
MODEL_SEQ_LEN = 2048  # --model without --seq-len: this, or the model's max_seq_len if shorter


def register(app: typer.Typer) -> None:
    app.command(name="calibrate")(calibrate_command)


def parse_processes(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4] (sorted, without repeats); anything else is a TrainscaleError."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise TrainscaleError("--processes needs at least one process count, e.g. 1,2,4")
    out = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise TrainscaleError(f"--processes takes comma-separated positive integers (e.g. 1,2,4), not {text!r}") \
                from None
        if n < 1:
            raise TrainscaleError(f"--processes counts must be at least 1, not {n}")
        out.append(n)
    return sorted(set(out))


def _workload(config: str | None, model: str | None, seq_len: int | None, micro_batch: int | None):
    """(ModelSpec, seq_len, micro_batch) from --config or --model (default: configs/small.toml)."""
    from trainscale.runtime.init import resolved_config
    from trainscale.specs import load_model

    if config and model:
        raise TrainscaleError("give --config or --model, not both")
    if model:
        spec = load_model(model)
        seq, mb = min(spec.max_seq_len, MODEL_SEQ_LEN), 1
    else:
        if config is None:
            if not DEFAULT_CONFIG.exists():
                raise TrainscaleError(f"no --config or --model given and there is no {DEFAULT_CONFIG} here; "
                                      "pass --config CONFIG.toml or --model NAME")
            config = str(DEFAULT_CONFIG)
        cfg = resolved_config(config)
        spec, seq, mb = cfg.model, cfg.train.seq_len, cfg.train.global_batch
    seq = seq_len if seq_len is not None else seq
    mb = micro_batch if micro_batch is not None else mb
    if seq > spec.max_seq_len:
        raise TrainscaleError(f"--seq-len {seq} exceeds the model's max_seq_len {spec.max_seq_len}")
    return spec, seq, mb


def calibrate_command(
    config: str = typer.Option(None, "--config", callback=input_file("config"),
                               help="training config TOML whose model and shapes to use "
                               "(default: configs/small.toml)"),
    model: str = typer.Option(None, callback=catalog_or_file("model"),
                              help="catalog model name, TOML file or HF config.json (instead of --config)"),
    seq_len: int = typer.Option(None, "--seq-len", callback=number(gt=0, le=1 << 20),
                                help="sequence length (default: the config's, or 2048 with --model)"),
    micro_batch: int = typer.Option(None, "--micro-batch", callback=number(gt=0, le=1 << 16),
                                    help="sequences per micro-batch "
                                    "(default: the config's global_batch, or 1 with --model)"),
    processes: str = typer.Option("1,2,4", help="process counts to measure with, comma-separated"),
    out: Path = typer.Option(None, callback=output_path(folder=False),
                             help="where to write the profile (default: the cache's profile.toml)"),
    quick: bool = typer.Option(False, "--quick", help="short timings and small buffers (a rough profile in seconds)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Measure this machine (matmul, attention, memory, AdamW, collectives) and write a hardware profile."""
    counts = parse_processes(processes)
    spec, seq, mb = _workload(config, model, seq_len, micro_batch)

    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trainscale.estimate.profile import write_profile
    from trainscale.runtime.probe import calibrate as cal

    path = Path(out) if out is not None else cal.default_profile_path()
    from trainscale.safeio import check_output

    check_output(path, "--out", folder=False)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        task = bar.add_task(f"calibrating {spec.name}", total=cal.calibration_steps(counts))
        profile = cal.calibrate(spec, seq, mb, counts, quick=quick,
                                progress=lambda msg: bar.update(task, advance=1, description=msg))
    write_profile(profile, path)
    seconds = time.perf_counter() - t0
    if as_json:
        emit_json({"path": str(path), "seconds": seconds, "profile": profile})
        return
    _print(profile, path, seconds, seq, mb)


def _print(profile: dict, path: Path, seconds: float, seq: int, mb: int) -> None:
    """The profile for a person: the machine, per-process figures, collectives, tensor parallelism."""
    m = profile["machine"]
    console.print(f"[bold]Hardware profile[/bold] of {m['host']} ({m['device_name']}, {m['cores']} cores, "
                  f"torch {m['torch']}, {m['dtype']}, 1 thread per process) at {m['model']}'s shapes, "
                  f"{m['tokens']:,} tokens ({mb} x {seq})")
    t = Table(title="per process, n at once (median)", title_justify="left",
              show_edge=False, pad_edge=False)
    t.add_column("figure")
    for n in profile["processes"]:
        t.add_column(f"n = {n}", justify="right")
    rows = [("one decoder layer fwd+bwd ms", "layer_seconds", 1e3, ".2f"),
            ("  of it per call, any size ms", "layer_fixed_seconds", 1e3, ".2f"),
            ("layer GEMMs GFLOP/s (fwd+bwd)", "matmul_flops", 1e-9, ".1f"),
            ("lm-head GEMMs GFLOP/s", "head_matmul_flops", 1e-9, ".1f"),
            ("causal attention GFLOP/s", "attention_flops", 1e-9, ".2f"),
            ("between the matmuls ns/token", "elementwise_seconds_per_token", 1e9, ".1f"),
            ("memory copy GB/s", "memory_bandwidth", 1e-9, ".1f"),
            ("AdamW ns/param", "optimizer_seconds_per_param", 1e9, ".2f"),
            ("AdamW bytes/param (x memory GB/s)", "optimizer_bytes_per_param", 1.0, ".0f")]
    for label, key, scale, fmt in rows:
        t.add_row(label, *(format(f[key] * scale, fmt) for f in profile["processes"].values()))
    console.print(t)
    if profile["collectives"]:
        c = Table(title="collectives (NCCL-tests bus bandwidth)", title_justify="left", show_edge=False,
                  pad_edge=False)
        for col in ("processes", "op", "latency µs", "bus GB/s"):
            c.add_column(col, justify="right" if col != "op" else "left")
        for n, ops in profile["collectives"].items():
            for op, f in ops.items():
                c.add_row(n, op, f"{f['latency_s'] * 1e6:.0f}", f"{f['bus_bandwidth'] / 1e9:.2f}")
        console.print(c)
    if profile.get("tensor_parallel"):
        tp = Table(title="one layer under DTensor tensor parallelism (tp = n, sequence parallel)", title_justify="left",
                   show_edge=False, pad_edge=False)
        for col in ("tp", "measured ms", "composed ms", "DTensor overhead ns/token"):
            tp.add_column(col, justify="right")
        for n, f in profile["tensor_parallel"].items():
            tp.add_row(n, f"{f['layer_seconds'] * 1e3:.1f}", f"{f['composed_seconds'] * 1e3:.1f}",
                       f"{f['overhead_seconds_per_token'] * 1e9:,.0f}")
        console.print(tp)
    console.print(f"wrote {path} in {seconds:.0f} s")
