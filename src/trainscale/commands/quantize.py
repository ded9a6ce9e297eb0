"""`trainscale quantize`: group-wise int8 / int4 weights, or (--to gguf) a llama.cpp K-quant GGUF made by llama.cpp's
own quantizer; file size vs the estimator, perplexity before/after."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import typer

from trainscale.commands._common import SEED, console, emit_json, input_file, number


def register(app: typer.Typer) -> None:
    app.command()(quantize)


def quantize(
    checkpoint: str = typer.Argument(..., help="model folder, run folder (its final/, else its newest checkpoint), "
                                      "checkpoint RUN/checkpoints/step-N, or a Hugging Face model folder"),
    fmt: str = typer.Option("int4", "--format", "-f", help="int8 or int4 (trainscale's own safetensors format)"),
    to: str = typer.Option(None, "--to", help="gguf: a llama.cpp GGUF of --type, quantized by llama.cpp's own "
                           "quantizer from the model's f16 GGUF (default: trainscale's --format)"),
    gguf_type: str = typer.Option("Q4_K_M", "--type", "-t", help="with --to gguf: Q4_K_M, Q5_K_M, Q6_K or Q8_0"),
    threads: int = typer.Option(None, "--threads", callback=number(gt=0, le=4096),
                                help="with --to gguf: llama.cpp's threads (default: every CPU)"),
    group_size: int = typer.Option(32, "--group-size", "-g", callback=number(gt=0, le=1 << 20),
                                   help="weights per scale: 32, 64 or 128"),
    asymmetric: bool = typer.Option(False, "--asymmetric/--symmetric", help="per-group offset (min) as well"),
    out: Path = typer.Option(None, "--out", "-o", help="output folder (default: CHECKPOINT-FORMAT-gGROUP beside it; "
                             "RUN/step-N-FORMAT-gGROUP for a checkpoint); with --to gguf a .gguf file (default: "
                             "CHECKPOINT-TYPE.gguf beside it)"),
    eval_tokens: int = typer.Option(16384, callback=number(ge=0, le=1e8),
                                    help="held-out tokens for the perplexity check (0: skip it)"),
    eval_text: Path = typer.Option(None, callback=input_file("held-out text"),
                                   help="text file for the perplexity check, all its documents (default: the "
                                        "model's own held-out data: a LoRA folder's held-out documents, a run's "
                                        "held-out split; else the held-out plays)"),
    prompt: str = typer.Option(None, "--prompt", "-p", help="prompt for the sample generation (default: the start "
                               "of the held-out text)"),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n", callback=number(ge=0, le=1 << 20),
                                       help="tokens of the sample (0: none)"),
    seed: int = typer.Option(0, callback=SEED, help="sampling seed of the sample"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Quantize every weight matrix group-wise (fp16 scale per group, packed 4-bit codes) and check the result;
    --to gguf: a K-quant GGUF by llama.cpp's quantizer, its perplexity vs the f16 GGUF measured by llama.cpp."""
    from trainscale.commands._infer import check_table, kv_table, print_tables
    from trainscale.errors import TrainscaleError

    if to is not None and to.lower() != "gguf":
        raise TrainscaleError(f"--to must be gguf (or left out for --format int4 / int8), not {to!r}")
    if to is not None:
        from trainscale.infer.gguf_quant import GgufQuantSettings, quantize_gguf

        done = quantize_gguf(checkpoint, GgufQuantSettings(type=gguf_type, out=out, eval_tokens=eval_tokens,
                                                           eval_text=eval_text, prompt=prompt, seed=seed,
                                                           max_new_tokens=max_new_tokens, threads=threads),
                             status=_quiet if as_json else console.status)
        return emit_json(done.report) if as_json else _print_gguf(done.report)
    from trainscale.infer.quantize_check import QuantSettings, quantize_and_check

    settings = QuantSettings(format=fmt, group_size=group_size, asymmetric=asymmetric, out=out,
                             eval_tokens=eval_tokens, eval_text=eval_text, prompt=prompt,
                             max_new_tokens=max_new_tokens, seed=seed)
    done = quantize_and_check(checkpoint, settings, status=_quiet if as_json else console.status)
    report = done.report
    if as_json:
        emit_json(report)
        return
    f, err = report["file"], report["weight_error"]
    console.print(f"[bold]{fmt} {report['scheme']}, groups of {group_size}[/bold]: {report['source']} -> {done.path}")
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
                                             [("tensor bytes", f["tensor_bytes"], f["predicted_tensor_bytes"])]))
    if "sample" in report:
        from rich.text import Text

        console.print(Text("\nsample from the quantized model: ") + Text(report["sample"]["prompt"], style="bold")
                      + Text(report["sample"]["completion"]))


def _tally(types: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in types:
        out[t] = out.get(t, 0) + 1
    return out


def _print_gguf(report: dict[str, Any]) -> None:
    from rich.text import Text

    from trainscale.commands._infer import check_table, kv_table, print_tables

    f, kind, pub = report["file"], report["type"], report["published"]
    console.print(f"[bold]GGUF {kind} by llama.cpp's quantizer[/bold] (architecture {report['architecture']}): "
                  f"{report['source']} -> {report['out']}")
    rows = {"file on disk": f"{f['file_bytes']:,} B (f16 GGUF {f['f16_file_bytes']:,} B)",
            "bits per weight (tensor bytes x 8 / weights)": f"{f['bits_per_weight']:.3f}",
            "tensor types (read back)": ", ".join(f"{n} {t}" for t, n in report["type_counts"].items())}
    if report["fallbacks"]:
        got = _tally(report["fallbacks"].values())
        rows["rows not whole 256-weight blocks"] = (f"{len(report['fallbacks'])} matrices, written "
                                                    + ", ".join(f"{n} {t}" for t, n in got.items()))
    p = report["perplexity"]
    rows["perplexity text"] = p["text"]
    if "tokens" in p:
        rows[f"held-out perplexity by llama.cpp ({p['scored']:,} tokens)"] = (
            f"f16 {p['f16']:.3f}, {kind} {p[kind]:.3f} ({p['change_vs_f16']:+.2%} vs f16)")
    rows[f"published, {pub['model']}"] = (f"{pub['file_gib']} GiB, {pub['ppl_increase']:+.4f} ppl "
                                         f"({pub['ppl_ratio'] - 1:+.2%} vs f16)")
    print_tables(kv_table(rows), check_table("file size vs the estimator (gguf_tensor_bytes, llama.cpp's type mix)",
                                             [("tensor bytes", f["tensor_bytes"], f["predicted_tensor_bytes"])]))
    if report["fallbacks"]:
        console.print(f"{len(report['fallbacks'])} matrices have rows that are not a multiple of 256 weights (QK_K): "
                      f"llama.cpp fell back to the 32-weight types above for them instead of {kind}'s K-quants "
                      "(--json lists each).")
    if "sample" in report:
        sample = report["sample"]
        console.print(Text("\nsample by llama.cpp from the GGUF file: ") + Text(sample["prompt"], style="bold")
                      + Text(sample["completion"]))


def _quiet(_what: str) -> AbstractContextManager[Any]:
    return nullcontext()
