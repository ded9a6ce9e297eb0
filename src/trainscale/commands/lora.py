"""`trainscale lora`: train low-rank adapters on a frozen model; trainable params and Adam bytes vs the estimator."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from trainscale.commands._common import SEED, console, emit_json, number, output_path
from trainscale.errors import TrainscaleError


def register(app: typer.Typer) -> None:
    app.command()(lora)


def lora(
    checkpoint: str = typer.Argument(..., help="the frozen base: model folder, run folder (its final/, else its "
                                      "newest checkpoint), checkpoint RUN/checkpoints/step-N, or a Hugging Face "
                                      "model folder (config.json, safetensors, tokenizer.json)"),
    rank: int = typer.Option(8, "--rank", "-r", callback=number(gt=0, le=1 << 16), help="adapter rank r"),
    data: str = typer.Option(..., "--data", help="data to fine-tune on, read as train reads [data] files: text, "
                             "JSONL or Parquet (a file, folder or glob), or corpus:train / corpus:val"),
    text_field: str = typer.Option("text", "--text-field", help="JSONL field / Parquet column holding the text"),
    fmt: str = typer.Option("auto", "--format", help="text, chat (a JSONL file of conversations: 'messages', or "
                            "'prompt' and 'response'; rendered with the base folder's chat template, loss on the "
                            "assistant's tokens only, a conversation per row) or auto (chat when the file's first "
                            "record is one)"),
    alpha: float = typer.Option(None, callback=number(gt=0, le=1e6),
                                help="LoRA alpha; the update is scaled by alpha / r (default: 2 r)"),
    targets: str = typer.Option("all", help="adapted projections: all, attn, mlp, or names wq,wk,wv,wo,w1,w2,w3"),
    steps: int = typer.Option(100, callback=number(gt=0, le=1e7), help="optimizer steps"),
    batch: int = typer.Option(8, callback=number(gt=0, le=4096), help="sequences per step"),
    seq_len: int = typer.Option(128, callback=number(gt=0, le=1 << 20), help="tokens per sequence"),
    lr: float = typer.Option(2e-3, callback=number(gt=0, le=10), help="Adam learning rate"),
    held_out: float = typer.Option(0.1, "--held-out", callback=number(ge=0, lt=1),
                                   help="fraction of --data's documents held out to measure the adapters, by the "
                                        "trainer's rule (a hash of each document's position; 0: none)"),
    seed: int = typer.Option(0, callback=SEED, help="seed for the adapter init and the batches"),
    out: Path = typer.Option(None, "--out", "-o", callback=output_path(folder=True),
                             help="output folder (default: CHECKPOINT-lora-rR beside it; "
                                  "RUN/step-N-lora-rR for a checkpoint)"),
    merge: bool = typer.Option(False, "--merge", help="also fold the adapters into the weights: a plain model folder "
                               "(over a quantized base, into its dequantized weights)"),
    base_bits: int = typer.Option(None, "--base-bits", help="QLoRA: hold the frozen base's layer projections "
                                  "quantized, 4 or 8 bits (infer/quantize.py's groups), adapters in fp32 on top"),
    base_group_size: int = typer.Option(64, "--base-group-size", help="weights per fp16 scale of the quantized "
                                        "base: 32, 64 (QLoRA's block size) or 128"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Fine-tune LoRA adapters (Hu et al. 2021) on attention and MLP projections, base weights frozen."""
    from trainscale.infer.finetune import LoraSettings, fine_tune
    from trainscale.infer.quantize import GROUP_SIZES

    if base_bits is not None and base_bits not in (4, 8):
        raise TrainscaleError(f"--base-bits must be 4 or 8, not {base_bits}")
    if base_group_size not in GROUP_SIZES:
        raise TrainscaleError(f"--base-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, not "
                              f"{base_group_size}")
    settings = LoraSettings(rank=rank, alpha=alpha, targets=targets, data=data, text_field=text_field, format=fmt,
                            steps=steps, batch=batch, seq_len=seq_len, lr=lr, held_out=held_out, seed=seed, out=out,
                            merge=merge, base_bits=base_bits, base_group_size=base_group_size)
    report = fine_tune(checkpoint, settings, bar=_no_bar if as_json else _bar).report
    if as_json:
        emit_json(report)
        return
    _print(report, seq_len)


@contextmanager
def _bar(steps: int) -> Iterator[Callable[[int, float], None]]:
    """A transient progress bar over the LoRA steps, the last loss as its description."""
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("LoRA steps", total=steps)
        yield lambda s, loss: bar.update(task, completed=s, description=f"loss {loss:.3f}")


@contextmanager
def _no_bar(steps: int) -> Iterator[None]:
    yield None


def _print(report: dict[str, Any], seq_len: int) -> None:
    """The fine-tune for a person: what was trained where, a table of figures, the counts vs the estimator."""
    from trainscale.commands._infer import check_table, kv_table, print_tables

    r, held, b = report, report["held_out"], report.get("quantized_base")
    qlora = f" over an int{b['bits']} base (groups of {b['group_size']})" if b else ""
    console.print(f"[bold]LoRA r={r['rank']}, alpha={r['alpha']:g} on {', '.join(r['targets'])}[/bold]{qlora}: "
                  f"{r['base']} -> {r['out']}" + (" (merged)" if r["merged"] else ""))
    rows = {"loss": f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} in {r['steps']} steps ({r['seconds']:.1f} s)",
            "frozen parameters": f"{r['frozen_params']:,} (base model {r['base_params']:,})"}
    if b is not None:
        rows[f"base projections, int{b['bits']}"] = (f"{b['bytes']:,} B = {b['ratio_to_bf16']:.4f} of bf16 "
                                                     f"({b['bf16_bytes']:,} B), scales included")
        if b["held_out_perplexity_full_precision"] is not None:
            rows["held-out perplexity, full-precision base"] = f"{b['held_out_perplexity_full_precision']:.3f}"
    if (chat := r.get("chat")) is not None:
        longer = chat["longer_than_seq_len"]
        rows["chat data"] = (f"{chat['train_conversations']:,} training conversations, "
                             f"{chat['learned_train_tokens']:,} learned (assistant) tokens; loss on those only" +
                             (f"; {longer:,} conversations cut to --seq-len {seq_len}" if longer else ""))
    rows["held out"] = held["text"]
    if held["perplexity_before"] is not None:
        rows["held-out perplexity"] = f"{held['perplexity_before']:.3f} -> {held['perplexity_after']:.3f}"
    else:
        rows["held-out perplexity"] = "not measured: no document held out (--held-out, or more documents)"
    checks = [("trainable parameters", r["trainable_params"]["measured"], r["trainable_params"]["predicted"]),
              ("Adam m + v bytes", r["optimizer_bytes"]["measured"], r["optimizer_bytes"]["predicted"])]
    if b is not None:
        checks.append(("quantized base bytes", b["bytes"], b["predicted_bytes"]))
    print_tables(kv_table(rows), check_table("adapters vs the estimator (estimate/lora.py, estimate/inference.py)",
                                             checks))
