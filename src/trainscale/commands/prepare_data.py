"""`trainscale prepare-data`: tokenise a config's corpus once into memory-mapped token shards
(runtime/data/shards.py), in several processes, with a progress bar; training then reads the shards."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from trainscale.commands._common import console, emit_json
from trainscale.errors import TrainscaleError


def register(app: typer.Typer) -> None:
    app.command("prepare-data")(prepare_data)


def prepare_data(
    config: Path = typer.Option(..., "--config", help="training config TOML whose data.files names the corpus"),
    workers: int = typer.Option(None, help="tokenising processes (default: the config's data.workers, 0: one "
                                "per CPU)"),
    as_json: bool = typer.Option(False, "--json", help="no progress bar; print the shard index as JSON"),
) -> None:
    """Tokenise the config's data files (text, JSONL, Parquet; Megatron .bin/.idx and .npy tokens copied) into
    token shards, train/held-out split; many small files share a shard, a large one spans several.

    Resumable (finished shards are kept if interrupted); a no-op when the inputs, tokenizer and settings have not changed."""  # noqa: E501
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from trainscale.runtime.data.corpus import corpus_for
    from trainscale.runtime.init import resolved_config

    if workers is not None and workers < 0:
        raise TrainscaleError(f"--workers must be >= 0, not {workers}")
    cfg = resolved_config(config, {"data": {"workers": workers}} if workers is not None else None)
    if cfg.data.request() is None:
        raise TrainscaleError(f"config {config} names no corpus: add [data] files = [\"...\"] (text, JSONL, "
                              "Parquet, .bin/.idx or .npy) or [[data.sources]]; the default Shakespeare plays need "
                              "no preparing")
    t0 = time.perf_counter()
    said: list[str] = []
    if as_json:
        corpus = corpus_for(cfg, log=said.append)
    else:
        with Progress(TextColumn("{task.description:<24}"), BarColumn(), DownloadColumn(),
                      TimeRemainingColumn(), console=console, transient=False) as bar:
            tasks: dict[str, int] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=max(total, 1))
                bar.update(tasks[stage], completed=done, total=max(total, 1))

            def log(msg: str) -> None:
                said.append(msg)
                console.print(msg)

            corpus = corpus_for(cfg, progress=progress, log=log)
    seconds = time.perf_counter() - t0
    index = corpus.index
    noop = any("already prepared" in m for m in said)
    if as_json:
        emit_json({"folder": str(corpus.folder), "seconds": seconds, "already_prepared": noop, **index})
        return
    from rich.table import Table

    t = Table(title="prepared corpus")
    for col in ("split", "documents", "tokens", "shards"):
        t.add_column(col, justify="left" if col == "split" else "right")
    for split in ("train", "val"):
        s = index["splits"][split]
        t.add_row("held-out" if split == "val" else split, f"{s['documents']:,}", f"{s['tokens']:,}",
                  str(len(s["shards"])))
    console.print(t)
    tokens = sum(index["splits"][s]["tokens"] for s in ("train", "val"))
    console.print(f"folder: {corpus.folder} ({len(index['sources']):,} input files)")
    components = index.get("components") or []
    if len(components) > 1:
        total = sum(c.weight for c in cfg.data.sources)
        shares = [f"{c.name or f'source {i + 1}'} {c.weight / total:.0%}" for i, c in enumerate(cfg.data.sources)]
        console.print(f"mixture: {', '.join(shares)} of the training sequences")
    console.print(f"tokenizer: {index['vocab_size']:,} tokens, end-of-text {index['eot']!r} (id {index['eot_id']}); "
                  f"{index['dtype']} shards; content hash {index['hash'][:12]}")
    if not noop:
        console.print(f"{seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s")
