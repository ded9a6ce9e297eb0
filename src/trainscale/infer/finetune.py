"""A LoRA fine-tune from start to end (``trainscale lora``): load the frozen base, split the data (text or chat)
into training and held-out documents, measure the held-out perplexity, (QLoRA) quantize the base, add the
adapters, train them, measure again, save the adapter folder (and the merged model), and count the trainable
parameters, Adam bytes and quantized base bytes next to the estimator's. The pieces are infer/lora.py's; the
command prints the result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output

Progress = Callable[[int, float], None]  # (step, loss) after each optimizer step


@dataclass(frozen=True)
class LoraSettings:
    """What the fine-tune is asked for (the command's options, by their field names)."""

    rank: int = 8
    alpha: float | None = None  # None: 2 x rank
    targets: str = "all"
    data: str = ""
    text_field: str = "text"
    format: str = "auto"
    steps: int = 100
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    held_out: float = 0.1
    seed: int = 0
    out: Path | None = None
    merge: bool = False
    base_bits: int | None = None
    base_group_size: int = 64


@dataclass(frozen=True)
class LoraResult:
    """The fine-tune's record: ``report`` is what ``trainscale lora --json`` prints (the adapter folder, losses,
    held-out perplexity before and after, and each count next to the estimator's)."""

    report: dict[str, Any]


def _no_bar(_steps: int) -> AbstractContextManager[Progress | None]:
    return nullcontext(None)


def fine_tune(checkpoint: str, s: LoraSettings,
              bar: Callable[[int], AbstractContextManager[Progress | None]] = _no_bar) -> LoraResult:
    """Fine-tune LoRA adapters on ``checkpoint`` (a model, run or checkpoint folder, or a Hugging Face folder) as
    ``s`` says; ``bar(steps)`` is entered around the training only and gives the per-step callback (or None)."""
    from trainscale.estimate.lora import lora_targets
    from trainscale.infer.load import load_for_inference, load_tokenizer_for
    from trainscale.infer.lora import apply_lora, is_chat_data
    from trainscale.runtime.artifact import beside, model_inputs

    model, spec, src = load_for_inference(checkpoint)
    src = src.resolve()  # adapter.json names its base by absolute path (model.json's source says the same)
    out = s.out or beside(src, f"-lora-r{s.rank}")  # where the adapters go is checked before any training
    if out.resolve() == src.resolve():
        raise TrainscaleError(f"the adapter folder cannot be the base folder {src}; pick another --out")
    check_output(out, "--out", folder=True, inputs=model_inputs(src), not_at=(checkpoint,))
    try:
        names = lora_targets(spec, s.targets)
    except ValueError as e:
        raise TrainscaleError(str(e)) from None
    tok = load_tokenizer_for(src)
    if s.format not in ("auto", "text", "chat"):
        raise TrainscaleError(f"--format must be auto, text or chat, not {s.format!r}")
    chat = s.format == "chat" or (s.format == "auto" and is_chat_data(s.data, s.text_field))
    work = _chat_work(model, spec, src, s) if chat else _text_work(model, spec, src, tok, s)
    before = work.measure()
    base_report = None
    if s.base_bits:
        base_report = _quantized_base(model, s.base_bits, s.base_group_size)
        base_report["held_out_perplexity_full_precision"] = before
        before = work.measure()
    alpha = 2.0 * s.rank if s.alpha is None else s.alpha
    apply_lora(model, s.rank, alpha, names, s.seed)
    t0 = time.perf_counter()
    with bar(s.steps) as progress:
        res = work.train(progress)
    secs = time.perf_counter() - t0
    after = work.measure()
    report = _save_and_count(model, spec, src, out, s, alpha, names, res, base_report, chat)
    report |= {"seconds": secs, "format": "chat" if chat else "text", "train_tokens": work.train_tokens}
    report["held_out"] = {**work.held_out, "fraction": s.held_out, "perplexity_before": before,
                          "perplexity_after": after, "rule": "runtime/data/sources.py Settings.held_mask",
                          "loss_before": math.log(before) if before else None,
                          "loss_after": math.log(after) if after else None, **work.held_extra}
    if work.chat is not None:
        report["chat"] = work.chat
    return LoraResult(report=_ordered(report, base_report, src))


@dataclass
class _Work:
    """The data side of a fine-tune: how to measure the held-out perplexity and how to train."""

    measure: Callable[[], float | None]
    train: Callable[[Progress | None], dict[str, Any]]
    train_tokens: int
    held_out: dict[str, Any]  # text, documents, of_documents
    held_extra: dict[str, Any]
    chat: dict[str, Any] | None = None


def _chat_work(model: Any, spec: Any, src: Path, s: LoraSettings) -> _Work:
    from trainscale.infer.evaluate import chat_nll_sum
    from trainscale.infer.lora import EVAL_TOKENS, ChatSplit, split_chat, train_lora_chat

    split = split_chat(s.data, src, s.held_out, spec.vocab_size)
    if not ChatSplit.learned(split.train):
        raise TrainscaleError(f"data {s.data} leaves no assistant token to learn ({split.describe('training')})")
    held_convs = _first_tokens(split.held, EVAL_TOKENS)
    held_what = split.describe("held-out") + (f", the first {len(held_convs):,} measured"
                                              if len(held_convs) < len(split.held) else "")
    longer = sum(len(ids) > min(s.seq_len, spec.max_seq_len) + 1 for ids, _ in split.train + split.held)

    def measure() -> float | None:
        total, n = chat_nll_sum(model, held_convs, s.seq_len)
        return math.exp(total / n) if n else None

    def train(progress: Progress | None) -> dict[str, Any]:
        return train_lora_chat(model, split.train, s.steps, s.batch, s.seq_len, s.lr, s.seed, progress)

    return _Work(measure=measure, train=train, train_tokens=sum(len(ids) for ids, _ in split.train),
                 held_out={"text": held_what, "documents": split.held_documents, "of_documents": split.documents},
                 held_extra={"conversations": len(held_convs), "tokens": sum(len(i) for i, _ in held_convs),
                             "learned_tokens": ChatSplit.learned(held_convs),
                             "scores": "the learned (assistant) tokens only"},
                 chat={"train_conversations": len(split.train), "learned_train_tokens":
                       ChatSplit.learned(split.train), "longer_than_seq_len": longer,
                       "template": "the base folder's chat template (runtime/data/chat.py)",
                       "batches": "a conversation per row, right-padded; targets IGNORE outside assistant tokens"})


def _text_work(model: Any, spec: Any, src: Path, tok: Any, s: LoraSettings) -> _Work:
    from trainscale.infer.evaluate import perplexity
    from trainscale.infer.lora import EVAL_TOKENS, split_data, train_lora

    split = split_data(s.data, tok, s.text_field, src, spec.vocab_size, held_out=s.held_out)
    train_ids, held_ids = split.train, split.held[:EVAL_TOKENS]
    if len(train_ids) < 64:
        raise TrainscaleError(f"data {s.data} leaves {len(train_ids)} tokens to train on "
                              f"({split.describe('training')}); LoRA training needs at least 64")
    held_what = split.describe("held-out") + (f", the first {EVAL_TOKENS:,} measured"
                                              if len(split.held) > EVAL_TOKENS else "")

    def measure() -> float | None:
        return perplexity(model, held_ids, s.seq_len) if len(held_ids) > 1 else None

    def train(progress: Progress | None) -> dict[str, Any]:
        return train_lora(model, train_ids, s.steps, s.batch, s.seq_len, s.lr, s.seed, progress)

    return _Work(measure=measure, train=train, train_tokens=len(train_ids),
                 held_out={"text": held_what, "documents": split.held_documents, "of_documents": split.documents},
                 held_extra={"tokens": len(held_ids)})


def _save_and_count(model: Any, spec: Any, src: Path, out: Path, s: LoraSettings, alpha: float,
                    names: tuple[str, ...], res: dict[str, Any], base_report: dict[str, Any] | None,
                    chat: bool) -> dict[str, Any]:
    """Write the adapter folder (and the merged model); -> the report's counts, each next to the estimator's."""
    from trainscale.estimate.lora import lora_optimizer_bytes, lora_trainable_params
    from trainscale.estimate.params import param_count
    from trainscale.infer.lora import data_record, merge_lora, save_adapter_folder

    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + \
        (base_report["weights"] if base_report else 0)  # a quantized base's projections are buffers
    pred_params = lora_trainable_params(spec, s.rank, names)
    pred_opt = lora_optimizer_bytes(spec, s.rank, names)
    cfg = {"rank": s.rank, "alpha": alpha, "targets": list(names), "steps": s.steps, "lr": s.lr,
           "data": data_record(s.data), "text_field": s.text_field,
           "format": "chat" if chat else "text",
           "held_out": s.held_out, "losses": res["losses"]}
    if s.base_bits:
        cfg |= {"base_bits": s.base_bits, "base_group_size": s.base_group_size}
    save_adapter_folder(out, model, spec, src, cfg)
    if s.merge:
        from trainscale.runtime.artifact import save_model_dir

        save_model_dir(out, merge_lora(model).state_dict(), spec, None)
    return {
        "base": str(src), "out": str(out), "merged": s.merge, "rank": s.rank, "alpha": alpha, "targets": list(names),
        "steps": s.steps, "first_loss": res["losses"][0], "last_loss": res["losses"][-1],
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


_ORDER = ("base", "out", "merged", "rank", "alpha", "targets", "steps", "seconds", "first_loss", "last_loss",
          "format", "held_out", "train_tokens", "trainable_params", "frozen_params", "base_params", "optimizer_bytes",
          "chat")


def _ordered(report: dict[str, Any], base_report: dict[str, Any] | None, src: Path) -> dict[str, Any]:
    """The report's keys in the order ``--json`` has always printed them."""
    from trainscale.runtime.artifact import checkpoint_source

    out = {k: report[k] for k in _ORDER if k in report}
    if base_report is not None:
        out["quantized_base"] = base_report
    if (origin := checkpoint_source(src)) is not None:
        out["from_checkpoint"] = origin
    return out


def _first_tokens(convs: list, limit: int) -> list:
    """The first conversations holding about ``limit`` tokens (at least one)."""
    total = 0
    for i, (ids, _) in enumerate(convs):
        total += len(ids)
        if total >= limit:
            return convs[: i + 1]
    return convs


def _quantized_base(model: Any, bits: int, group_size: int) -> dict[str, Any]:
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
