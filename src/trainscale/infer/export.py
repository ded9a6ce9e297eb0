"""Export a trainscale model to a Hugging Face folder of its family (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
Gemma 3 text, Phi-3, OLMo-2, Mixtral); infer/gguf.py writes the llama.cpp GGUF file, with the checks here
(``check_llama``, ``check_mixtral``).

RoPE layouts. trainscale rotates interleaved pairs (x[2i], x[2i+1]) of each head (infer/gguf.py says what each
llama.cpp architecture rotates). Hugging Face's Llama family rotates halves, so the HF export permutes each
head's rows of wq / wk (and their biases): names, row orders and config.json come from ``trainscale.hf``, the
one bridge (runtime/hf_init.py reads through it too).
Tests check both by logits / greedy continuations, not by reasoning.

Mixture of experts. A MoE in Mixtral's shape (every layer MoE, SwiGLU experts, no shared expert,
softmax over all experts then top-k renormalised to sum 1, no biases: what runtime/moe.py computes with
``router_norm_topk``) exports to both formats. Hugging Face: a MixtralForCausalLM folder in the layout of
the published Mixtral checkpoints, ``block_sparse_moe.gate.weight`` [E, d] and one
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` per expert (transformers 5 fuses them into its
``mlp.experts.gate_up_proj`` / ``down_proj`` when it loads them; MixtralTopKRouter is softmax, top-k,
renormalise). GGUF: llama.cpp's "llama" architecture with ``llama.expert_count`` /
``llama.expert_used_count``; the router is ``blk.N.ffn_gate_inp.weight`` and the experts are 3-D
``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (numpy [E, rows, cols], trainscale's own stacking),
and llama.cpp's llama graph gates by softmax, top-k, weights normalised. Any other MoE (shared experts,
dense leading layers, no renormalisation, GELU experts) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trainscale import hf
from trainscale.errors import TrainscaleError
from trainscale.infer.chatfiles import (
    GENERATION_CONFIG,
    ChatFiles,
    generation_config,
    hf_tokenizer_files,
    read_chat_files,
)
from trainscale.infer.load import load_for_inference, load_tokenizer_for
from trainscale.infer.quantize import safetensors_layout
from trainscale.safeio import atomic_write, atomic_write_bytes, atomic_write_json
from trainscale.specs import ModelSpec

MAX_TOKENIZER_BYTES = 256 << 20  # Llama 3's tokenizer.json is 9 MB, Gemma's 34 MB
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_llama(spec: ModelSpec, target: str, allow_bias: bool = False) -> None:
    bad = []
    if spec.mlp != "swiglu":
        bad.append(f"mlp={spec.mlp}")
    if spec.norm != "rmsnorm":
        bad.append(f"norm={spec.norm}")
    if spec.positions != "rope":
        bad.append(f"positions={spec.positions}")
    if spec.bias and not allow_bias:
        bad.append("bias=true")
    if bad:
        raise TrainscaleError(f"{target} export needs a Llama-style model (SwiGLU, RMSNorm, RoPE"
                              f"{'' if allow_bias else ', no biases'}); this one has {', '.join(bad)}")


def check_mixtral(spec: ModelSpec, target: str) -> None:
    """A MoE must be Mixtral-shaped to export: every layer MoE, no shared expert, top-k renormalised."""
    if not spec.is_moe:
        return
    bad = []
    if spec.d_ff_shared:
        bad.append("a shared expert")
    if spec.first_dense_layers:
        bad.append(f"{spec.first_dense_layers} dense leading layer(s)")
    if not spec.router_norm_topk:
        bad.append("top-k weights not renormalised (router_norm_topk=false)")
    if spec.capacity_factor:
        bad.append(f"capacity_factor={spec.capacity_factor}")
    if bad:
        raise TrainscaleError(f"{target} export writes a MoE as Mixtral (every layer MoE, no shared expert, top-k "
                              f"weights renormalised); this one has {', '.join(bad)}")


# ------------------------------------------------------------------------------------ Hugging Face


def hf_state_dict(sd: dict[str, torch.Tensor], spec: ModelSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our state dict under the ``hf.export_family`` names: experts one matrix each, Q / K rows rotate-half, the
    parts of a fused tensor (Phi-3's qkv_proj: Q, K, V; gate_up_proj: gate, up) one after the other."""
    family, out = hf.export_family(spec), {}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in sd.items():
        t = t.detach().float()
        experts = hf.expert_names(name, spec.n_experts, family)
        if experts is not None:  # [E, rows, cols] -> E matrices
            out.update({n: t[e].to(dtype).contiguous() for e, n in enumerate(experts)})
            continue
        heads = hf.rope_permuted_heads(name, spec)
        if heads is not None:
            t = hf.rope_interleaved_to_half(t, heads, spec.head_dim)
        hf_name, first, rows = hf.hf_place(name, family, spec)
        if rows:
            parts.setdefault(hf_name, []).append((first, t))
            if sum(p.shape[0] for _, p in parts[hf_name]) == rows:  # every part seen: the fused tensor, in order
                out[hf_name] = torch.cat([p for _, p in sorted(parts[hf_name], key=lambda x: x[0])]).to(dtype)
            continue
        out[hf_name] = t.to(dtype).contiguous()
    return out


# transformers 4's save_pretrained default (max_shard_size="5GB"): folders other tools expect in this shape
MAX_SHARD_BYTES = 5 * 10**9


def shard_tensors(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors cut, in order, into files of at most ``max_bytes`` each (a larger tensor alone in its file),
    as transformers' save_pretrained shards them."""
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if files[-1] and size + n > max_bytes:
            files.append({})
            size = 0
        files[-1][name] = t
        size += n
    return files


def write_safetensors(out: Path, sd: dict[str, torch.Tensor], max_bytes: int = MAX_SHARD_BYTES) -> dict[str, int]:
    """OUT/model.safetensors, or, above ``max_bytes``, OUT/model-0000i-of-0000N.safetensors and
    model.safetensors.index.json (``metadata.total_size``, ``weight_map`` tensor -> file: the layout
    transformers' save_pretrained writes and ``runtime/hf_init.py`` reads). -> the bytes written."""
    meta = {"format": "pt", "producer": "trainscale"}
    files = shard_tensors(sd, max_bytes)
    for stale in ("model.safetensors", "model.safetensors.index.json"):  # a folder exported before, other shape
        (out / stale).unlink(missing_ok=True)
    if len(files) == 1:
        atomic_write(out / "model.safetensors", lambda tmp: save_file(sd, str(tmp), metadata=meta))
        return safetensors_layout(out / "model.safetensors")
    weight_map, total = {}, {"file_bytes": 0, "header_bytes": 0, "tensor_bytes": 0}
    for i, part in enumerate(files, 1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        atomic_write(out / name, lambda tmp, part=part: save_file(part, str(tmp), metadata=meta))
        weight_map.update(dict.fromkeys(part, name))
        total = {k: v + safetensors_layout(out / name)[k] for k, v in total.items()}
    index = {"metadata": {"total_size": total["tensor_bytes"]}, "weight_map": weight_map}
    atomic_write_json(out / "model.safetensors.index.json", index)
    return {**total, "files": len(files)}


def export_hf(model_dir: str | Path, out: str | Path, dtype: str = "float32",
              max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write OUT/{config.json, generation_config.json, model.safetensors (or shards and their index),
    tokenizer.json, tokenizer_config.json, special_tokens_map.json} for transformers' class of the model's
    family (``hf.export_family``: Llama, Mistral, Qwen2, Qwen3; a MoE: MixtralForCausalLM)."""
    if dtype not in HF_DTYPES:
        raise TrainscaleError(f"HF export dtype must be one of {', '.join(HF_DTYPES)}, not {dtype!r}")
    model, spec, src = load_for_inference(model_dir)
    check_llama(spec, "Hugging Face", allow_bias=not spec.is_moe)
    check_mixtral(spec, "Hugging Face")
    hf.check_exportable(spec)
    chat = read_chat_files(src, load_tokenizer_for(src))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(model.state_dict(), spec, HF_DTYPES[dtype])
    layout = write_safetensors(out, sd, max_shard_bytes)
    config = hf.hf_config(spec, dtype, chat.eos_id)
    config["bos_token_id"] = generation_config(chat)["bos_token_id"]
    atomic_write_json(out / "config.json", config)
    atomic_write_json(out / GENERATION_CONFIG, generation_config(chat))
    write_tokenizer_files(out, src, chat, spec.max_seq_len)
    return {"out": str(out), "source": str(src), "dtype": dtype, "tensors": len(sd), **layout,
            "chat_template": chat.template is not None, "end_ids": list(chat.end_ids)}


def write_tokenizer_files(out: Path, src: Path, chat: ChatFiles, model_max_length: int) -> None:
    """OUT/tokenizer.json (the source's bytes), tokenizer_config.json (special tokens, chat template) and
    special_tokens_map.json: what transformers' AutoTokenizer and apply_chat_template read."""
    atomic_write_bytes(out / "tokenizer.json", (src / "tokenizer.json").read_bytes())
    (out / "chat_template.jinja").unlink(missing_ok=True)  # a folder exported before: the template is in the config
    for name, data in hf_tokenizer_files(chat, model_max_length).items():
        atomic_write_json(out / name, data)
