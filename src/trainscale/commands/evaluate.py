"""`trainscale evaluate`: loss and perplexity of any model on a text, and exactly which text (file, split, tokens)."""

from __future__ import annotations

import math
import time

import typer

from trainscale.commands._common import console, emit_json, number


def register(app: typer.Typer) -> None:
    app.command()(evaluate)


def evaluate(
    checkpoint: str = typer.Argument(..., metavar="MODEL", help="model folder, run folder (its final/, else its newest "
                                      "checkpoint), checkpoint RUN/checkpoints/step-N, quantized or LoRA folder, or "
                                      "a Hugging Face model folder"),
    data: str = typer.Option(None, "--data", help="text to evaluate on, read as train reads [data] files: text, "
                             "JSONL or Parquet (a file, folder or glob), or corpus:train / corpus:val (default: the "
                             "model's own held-out data: a LoRA folder's held-out documents, a run's held-out split)"),
    text_field: str = typer.Option("text", "--text-field", help="JSONL field / Parquet column holding the text"),
    fmt: str = typer.Option("auto", "--format", help="text, chat (a JSONL file of conversations: 'messages', or "
                            "'prompt' and 'response'; scored on the assistant's tokens only, rendered with the "
                            "model folder's chat template) or auto (chat when the file's first record is one)"),
    split: str = typer.Option(None, "--split", help="all or held-out: all of --data's documents (the default), or "
                              "those the trainer's hash rule holds out (runtime/data/sources.py)"),
    max_tokens: int = typer.Option(32768, "--max-tokens", callback=number(ge=2, le=1e9),
                                   help="evaluate on at most this many tokens (the first of the text)"),
    seq_len: int = typer.Option(None, "--seq-len", callback=number(gt=0, le=1 << 20),
                                help="tokens per window (default: the model's max_seq_len)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Mean next-token loss and perplexity of a model on a text, in non-overlapping windows; says which text."""
    from trainscale.commands._infer import kv_table, print_tables
    from trainscale.infer.evaluate import evaluation_text, score
    from trainscale.infer.load import folder_kind, load_for_inference, load_tokenizer_for, source_folder, spec_of
    from trainscale.runtime.artifact import checkpoint_source

    folder = source_folder(checkpoint)
    spec = spec_of(folder)
    tok = load_tokenizer_for(folder)
    text = evaluation_text(folder, tok, data, text_field, split, max_tokens, spec.vocab_size, fmt=fmt)
    model, spec, folder = load_for_inference(folder)
    window = min(seq_len or spec.max_seq_len, spec.max_seq_len)
    t0 = time.perf_counter()
    total, count = score(model, text, window)
    secs = time.perf_counter() - t0
    loss = total / count
    report = {"model": str(folder), "model_kind": folder_kind(folder), **text.report(), "seq_len": window,
              "scored_tokens": count, "loss": loss, "perplexity": math.exp(loss), "seconds": secs,
              "loss_units": "nats per token (mean next-token cross-entropy); perplexity = exp(loss)"}
    if (origin := checkpoint_source(folder)) is not None:
        report["from_checkpoint"] = origin
    if as_json:
        emit_json(report)
        return
    console.print(f"[bold]{spec.name or 'model'}[/bold] ({report['model_kind']} folder {folder})")
    scored = f"{count:,} learned (assistant) tokens, a conversation per row of at most {window + 1} tokens" \
        if text.conversations is not None else \
        f"{count:,} (windows of {window} tokens; each window's first token is context only)"
    print_tables(kv_table({
        "text": text.what,
        "tokens scored": scored,
        "loss": f"{loss:.4f} nats/token",
        "perplexity": f"{math.exp(loss):.3f}",
    }))
