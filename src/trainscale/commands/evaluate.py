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
    tasks: str = typer.Option(None, "--tasks", help="a JSONL file of multiple-choice examples, one a line: "
                              "'context' (a string), 'choices' (a list of strings), 'gold' (the right one's index); "
                              "prints accuracy and length-normalised accuracy, each choice scored by its summed "
                              "log-likelihood as lm-evaluation-harness scores its multiple_choice tasks"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Mean next-token loss and perplexity of a model on a text, in non-overlapping windows; says which text.
    With --tasks: multiple-choice accuracy (acc, acc_norm) on a local task file, as lm-evaluation-harness scores it."""
    if tasks is not None:
        _tasks(checkpoint, tasks, data, split, seq_len, as_json)
        return
    from trainscale.commands._infer import kv_table, print_tables
    from trainscale.infer.evaluate import check_window, evaluation_text, score
    from trainscale.infer.load import folder_kind, load_for_inference, load_tokenizer_for, source_folder, spec_of
    from trainscale.runtime.artifact import checkpoint_source

    folder = source_folder(checkpoint)
    spec = spec_of(folder)
    tok = load_tokenizer_for(folder)
    window = check_window(seq_len, spec)
    text = evaluation_text(folder, tok, data, text_field, split, max_tokens, spec.vocab_size, fmt=fmt)
    model, spec, folder = load_for_inference(folder)
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


def _tasks(checkpoint: str, tasks: str, data: str | None, split: str | None, seq_len: int | None,
           as_json: bool) -> None:
    from trainscale.commands._infer import kv_table, print_tables
    from trainscale.errors import TrainscaleError
    from trainscale.infer.tasks import evaluate_tasks

    if data is not None or split is not None or seq_len is not None:
        raise TrainscaleError("--tasks scores multiple-choice examples in the model's whole window; --data, --split "
                              "and --seq-len belong to a perplexity evaluation (run evaluate once for each)")
    rep = evaluate_tasks(checkpoint, tasks)
    if as_json:
        emit_json(rep)
        return
    console.print(f"[bold]{rep['name'] or 'model'}[/bold] ({rep['model_kind']} folder {rep['model']})")

    def pm(v: float, se: float | None) -> str:
        return f"{v:.4f}" + (f" ± {se:.4f}" if se is not None else "")

    print_tables(kv_table({
        "tasks": f"{rep['tasks']}: {rep['examples']:,} examples, {rep['requests']:,} choices scored",
        "acc": pm(rep["acc"], rep["acc_stderr"]),
        "acc_norm": pm(rep["acc_norm"], rep["acc_norm_stderr"]),
        "left-truncated": f"{rep['truncated_requests']:,} of {rep['requests']:,} (window {rep['max_seq_len']:,})",
        "seconds": f"{rep['seconds']:.2f}",
    }))
