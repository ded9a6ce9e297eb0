"""`trainscale lora`: train low-rank adapters on a frozen model; trainable params and Adam bytes vs the estimator."""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer

from trainscale.commands._common import SEED, console, emit_json, number
from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output


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
    out: Path = typer.Option(None, "--out", "-o", help="output folder (default: CHECKPOINT-lora-rR beside it; "
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
    from rich.progress import Progress

    from trainscale.commands._infer import check_table, kv_table, print_tables
    from trainscale.estimate.lora import lora_optimizer_bytes, lora_targets, lora_trainable_params
    from trainscale.estimate.params import param_count
    from trainscale.infer.evaluate import chat_nll_sum, perplexity
    from trainscale.infer.load import load_for_inference, load_tokenizer_for
    from trainscale.infer.lora import (
        EVAL_TOKENS,
        ChatSplit,
        apply_lora,
        data_record,
        is_chat_data,
        merge_lora,
        save_adapter_folder,
        split_chat,
        split_data,
        train_lora,
        train_lora_chat,
    )
    from trainscale.infer.quantize import GROUP_SIZES
    from trainscale.runtime.artifact import beside, checkpoint_source, model_inputs

    for name, v in (("--rank", rank), ("--steps", steps), ("--batch", batch), ("--seq-len", seq_len)):
        if v <= 0:
            raise TrainscaleError(f"{name} must be positive, not {v}")
    if not lr > 0:
        raise TrainscaleError(f"--lr must be positive, not {lr}")
    alpha = 2.0 * rank if alpha is None else alpha
    if base_bits is not None and base_bits not in (4, 8):
        raise TrainscaleError(f"--base-bits must be 4 or 8, not {base_bits}")
    if base_group_size not in GROUP_SIZES:
        raise TrainscaleError(f"--base-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, not "
                              f"{base_group_size}")
    model, spec, src = load_for_inference(checkpoint)
    src = src.resolve()  # adapter.json names its base by absolute path (model.json's source says the same)
    base = src  # where the adapters go is checked before any training
    out = out or beside(base, f"-lora-r{rank}")
    if out.resolve() == base.resolve():
        raise TrainscaleError(f"the adapter folder cannot be the base folder {base}; pick another --out")
    check_output(out, "--out", folder=True, inputs=model_inputs(base), not_at=(checkpoint,))
    try:
        names = lora_targets(spec, targets)
    except ValueError as e:
        raise TrainscaleError(str(e)) from None
    tok = load_tokenizer_for(src)
    if fmt not in ("auto", "text", "chat"):
        raise TrainscaleError(f"--format must be auto, text or chat, not {fmt!r}")
    chat = fmt == "chat" or (fmt == "auto" and is_chat_data(data, text_field))
    if chat:
        split = split_chat(data, src, held_out, spec.vocab_size)
        if not ChatSplit.learned(split.train):
            raise TrainscaleError(f"data {data} leaves no assistant token to learn ({split.describe('training')})")
        held_convs = _first_tokens(split.held, EVAL_TOKENS)
        held_what = split.describe("held-out") + (f", the first {len(held_convs):,} measured"
                                                  if len(held_convs) < len(split.held) else "")
        longer = sum(len(ids) > min(seq_len, spec.max_seq_len) + 1 for ids, _ in split.train + split.held)
        train_tokens = sum(len(ids) for ids, _ in split.train)

        def measure() -> float | None:
            total, n = chat_nll_sum(model, held_convs, seq_len)
            return math.exp(total / n) if n else None

        def train(progress=None) -> dict:
            return train_lora_chat(model, split.train, steps, batch, seq_len, lr, seed, progress)
    else:
        split = split_data(data, tok, text_field, src, spec.vocab_size, held_out=held_out)
        train_ids, held_ids = split.train, split.held[:EVAL_TOKENS]
        if len(train_ids) < 64:
            raise TrainscaleError(f"data {data} leaves {len(train_ids)} tokens to train on "
                                  f"({split.describe('training')}); LoRA training needs at least 64")
        held_what = split.describe("held-out") + (f", the first {EVAL_TOKENS:,} measured"
                                                  if len(split.held) > EVAL_TOKENS else "")
        longer, train_tokens = None, len(train_ids)

        def measure() -> float | None:
            return perplexity(model, held_ids, seq_len) if len(held_ids) > 1 else None

        def train(progress=None) -> dict:
            return train_lora(model, train_ids, steps, batch, seq_len, lr, seed, progress)
    before = measure()
    base_report = None
    if base_bits:
        base_report = _quantized_base(model, base_bits, base_group_size)
        base_report["held_out_perplexity_full_precision"] = before
        before = measure()
    apply_lora(model, rank, alpha, names, seed)
    t0 = time.perf_counter()
    if as_json:
        res = train()
    else:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("LoRA steps", total=steps)
            res = train(lambda s, loss: bar.update(task, completed=s, description=f"loss {loss:.3f}"))
    secs = time.perf_counter() - t0
    after = measure()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + \
        (base_report["weights"] if base_report else 0)  # a quantized base's projections are buffers
    pred_params = lora_trainable_params(spec, rank, names)
    pred_opt = lora_optimizer_bytes(spec, rank, names)
    folder = src
    cfg = {"rank": rank, "alpha": alpha, "targets": list(names), "steps": steps, "lr": lr, "data": data_record(data),
           "text_field": text_field, "format": "chat" if chat else "text", "held_out": held_out,
           "losses": res["losses"]}
    if base_bits:
        cfg |= {"base_bits": base_bits, "base_group_size": base_group_size}
    save_adapter_folder(out, model, spec, folder, cfg)
    if merge:
        from trainscale.runtime.artifact import save_model_dir

        merged = merge_lora(model)
        save_model_dir(out, merged.state_dict(), spec, None)
    report = {
        "base": str(folder), "out": str(out), "merged": merge, "rank": rank, "alpha": alpha, "targets": list(names),
        "steps": steps, "seconds": secs, "first_loss": res["losses"][0], "last_loss": res["losses"][-1],
        "format": "chat" if chat else "text",
        "held_out": {"text": held_what, "documents": split.held_documents, "of_documents": split.documents,
                     "fraction": held_out, "perplexity_before": before,
                     "perplexity_after": after, "rule": "runtime/data/sources.py Settings.held_mask",
                     "loss_before": math.log(before) if before else None,
                     "loss_after": math.log(after) if after else None},
        "train_tokens": train_tokens,
        "trainable_params": {"measured": res["trainable_params"], "predicted": pred_params,
                             "equal": res["trainable_params"] == pred_params,
                             "formula": "n_layers x sum over targets of r x (d_in + d_out) (Hu et al. 2021)"},
        "frozen_params": frozen, "base_params": param_count(spec),
        "optimizer_bytes": {"measured": res["optimizer_bytes"]["moments"], "predicted": pred_opt,
                            "equal": res["optimizer_bytes"]["moments"] == pred_opt,
                            "step_counter_bytes": res["optimizer_bytes"]["step_counters"],
                            "counts": "Adam's fp32 m and v (8 bytes per trainable parameter); adapters train in fp32, "
                                      "so no separate master copy"},
    }
    if chat:
        report["held_out"] |= {"conversations": len(held_convs), "tokens": sum(len(i) for i, _ in held_convs),
                               "learned_tokens": ChatSplit.learned(held_convs),
                               "scores": "the learned (assistant) tokens only"}
        report["chat"] = {"train_conversations": len(split.train), "learned_train_tokens":
                          ChatSplit.learned(split.train), "longer_than_seq_len": longer,
                          "template": "the base folder's chat template (runtime/data/chat.py)",
                          "batches": "a conversation per row, right-padded; targets IGNORE outside assistant tokens"}
    else:
        report["held_out"]["tokens"] = len(held_ids)
    if base_report is not None:
        report["quantized_base"] = base_report
    if (origin := checkpoint_source(folder)) is not None:
        report["from_checkpoint"] = origin
    if as_json:
        emit_json(report)
        return
    qlora = f" over an int{base_bits} base (groups of {base_group_size})" if base_bits else ""
    console.print(f"[bold]LoRA r={rank}, alpha={alpha:g} on {', '.join(names)}[/bold]{qlora}: {folder} -> {out}"
                  + (" (merged)" if merge else ""))
    rows = {"loss": f"{report['first_loss']:.3f} -> {report['last_loss']:.3f} in {steps} steps ({secs:.1f} s)",
            "frozen parameters": f"{frozen:,} (base model {param_count(spec):,})"}
    if base_report is not None:
        b = base_report
        rows[f"base projections, int{base_bits}"] = (f"{b['bytes']:,} B = {b['ratio_to_bf16']:.4f} of bf16 "
                                                     f"({b['bf16_bytes']:,} B), scales included")
        if b["held_out_perplexity_full_precision"] is not None:
            rows["held-out perplexity, full-precision base"] = f"{b['held_out_perplexity_full_precision']:.3f}"
    if chat:
        rows["chat data"] = (f"{len(split.train):,} training conversations, {ChatSplit.learned(split.train):,} "
                             "learned (assistant) tokens; loss on those only" +
                             (f"; {longer:,} conversations cut to --seq-len {seq_len}" if longer else ""))
    rows["held out"] = held_what
    if before is not None:
        rows["held-out perplexity"] = f"{before:.3f} -> {after:.3f}"
    else:
        rows["held-out perplexity"] = "not measured: no document held out (--held-out, or more documents)"
    checks = [("trainable parameters", res["trainable_params"], pred_params),
              ("Adam m + v bytes", res["optimizer_bytes"]["moments"], pred_opt)]
    if base_report is not None:
        checks.append(("quantized base bytes", base_report["bytes"], base_report["predicted_bytes"]))
    print_tables(kv_table(rows), check_table("adapters vs the estimator (estimate/lora.py, estimate/inference.py)",
                                             checks))


def _first_tokens(convs: list, limit: int) -> list:
    """The first conversations holding about ``limit`` tokens (at least one)."""
    total = 0
    for i, (ids, _) in enumerate(convs):
        total += len(ids)
        if total >= limit:
            return convs[: i + 1]
    return convs


def _quantized_base(model, bits: int, group_size: int) -> dict:
    """Quantize the base's projections in place (infer/lora.quantize_base); -> their bytes, measured and by
    estimate/inference.group_quant_bytes row by row."""
    from trainscale.estimate.inference import group_quant_bytes
    from trainscale.infer.lora import quantize_base
    from trainscale.infer.quantize import QuantizedLinear

    got = quantize_base(model, bits, group_size)
    predicted = sum(m.out_features * group_quant_bytes(m.in_features, bits, group_size)
                    for m in model.modules() if isinstance(m, QuantizedLinear))
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"bits": bits, "group_size": group_size, "scheme": "symmetric round-to-nearest (infer/quantize.py)",
            "weights": got["weights"], "bytes": got["bytes"], "bf16_bytes": got["bf16_bytes"],
            "ratio_to_bf16": got["bytes"] / got["bf16_bytes"], "predicted_bytes": int(predicted),
            "equal": got["bytes"] == predicted, "unquantized_bytes": rest,
            "unquantized": "embeddings, norms and output head, as loaded (fp32)"}
