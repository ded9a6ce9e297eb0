"""``trainscale quantize`` from start to end: quantize a model group-wise (infer/quantize.py), write it, and check
the result: the file's bytes against the estimator (estimate/inference.quantized_model_bytes), the weights' error,
the held-out perplexity of the source, its bf16 copy and the quantized model (infer/evaluate.py), and a sample
generated from the file just written. The command prints the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output


@dataclass(frozen=True)
class QuantSettings:
    """What the quantization is asked for (the command's options, by their field names)."""

    format: str = "int4"
    group_size: int = 32
    asymmetric: bool = False
    out: Path | None = None
    eval_tokens: int = 16384
    eval_text: Path | None = None
    prompt: str | None = None  # None: the start of the held-out text (infer/evaluate.default_prompt)
    max_new_tokens: int = 48
    seed: int = 0


@dataclass(frozen=True)
class QuantResult:
    """``report``: what ``trainscale quantize --json`` prints; ``path``: the safetensors file written."""

    report: dict[str, Any]
    path: Path


def quiet(_what: str) -> AbstractContextManager[Any]:
    return nullcontext()


def quantize_and_check(checkpoint: str, s: QuantSettings,
                       status: Callable[[str], AbstractContextManager[Any]] = quiet) -> QuantResult:
    """Quantize ``checkpoint`` (a model, run or checkpoint folder, or a Hugging Face folder) into ``s.out`` and
    measure it; ``status(what)`` wraps the perplexity measurement (a spinner, for a person)."""
    from trainscale.estimate.inference import quantized_model_bytes
    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.load import load_for_inference, load_tokenizer_for, source_folder
    from trainscale.infer.quantize import QuantConfig, safetensors_layout, save_quantized, weight_error
    from trainscale.runtime.artifact import beside, checkpoint_source, model_inputs

    fmt, group_size = s.format, s.group_size
    cfg = QuantConfig(fmt, group_size, s.asymmetric).check()
    if fmt == "bf16":
        raise TrainscaleError("--format must be int8 or int4")
    src = source_folder(checkpoint)  # a Hugging Face folder too
    out = s.out or beside(src, f"-{fmt}-g{group_size}{'-asym' if s.asymmetric else ''}")
    check_output(out, "--out", folder=True, inputs=model_inputs(src), not_at=(checkpoint,))
    t0 = time.perf_counter()
    res = save_quantized(*load_for_inference(src), out, cfg)
    secs = time.perf_counter() - t0
    spec = res.spec
    layout = safetensors_layout(res.path)
    predicted = quantized_model_bytes(spec, fmt, group_size, s.asymmetric)
    report: dict[str, Any] = {
        "source": str(res.source), "out": str(out), "format": fmt, "group_size": group_size, "scheme": cfg.scheme,
        "seconds": secs,
        "file": {**layout, "predicted_tensor_bytes": predicted, "equal": layout["tensor_bytes"] == predicted,
                 "bf16_tensor_bytes": quantized_model_bytes(spec, "bf16")},
        "weight_error": weight_error(res.original, res.restored),
    }
    if (origin := checkpoint_source(src)) is not None:
        report["from_checkpoint"] = origin
    if (res.source / "model.safetensors").exists():
        report["file"]["source_file_bytes"] = safetensors_layout(res.source / "model.safetensors")["file_bytes"]
    tok = load_tokenizer_for(out)
    text = held_out_text(src, tok, s, spec.vocab_size)
    report["perplexity"] = _perplexities(res, text, s, status)
    if s.max_new_tokens:
        from trainscale.infer.evaluate import default_prompt

        room = spec.max_seq_len - s.max_new_tokens  # the sample fits the model's window
        prompt = s.prompt if s.prompt is not None else default_prompt(tok, text.ids, room=room)
        qmodel, _, _ = load_for_inference(out)  # from the file just written
        g = generate_ids(qmodel, tok.encode(prompt).ids, s.max_new_tokens, Sampling(0.8, 0, 0.95, s.seed))
        report["sample"] = {"prompt": prompt, "prompt_default": s.prompt is None, "completion": tok.decode(g.new_ids)}
    return QuantResult(report=report, path=res.path)


def held_out_text(src: Path, tok: Any, s: Any, vocab: int) -> Any:
    """The held-out text (infer/evaluate.evaluation_text: --eval-text, else the model's own held-out data), for the
    perplexity and the default prompt; None when neither needs it. ``s``: QuantSettings or
    infer/gguf_quant.GgufQuantSettings (eval_tokens, eval_text, prompt, max_new_tokens)."""
    from trainscale.infer.evaluate import evaluation_text

    if not s.eval_tokens and (s.prompt is not None or not s.max_new_tokens):
        return None
    return evaluation_text(src, tok, str(s.eval_text) if s.eval_text is not None else None,
                           split="all" if s.eval_text else None, max_tokens=max(s.eval_tokens, 64), vocab=vocab,
                           default_plays=True)


def _perplexities(res: Any, text: Any, s: QuantSettings,
                  status: Callable[[str], AbstractContextManager[Any]]) -> dict[str, Any]:
    """Held-out perplexity of the source, its bf16 copy and the quantized weights, on one text."""
    import torch

    from trainscale.infer.evaluate import perplexity
    from trainscale.infer.quantize import model_from_state_dict

    if not s.eval_tokens:
        return {"text": "none (--eval-tokens 0)", "text_kind": "none"}
    spec = res.spec
    ids = text.ids[:s.eval_tokens]
    bf16 = {k: v.to(torch.bfloat16) for k, v in res.original.items()}
    with status("held-out perplexity ..."):
        ppl = {"source": perplexity(model_from_state_dict(spec, res.original), ids),
               "bf16": perplexity(model_from_state_dict(spec, bf16), ids),
               s.format: perplexity(model_from_state_dict(spec, res.restored), ids)}
    return {**ppl, **text.report(), "tokens": len(ids), "change_vs_bf16": ppl[s.format] / ppl["bf16"] - 1}
