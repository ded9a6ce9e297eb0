"""Export a trainscale model to a llama.cpp GGUF file, in the llama.cpp architecture of its family.

Families and architectures (what llama.cpp's convert_hf_to_gguf.py writes for each Hugging Face class, and what
llama.cpp's graph for that architecture computes; tests/test_infer_gguf_families.py checks the logits):

- Llama 1-3.x, Mistral and our own models -> "llama". RoPE "linear" is ``rope.scaling.type`` = linear with its
  ``rope.scaling.factor`` (llama.cpp divides every position by it); "llama3" is the ``rope_freqs.weight`` tensor,
  one divisor per frequency (convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: 1 for the high
  frequencies, the factor for the low ones, blended between), which llama.cpp's llama graph hands to
  ggml_rope_ext as its frequency factors; "yarn" (here and in qwen2) is ``rope.scaling.type`` = yarn with its factor,
  original context length and yarn_beta_fast / _slow, and llama.cpp's own attention factor 0.1 ln(factor) + 1
  (another, or truncate = false, is refused). A tied model has no ``output.weight`` (llama.cpp then uses
  token_embd). Mistral's sliding window has no key in llama.cpp's llama: a window shorter than the context is
  refused, one as long as it changes nothing and is left out. A Mixtral-shaped MoE is llama with experts
  (``llama.expert_count``: see infer/export.py's docstring).
- Qwen2/2.5 -> "qwen2" (its Q/K/V biases), Qwen3 -> "qwen3" (``attn_q_norm`` / ``attn_k_norm``).
- Gemma -> "gemma" and Gemma 2 -> "gemma2": llama.cpp scales the embeddings by sqrt(d_model) itself, computes
  GeGLU with ggml's tanh GELU, and reads each RMSNorm gain as stored, so the file holds 1 + w (convert_hf_to_gguf's
  GemmaModel / Gemma2Model add the 1); the head is always token_embd. Gemma 2 adds ``post_attention_norm`` /
  ``post_ffw_norm``, ``attn_logit_softcapping``, ``final_logit_softcapping`` and ``attention.sliding_window``,
  the window on the even layers (llama.cpp's gemma2: swa pattern 2). llama.cpp scales its queries by
  head_dim^-0.5 (d_model / n_heads for a 46-layer model, Gemma 2 27B) instead of reading
  query_pre_attn_scalar, and always soft-caps: a model that differs is refused.

RoPE rows. trainscale rotates interleaved pairs (x[2i], x[2i+1]) of each head, as llama.cpp's llama graph does
(rope type NORM), so "llama" gets wq / wk unchanged. llama.cpp runs qwen2, qwen3, gemma and gemma2 with rope type
NEOX, which rotates halves (x[i], x[i + d/2]) as Hugging Face does, and their converters copy Hugging Face's rows
unpermuted: those files get each head's Q / K rows (biases, Qwen3's per-head norm gains) in Hugging Face's order,
``hf.rope_interleaved_to_half``.

The file is written directly with ``gguf.GGUFWriter`` (llama.cpp's converter only accepts tokenizers it knows by
hash): tokenizer.ggml.model = "gpt2" (byte-level BPE) with the tokens, token types and merges of the run's
tokenizer.json, tokenizer.ggml.pre = "gpt-2" (GPT-2's pre-tokenizer regex, what tokenizers'
ByteLevel(use_regex=True) applies). Tensor types come from ``estimate.inference.gguf_tensor_types(...,
llama_cpp_mix=False)``: every matrix in the chosen type (ggml's F16 fallback for rows that are not a whole
number of blocks), norms, biases and rope_freqs in F32. Q8_0 / Q4_0 blocks are made by ``gguf.quants`` (a numpy
port of ggml's reference quantizers).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainscale import hf
from trainscale.errors import TrainscaleError
from trainscale.estimate.inference import gguf_name, gguf_tensor_types
from trainscale.infer.chatfiles import ChatFiles, read_chat_files
from trainscale.infer.export import MAX_TOKENIZER_BYTES, check_llama, check_mixtral
from trainscale.infer.load import load_for_inference, load_tokenizer_for
from trainscale.safeio import read_json_object
from trainscale.specs import ModelSpec

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
# ModelSpec.family -> llama.cpp's architecture (convert_hf_to_gguf.py: LlamaForCausalLM and MistralForCausalLM
# are LlamaModel, MODEL_ARCH.LLAMA; Qwen2ForCausalLM QWEN2, Qwen3ForCausalLM QWEN3, GemmaForCausalLM GEMMA,
# Gemma2ForCausalLM GEMMA2)
ARCHITECTURES = {"": "llama", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma": "gemma", "gemma2": "gemma2"}
# llama.cpp's llama_model_rope_type(): these rotate halves (LLAMA_ROPE_TYPE_NEOX); llama rotates pairs (NORM)
NEOX = ("qwen2", "qwen3", "gemma", "gemma2")
GEMMA2_27B_LAYERS = 46  # llama.cpp's gemma2 hparams: 46 layers is LLM_TYPE_27B, whose queries it scales differently


def gguf_architecture(spec: ModelSpec) -> str:
    """The llama.cpp architecture our model is written as: its family's (a MoE: llama)."""
    if not spec.is_moe and spec.family not in ARCHITECTURES:
        raise TrainscaleError(f"GGUF export does not write {spec.family} models yet; export --to hf does")
    return "llama" if spec.is_moe else ARCHITECTURES[spec.family]


def gemma2_query_scalar(spec: ModelSpec) -> int:
    """What llama.cpp's gemma2 divides each query by the square root of: head_dim, or for a 46-layer model (Gemma 2
    27B) n_embd / n_head in integer arithmetic (llama.cpp, after gemma_pytorch's config.py)."""
    return spec.d_model // spec.n_heads if spec.n_layers == GEMMA2_27B_LAYERS else spec.head_dim


def _window_matters(spec: ModelSpec) -> bool:
    return 0 < spec.sliding_window < spec.max_seq_len


def _unsaid(spec: ModelSpec, arch: str) -> list[str]:
    """What of the model llama.cpp's ``arch`` cannot say (each a phrase), [] when the file computes it exactly."""
    bad = []
    gemma = arch in ("gemma", "gemma2")
    if spec.qkv_bias and arch != "qwen2":
        bad.append("biases on Q/K/V only (Qwen2's)")
    if spec.qk_norm and arch != "qwen3":
        bad.append("per-head Q/K norms (Qwen3's)")
    if spec.rope_scaling == "llama3" and arch != "llama":
        bad.append("RoPE scaling 'llama3' (llama.cpp applies rope_freqs in its llama graph only)")
    if spec.rope_scaling == "yarn" and not spec.rope_truncate:
        bad.append("YaRN with truncate = false (llama.cpp's ggml_rope_yarn_corr_dims always rounds the ramp's ends)")
    if spec.rope_scaling == "yarn" and spec.rope_attention_factor is not None and not math.isclose(
            spec.rope_attention_factor, 1.0 if spec.rope_factor <= 1 else 0.1 * math.log(spec.rope_factor) + 1):
        bad.append("a YaRN attention factor other than 0.1 ln(factor) + 1 (llama.cpp's versions disagree on the key "
                   "that carries another: yarn_attn_factor before llama.cpp PR 17945, rope.scaling.attn_factor after)")
    trio = (spec.norm_offset, spec.embed_scale, spec.gate_act == "gelu_tanh")
    if any(trio) and not gemma:
        bad.append("Gemma's (1 + w) norms, sqrt(d)-scaled embeddings or GeGLU")
    if gemma and not (all(trio) and spec.tied_embeddings):
        bad.append("a Gemma without all of its (1 + w) norms, scaled tied embeddings and GeGLU")
    g2 = (spec.sandwich_norms, spec.attn_softcap, spec.final_softcap, spec.query_scale)
    if any(g2) and arch != "gemma2":
        bad.append("Gemma 2's output norms, soft-capping or query_pre_attn_scalar")
    if arch == "gemma2":
        if not (spec.sandwich_norms and spec.attn_softcap and spec.final_softcap):
            bad.append("a Gemma 2 without its output norms and both soft-caps (llama.cpp's gemma2 always caps)")
        scalar = gemma2_query_scalar(spec)
        if (spec.query_scale or spec.head_dim) != scalar:
            bad.append(f"query_pre_attn_scalar {spec.query_scale or spec.head_dim:g} (llama.cpp's gemma2 scales "
                       f"queries by {scalar}^-0.5 for this shape)")
        layers = set(range(spec.n_layers)) if spec.window_layers is None else set(spec.window_layers)
        if _window_matters(spec) and layers != set(range(0, spec.n_layers, 2)):
            bad.append(f"a sliding window on layers {sorted(layers)} (llama.cpp's gemma2 puts it on the even ones)")
    elif _window_matters(spec):
        bad.append(f"a sliding window of {spec.sliding_window} tokens, shorter than its context of "
                   f"{spec.max_seq_len} (llama.cpp's {arch} has no window key)")
    if spec.is_moe and spec.family not in ("", "llama"):
        bad.append(f"experts in a {spec.family} model (llama.cpp takes a Mixtral-shaped MoE as llama)")
    return bad


def check_gguf(spec: ModelSpec) -> str:
    """The llama.cpp architecture the model is written as, when the file computes what our model computes; one
    sentence naming what it would drop otherwise."""
    arch = gguf_architecture(spec)
    check_llama(spec, "GGUF", allow_bias=arch == "llama" and not spec.is_moe)  # llama.cpp's llama: optional biases
    check_mixtral(spec, "GGUF")
    bad = _unsaid(spec, arch)
    if bad:
        raise TrainscaleError(f"GGUF export writes a {spec.family or 'llama'} model as llama.cpp's {arch} "
                              f"architecture, which cannot hold {'; '.join(bad)}; export --to hf keeps them")
    return arch


def rope_freq_factors(spec: ModelSpec) -> np.ndarray:
    """``rope_freqs.weight`` for RoPE scaling "llama3": per frequency, the unscaled inverse frequency over the
    scaled one (runtime.model.rope_frequencies, the one formula), fp32 [head_dim / 2]. These are the divisors
    convert_hf_to_gguf.py's LlamaModel writes (1 above the high-frequency cutoff, the factor below the low one,
    1 / ((1 - s) / factor + s) between) and llama.cpp divides each rotation angle by."""
    from trainscale.runtime.model import rope_frequencies

    scaled = rope_frequencies(spec).double()
    plain = rope_frequencies(spec.model_copy(update={"rope_scaling": "none"})).double()
    return (plain / scaled).numpy().astype(np.float32)


def gguf_tensors(sd: dict[str, torch.Tensor], spec: ModelSpec, arch: str) -> dict[str, np.ndarray]:
    """Our state dict as the GGUF file's fp32 arrays under llama.cpp's names: Q / K rows (and biases, per-head norm
    gains) in rotate-half order for a NEOX architecture, Gemma's norm gains as 1 + w, ``rope_freqs`` for llama3."""
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        t = t.detach().float().cpu()
        heads = hf.rope_permuted_heads(name, spec) if arch in NEOX else None
        if heads is not None:
            t = hf.rope_interleaved_to_half(t, heads, spec.head_dim)
        if spec.norm_offset and name.endswith("norm.weight"):  # RMSNorm's gain is 1 + w (runtime/model.py)
            t = 1.0 + t
        out[gguf_name(name)] = t.contiguous().numpy()
    if spec.rope_scaling == "llama3":
        out["rope_freqs.weight"] = rope_freq_factors(spec)
    return out


def tokenizer_vocab(tokenizer_json: Path) -> dict[str, Any]:
    """Tokens by id, token types (control for added special tokens) and merges as "a b" strings."""
    data = read_json_object(tokenizer_json, "tokenizer file", limit=MAX_TOKENIZER_BYTES)
    model = data.get("model")
    if not isinstance(model, dict):
        raise TrainscaleError(f"{tokenizer_json} is not a tokenizers file (no model object)")
    if model.get("type") != "BPE":
        raise TrainscaleError(f"GGUF export needs a byte-level BPE tokenizer, not {model.get('type')}")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    vocab.update(special)
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    if "" in tokens:
        raise TrainscaleError(f"{tokenizer_json} has gaps in its token ids")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    types = [3 if t in special else 1 for t in tokens]  # gguf.TokenType: 1 NORMAL, 3 CONTROL
    return {"tokens": tokens, "types": types, "merges": merges, "special": special}


def _write_hparams(w: Any, spec: ModelSpec, arch: str) -> None:
    """The architecture's keys (llama.cpp's LLM_KV_* names under ``{arch}.``)."""
    import gguf

    w.add_name(spec.name)
    w.add_context_length(spec.max_seq_len)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.expert_width if spec.is_moe else spec.d_ff)  # llama.cpp's n_ff: the experts'
    if spec.is_moe:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.experts_per_token)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    if spec.rope_scaling == "linear":  # llama.cpp: freq_scale = 1 / factor, every position divided by it
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_factor)
    if spec.rope_scaling == "yarn":  # convert_hf_to_gguf.py's keys; the attention factor is llama.cpp's own default
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.rope_factor)
        w.add_rope_scaling_orig_ctx_len(spec.rope_original_max_len)
        w.add_rope_scaling_yarn_beta_fast(spec.rope_beta_fast)
        w.add_rope_scaling_yarn_beta_slow(spec.rope_beta_slow)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(spec.attn_softcap)
        w.add_final_logit_softcapping(spec.final_softcap)
        # no window (0) or one at least as long as the context: the context itself, which changes nothing there
        w.add_sliding_window(spec.sliding_window if _window_matters(spec) else spec.max_seq_len)
    w.add_vocab_size(spec.vocab_size)


def _added_specials(tokenizer: Any) -> tuple[bool, bool]:
    """Whether the tokenizer itself puts a token before / after the text (its tokenizer.json post-processor, as
    Llama 3's adds <|begin_of_text|>): llama.cpp's add_bos / add_eos flags, so its plain tokenization matches."""
    probe = "a"
    bare, full = tokenizer.encode(probe, add_special_tokens=False).ids, tokenizer.encode(probe).ids
    if not bare or len(full) <= len(bare):
        return False, False
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
    return at > 0, at + len(bare) < len(full)


def _write_tokenizer(w: Any, voc: dict[str, Any], chat: ChatFiles, tokenizer: Any) -> None:
    """The vocabulary, merges and token types; the special ids and the chat template of the folder
    (infer/chatfiles.py), so llama.cpp's chat completion renders and stops as transformers does."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(voc["tokens"])
    w.add_token_types(voc["types"])
    w.add_token_merges(voc["merges"])
    if chat.eos_id is not None:
        w.add_bos_token_id(chat.bos_id if chat.bos_id is not None else chat.eos_id)
        w.add_eos_token_id(chat.eos_id)
    if chat.template is not None and chat.eos_id is not None:
        w.add_eot_token_id(chat.eos_id)  # a chat model's eos_token is its end of turn
    if chat.template is not None:
        w.add_chat_template(chat.template)
    bos, eos = _added_specials(tokenizer)
    w.add_add_bos_token(bos)
    w.add_add_eos_token(eos)


def export_gguf(model_dir: str | Path, out: str | Path, ftype: str = "f16") -> dict[str, Any]:
    """Write OUT (a .gguf file) for llama.cpp: the model in its family's architecture (``check_gguf``), the run's
    tokenizer, every matrix in ``ftype`` (f32, f16, q8_0, q4_0). -> sizes read back and the architecture."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    if ftype not in GGUF_TYPES:
        raise TrainscaleError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, not {ftype!r}")
    model, spec, src = load_for_inference(model_dir)
    arch = check_gguf(spec)
    tok_path = src / "tokenizer.json"
    if not tok_path.exists():
        raise TrainscaleError(f"{src} has no tokenizer.json; GGUF files carry their tokenizer")
    voc = tokenizer_vocab(tok_path)
    if len(voc["tokens"]) != spec.vocab_size:
        raise TrainscaleError(f"the tokenizer has {len(voc['tokens'])} tokens but the model's vocab_size is "
                              f"{spec.vocab_size}")
    types = gguf_tensor_types(spec, ftype, llama_cpp_mix=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[ftype]
    w = gguf.GGUFWriter(str(out), arch)
    _write_hparams(w, spec, arch)
    w.add_file_type(file_type)
    tokenizer = load_tokenizer_for(src)
    _write_tokenizer(w, voc, read_chat_files(src, tokenizer), tokenizer)
    for g, arr in gguf_tensors(model.state_dict(), spec, arch).items():
        kind = types[g]
        if kind == "F32":
            w.add_tensor(g, arr.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(g, arr.astype(np.float16))
        else:
            qt = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0}[kind]
            w.add_tensor(g, gguf.quants.quantize(arr.astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"out": str(out), "source": str(src), "type": ftype, "architecture": arch, **gguf_layout(out)}


def gguf_layout(path: str | Path) -> dict[str, int]:
    """Bytes of a GGUF file read back: header + metadata + tensor infos, tensor data, alignment padding."""
    import gguf

    r = gguf.GGUFReader(str(path))
    tensor_bytes = sum(int(t.n_bytes) for t in r.tensors)
    size = Path(path).stat().st_size
    return {"file_bytes": size, "header_bytes": int(r.data_offset), "tensor_bytes": tensor_bytes,
            "padding_bytes": size - int(r.data_offset) - tensor_bytes, "tensors": len(r.tensors)}
