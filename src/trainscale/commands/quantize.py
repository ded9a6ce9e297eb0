"""`trainscale quantize`: group-wise int8 / int4 weights, file size vs the estimator, perplexity before/after."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import typer

from trainscale.commands._common import SEED, console, emit_json, input_file, number
from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output


def register(app: typer.Typer) -> None:
    app.command()(quantize)


def quantize(
    checkpoint: str = typer.Argument(..., help="model folder, run folder (its final/, else its newest checkpoint), "
                                      "checkpoint RUN/checkpoints/step-N, or a Hugging Face model folder"),
    fmt: str = typer.Option("int4", "--format", "-f", help="int8 or int4"),
    group_size: int = typer.Option(32, "--group-size", "-g", callback=number(gt=0, le=1 << 20),
                                   help="weights per scale: 32, 64 or 128"),
    asymmetric: bool = typer.Option(False, "--asymmetric/--symmetric", help="per-group offset (min) as well"),
    out: Path = typer.Option(None, "--out", "-o", help="output folder (default: CHECKPOINT-FORMAT-gGROUP beside it; "
                             "RUN/step-N-FORMAT-gGROUP for a checkpoint)"),
    eval_tokens: int = typer.Option(16384, callback=number(ge=0, le=1e8),
                                    help="held-out tokens for the perplexity check (0: skip it)"),
    eval_text: Path = typer.Option(None, callback=input_file("held-out text"),
                                   help="text file for the perplexity check, all its documents (default: the "
                                        "model's own held-out data: a LoRA folder's held-out documents, a run's "
                                        "held-out split; else the held-out plays)"),
    prompt: str = typer.Option("To be, or not to be", "--prompt", "-p", help="prompt for the sample generation"),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n", callback=number(ge=0, le=1 << 20),
                                       help="tokens of the sample (0: none)"),
    seed: int = typer.Option(0, callback=SEED, help="sampling seed of the sample"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Quantize every weight matrix group-wise (fp16 scale per group, packed 4-bit codes) and check the result."""
    import torch

    from trainscale.commands._infer import check_table, kv_table, print_tables
    from trainscale.estimate.inference import quantized_model_bytes
    from trainscale.infer.evaluate import evaluation_text, perplexity
    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.load import load_for_inference, load_tokenizer_for, source_folder
    from trainscale.infer.quantize import (
        QuantConfig,
        model_from_state_dict,
        safetensors_layout,
        save_quantized,
        weight_error,
    )
    from trainscale.runtime.artifact import beside, checkpoint_source, model_inputs

    cfg = QuantConfig(fmt, group_size, asymmetric).check()
    if fmt == "bf16":
        raise TrainscaleError("--format must be int8 or int4")
    if eval_tokens < 0:
        raise TrainscaleError(f"--eval-tokens must be >= 0, not {eval_tokens}")
    src = source_folder(checkpoint)  # a Hugging Face folder too
    out = out or beside(src, f"-{fmt}-g{group_size}{'-asym' if asymmetric else ''}")
    check_output(out, "--out", folder=True, inputs=model_inputs(src), not_at=(checkpoint,))
    t0 = time.perf_counter()
    res = save_quantized(*load_for_inference(src), out, cfg)
    secs = time.perf_counter() - t0
    spec = res.spec
    layout = safetensors_layout(res.path)
    predicted = quantized_model_bytes(spec, fmt, group_size, asymmetric)
    err = weight_error(res.original, res.restored)
    report: dict = {
        "source": str(res.source), "out": str(out), "format": fmt, "group_size": group_size, "scheme": cfg.scheme,
        "seconds": secs,
        "file": {**layout, "predicted_tensor_bytes": predicted, "equal": layout["tensor_bytes"] == predicted,
                 "bf16_tensor_bytes": quantized_model_bytes(spec, "bf16")},
        "weight_error": err,
    }
    if (origin := checkpoint_source(src)) is not None:
        report["from_checkpoint"] = origin
    if (res.source / "model.safetensors").exists():
        report["file"]["source_file_bytes"] = safetensors_layout(res.source / "model.safetensors")["file_bytes"]
    tok = load_tokenizer_for(out)
    if eval_tokens:
        text = evaluation_text(src, tok, str(eval_text) if eval_text is not None else None, split="all" if eval_text
                               else None, max_tokens=eval_tokens, vocab=spec.vocab_size, default_plays=True)
        ids = text.ids
        bf16 = {k: v.to(torch.bfloat16) for k, v in res.original.items()}
        with console.status("held-out perplexity ...") if not as_json else nullcontext():
            ppl = {"source": perplexity(model_from_state_dict(spec, res.original), ids),
                   "bf16": perplexity(model_from_state_dict(spec, bf16), ids),
                   fmt: perplexity(model_from_state_dict(spec, res.restored), ids)}
        report["perplexity"] = {**ppl, **text.report(), "change_vs_bf16": ppl[fmt] / ppl["bf16"] - 1}
    else:
        report["perplexity"] = {"text": "none (--eval-tokens 0)", "text_kind": "none"}
    if max_new_tokens:
        qmodel, _, _ = load_for_inference(out)  # from the file just written
        g = generate_ids(qmodel, tok.encode(prompt).ids, max_new_tokens, Sampling(0.8, 0, 0.95, seed))
        report["sample"] = {"prompt": prompt, "completion": tok.decode(g.new_ids)}
    if as_json:
        emit_json(report)
        return
    f = report["file"]
    console.print(f"[bold]{fmt} {cfg.scheme}, groups of {group_size}[/bold]: {res.source} -> {res.path}")
    rows = {"file on disk": f"{f['file_bytes']:,} B (header {f['header_bytes']:,} B + tensors {f['tensor_bytes']:,} B)",
            "weight error (relative Frobenius)": f"{err['relative_frobenius']:.3%}",
            "weight error (largest |dW|)": f"{err['max_abs']:.3g}"}
    if "source_file_bytes" in f:
        rows["source file"] = f"{f['source_file_bytes']:,} B"
    p = report["perplexity"]
    rows["perplexity text"] = p["text"]
    if "tokens" in p:
        rows[f"held-out perplexity ({p['tokens']:,} tokens)"] = (
            f"source {p['source']:.3f}, bf16 {p['bf16']:.3f}, {fmt} {p[fmt]:.3f} ({p['change_vs_bf16']:+.2%} vs bf16)")
    print_tables(kv_table(rows), check_table("file size vs the estimator (quantized_model_bytes)",
                                             [("tensor bytes", f["tensor_bytes"], predicted)]))
    if "sample" in report:
        from rich.text import Text

        console.print(Text("\nsample from the quantized model: ") + Text(prompt, style="bold")
                      + Text(report["sample"]["completion"]))

