"""``trainscale quantize --to gguf --type Q4_K_M``: llama.cpp's own quantizer on our f16 GGUF, and the check.

The model is exported to an f16 GGUF (infer/gguf.export_gguf) in a temporary folder, and llama.cpp's quantizer,
``llama_model_quantize`` of llama-cpp-python's binding (what the ``llama-quantize`` tool calls), writes the K-quant
file from it: no K-quant block is made here. The result is read back with gguf-py's reader (file type, every
tensor's type), its tensor bytes compared with the estimator (estimate/inference.gguf_tensor_bytes: llama.cpp's
type mix and its fallbacks, each type's bytes per block from ggml's block structs), and its held-out perplexity
measured by llama.cpp itself against the f16 file's, on the same token windows as infer/evaluate.py uses
(runtime/evaluator.window_spans) and on the same token ids: our tokenizer's, fed to llama.cpp as ids.

K-quants work on super-blocks of 256 weights (ggml's QK_K): a tensor whose rows are not a multiple of 256 gets
another type (llama.cpp's tensor_type_fallback: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, F16 below that); the
report names those tensors with the types read back.

Published perplexity increase vs f16 (``PUBLISHED``): llama.cpp tools/quantize/quantize.cpp (QUANT_OPTIONS:
"+0.1754 ppl @ Llama-3-8B" for Q4_K_M, ...) and tools/perplexity/README.md (the LLaMA 3 8B scoreboard those
numbers come from: wikitext-2, f16 perplexity 6.2316; the ratio is the quantized perplexity over it).
"""

from __future__ import annotations

import ctypes
import math
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.infer.evaluate import default_prompt
from trainscale.infer.quantize_check import held_out_text, quiet
from trainscale.safeio import check_output

# the types offered: llama.cpp's name -> (trainscale's GGUF type name in estimate/inference.GGUF_FTYPES, the ggml
# type of most matrices, llama_cpp's LLAMA_FTYPE_MOSTLY_* constant)
GGUF_QUANT_TYPES = {"Q4_K_M": ("q4_k_m", "Q4_K", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
                    "Q5_K_M": ("q5_k_m", "Q5_K", "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
                    "Q6_K": ("q6_k", "Q6_K", "LLAMA_FTYPE_MOSTLY_Q6_K"),
                    "Q8_0": ("q8_0", "Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0")}
# Llama 3 8B on wikitext-2, llama.cpp tools/perplexity/README.md "LLaMA 3 8b Scoreboard" (no imatrix), the same
# increases tools/quantize/quantize.cpp prints: (file GiB, perplexity increase vs f16, perplexity / f16's)
PUBLISHED_F16_PPL = 6.231636  # 6.233160 (f16 row) - 0.001524 (its ΔPPL): the base the table's ΔPPL are from
PUBLISHED = {"Q4_K_M": (4.58, 0.175482), "Q5_K_M": (5.33, 0.056974), "Q6_K": (6.14, 0.021748),
             "Q8_0": (7.96, 0.002650)}
PUBLISHED_SOURCE = ("llama.cpp tools/quantize/quantize.cpp QUANT_OPTIONS and tools/perplexity/README.md "
                    "(LLaMA 3 8B, wikitext-2)")


def published(kind: str) -> dict[str, Any]:
    """llama.cpp's published numbers for a type on Llama 3 8B: file size, perplexity increase and ratio vs f16."""
    gib, delta = PUBLISHED[kind]
    return {"model": "Llama-3-8B", "file_gib": gib, "ppl_increase": delta,
            "ppl_ratio": (PUBLISHED_F16_PPL + delta) / PUBLISHED_F16_PPL, "source": PUBLISHED_SOURCE}


@dataclass(frozen=True)
class GgufQuantSettings:
    """What ``quantize --to gguf`` is asked for (the command's options, by their field names)."""

    type: str = "Q4_K_M"
    out: Path | None = None
    eval_tokens: int = 16384
    eval_text: Path | None = None
    prompt: str | None = None  # None: the start of the held-out text
    max_new_tokens: int = 48
    seed: int = 0
    threads: int | None = None  # None: os.cpu_count()


def gguf_quant_type(name: str) -> str:
    """A type name as llama.cpp spells it (Q4_K_M), case aside; one sentence for another."""
    kind = name.upper()
    if kind not in GGUF_QUANT_TYPES:
        raise TrainscaleError(f"--type must be one of {', '.join(GGUF_QUANT_TYPES)} with --to gguf, not {name!r}")
    return kind


def llama_quantize(src: str | Path, out: str | Path, kind: str, threads: int) -> None:
    """llama.cpp's quantizer (``llama_model_quantize``, its default parameters: K-quant mix on, output tensor
    quantized) from the GGUF file ``src`` to ``out`` in ``kind``; its log is kept off the terminal."""
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, GGUF_QUANT_TYPES[kind][2])
    with suppress_stdout_stderr(disable=False):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise JobFailed(f"llama.cpp's quantizer failed on {src} (return code {rc}) and wrote no {kind} file")


def gguf_types(path: str | Path) -> dict[str, Any]:
    """What a GGUF file says it holds: general.file_type and every tensor's ggml type and row length (ne0)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    field = r.fields.get("general.file_type")
    ftype = int(field.parts[-1][0]) if field is not None else None
    return {"file_type": ftype, "tensors": {t.name: t.tensor_type.name for t in r.tensors},
            "row": {t.name: int(t.shape[0]) for t in r.tensors}, "weights": sum(int(t.n_elements) for t in r.tensors)}


def llama_cpp_nll(path: str | Path, ids: list[int], seq_len: int, threads: int) -> tuple[float, int]:
    """(summed next-token NLL, tokens scored) by llama.cpp on ``ids`` (our tokenizer's ids, evaluated as ids), over
    the windows infer/evaluate.nll_sum uses: runtime/evaluator.window_spans(len(ids), seq_len)."""
    from trainscale.runtime.evaluator import window_spans

    spans = window_spans(len(ids), seq_len)
    ctx = max(b - a - 1 for a, b in spans)  # the longest window's inputs, not the model's whole window: a KV cache
    llm = _llama(path, threads, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True)  # of 128K would not fit
    total, count = 0.0, 0
    try:
        for a, b in spans:
            x, y = ids[a:b - 1], np.asarray(ids[a + 1:b])
            llm.reset()
            llm.eval(x)
            logits = np.asarray(llm.scores[:len(x)], dtype=np.float64)
            top = logits.max(-1)
            lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
            total += float((lse - logits[np.arange(len(y)), y]).sum())
            count += len(y)
    finally:
        llm.close()
    return total, count


def _llama(path: str | Path, threads: int, **kw: Any) -> Any:
    """A ``llama_cpp.Llama`` on the file, its load log (context size notes) kept off the terminal."""
    from llama_cpp import Llama
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):
        return Llama(model_path=str(path), n_threads=threads, verbose=False, **kw)


@dataclass(frozen=True)
class GgufQuantResult:
    """``report``: what ``trainscale quantize --to gguf --json`` prints; ``path``: the GGUF file written."""

    report: dict[str, Any]
    path: Path


def quantize_gguf(checkpoint: str, s: GgufQuantSettings,
                  status: Callable[[str], AbstractContextManager[Any]] = quiet) -> GgufQuantResult:
    """Export ``checkpoint`` to f16 GGUF, quantize it with llama.cpp into ``s.out`` and measure it: types read
    back, tensor bytes vs the estimator, bits per weight, held-out perplexity of both files by llama.cpp, a
    sample generated by llama.cpp from the new file."""
    from trainscale.estimate.inference import gguf_tensor_bytes, gguf_tensor_types
    from trainscale.infer.gguf import export_gguf, gguf_layout
    from trainscale.infer.load import load_tokenizer_for, source_folder, spec_of
    from trainscale.runtime.artifact import beside, checkpoint_source, model_inputs

    kind = gguf_quant_type(s.type)
    ftype, base, _ = GGUF_QUANT_TYPES[kind]
    src = source_folder(checkpoint)
    out = Path(s.out) if s.out is not None else beside(src, f"-{kind.lower()}.gguf")
    if out.suffix.lower() != ".gguf":
        raise TrainscaleError(f"--out must be a .gguf file with --to gguf, not {out}")
    check_output(out, "--out", folder=False, inputs=model_inputs(src), not_at=(checkpoint,))
    spec = spec_of(src)
    threads = s.threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="trainscale-gguf-") as tmp:
        f16 = Path(tmp) / "f16.gguf"
        t0 = time.perf_counter()
        with status("f16 GGUF ..."):
            f16_rep = export_gguf(src, f16, "f16")
        with status(f"llama.cpp quantizing to {kind} ..."):
            llama_quantize(f16, out, kind, threads)
        secs = time.perf_counter() - t0
        read = gguf_types(out)
        layout = gguf_layout(out)
        predicted = gguf_tensor_types(spec, ftype)
        report: dict[str, Any] = {
            "source": str(src), "out": str(out), "to": "gguf", "type": kind, "seconds": secs, "threads": threads,
            "architecture": f16_rep["architecture"], "file_type": read["file_type"],
            "file": {**layout, "f16_file_bytes": f16_rep["file_bytes"],
                     "predicted_tensor_bytes": gguf_tensor_bytes(spec, ftype),
                     "bits_per_weight": 8 * layout["tensor_bytes"] / read["weights"]},
            "tensor_types": read["tensors"], "type_counts": _counts(read["tensors"]),
            "types_as_predicted": read["tensors"] == predicted,
            "fallbacks": _fallbacks(read, base), "published": published(kind),
        }
        report["file"]["tensor_bytes_equal"] = layout["tensor_bytes"] == report["file"]["predicted_tensor_bytes"]
        if (origin := checkpoint_source(src)) is not None:
            report["from_checkpoint"] = origin
        tok = load_tokenizer_for(src)
        text = held_out_text(src, tok, s, spec.vocab_size)
        report["perplexity"] = _perplexities(f16, out, kind, text, spec.max_seq_len, threads, s, status)
    if s.max_new_tokens:
        report["sample"] = _sample(out, tok, s, text, spec.max_seq_len, threads)
    return GgufQuantResult(report=report, path=out)


def _counts(types: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in types.values():
        out[t] = out.get(t, 0) + 1
    return dict(sorted(out.items()))


def _fallbacks(read: dict[str, Any], base: str) -> dict[str, str]:
    """Matrices whose rows are not whole blocks of ``base`` (256 weights for a K-quant) -> the type llama.cpp gave
    them instead, as read back."""
    from trainscale.estimate.inference import GGML_BLOCK

    block = GGML_BLOCK[base][1]
    return {name: t for name, t in read["tensors"].items()
            if t not in ("F32",) and read["row"][name] % block}


def _perplexities(f16: Path, out: Path, kind: str, text: Any, seq_len: int, threads: int, s: GgufQuantSettings,
                  status: Callable[[str], AbstractContextManager[Any]]) -> dict[str, Any]:
    if not s.eval_tokens:
        return {"text": "none (--eval-tokens 0)", "text_kind": "none"}
    ids = text.ids[:s.eval_tokens]
    with status("held-out perplexity by llama.cpp ..."):
        nll16, n16 = llama_cpp_nll(f16, ids, seq_len, threads)
        nllq, nq = llama_cpp_nll(out, ids, seq_len, threads)
    ppl16, pplq = math.exp(nll16 / n16), math.exp(nllq / nq)
    return {**text.report(), "tokens": len(ids), "scored": nq, "by": "llama.cpp", "f16": ppl16, kind: pplq,
            "ratio_vs_f16": pplq / ppl16, "change_vs_f16": pplq / ppl16 - 1, "increase_vs_f16": pplq - ppl16}


def _sample(out: Path, tok: Any, s: GgufQuantSettings, text: Any, seq_len: int, threads: int) -> dict[str, Any]:
    """llama.cpp's completion from the quantized file, the prompt given as our tokenizer's ids."""
    prompt = s.prompt if s.prompt is not None else default_prompt(tok, text.ids, room=seq_len - s.max_new_tokens)
    ids = tok.encode(prompt).ids
    if not ids or len(ids) >= seq_len:
        raise TrainscaleError(f"the prompt must be 1 to {seq_len - 1} tokens, not {len(ids)}")
    new = min(s.max_new_tokens, seq_len - len(ids))
    llm = _llama(out, threads, n_ctx=len(ids) + new, seed=s.seed)  # what the sample needs, not the whole window
    try:
        got = llm.create_completion(ids, max_tokens=new, temperature=0.8,
                                    top_p=0.95, seed=s.seed)
    finally:
        llm.close()
    return {"prompt": prompt, "prompt_default": s.prompt is None, "completion": got["choices"][0]["text"]}
