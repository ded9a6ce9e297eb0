"""Inference and quantized sizes: forward FLOPs, weight bytes, group-quantized and GGUF files."""

from __future__ import annotations

from math import ceil, prod

from trainscale.estimate.params import tensor_inventory
from trainscale.specs import ModelSpec


def inference_flops_per_token(n_params: float) -> float:
    """Forward pass only: 2 FLOPs per parameter per token (Kaplan et al. 2020, Sec. 2.1)."""
    return 2.0 * n_params


def weights_bytes(n_params: float, bits_per_weight: float) -> float:
    """Weights-only memory at a given precision."""
    return n_params * bits_per_weight / 8


def group_quant_bytes(numel: int, bits: int, group_size: int, scale_bytes: int = 2,
                      asymmetric: bool = False) -> float:
    """Group-wise quantization: ``bits`` per weight packed, plus one fp16 scale (and an fp16 zero
    point when asymmetric; infer/quantize.py stores the group minimum, as ggml's Q4_1 does) per group
    of ``group_size`` weights (e.g. Frantar et al. 2022, GPTQ; Dettmers et al. 2023, QLoRA Sec. 2)."""
    groups = ceil(numel / group_size)
    return numel * bits / 8 + groups * scale_bytes * (2 if asymmetric else 1)


QUANT_BITS = {"bf16": 16, "int8": 8, "int4": 4}


def quantized_model_bytes(m: ModelSpec, fmt: str, group_size: int = 32, asymmetric: bool = False) -> float:
    """Tensor bytes of a model quantized by trainscale's own format: every weight matrix (embeddings, output and
    each routed expert included) group-quantized along its rows; 1-D tensors (norms, biases)
    kept in bf16."""
    if fmt not in QUANT_BITS:
        raise ValueError(f"format must be one of {', '.join(QUANT_BITS)}, not {fmt!r}")
    total = 0.0
    for _, shape in tensor_inventory(m):
        n = prod(shape)
        if fmt == "bf16" or len(shape) == 1:
            total += 2 * n
        else:
            rows, cols = prod(shape[:-1]), shape[-1]  # a MoE's stacked experts: E x rows rows
            total += rows * group_quant_bytes(cols, QUANT_BITS[fmt], group_size, asymmetric=asymmetric)
    return total


# ggml block types: (bytes per block, weights per block) from ggml/src/ggml-common.h block structs.
GGML_BLOCK = {
    "F32": (4, 1),
    "F16": (2, 1),
    "Q8_0": (34, 32),  # block_q8_0: fp16 scale + 32 int8: 8.5 bpw
    "Q4_0": (18, 32),  # block_q4_0: fp16 scale + 32 x 4 bit
    "Q5_0": (22, 32),  # block_q5_0: fp16 scale + 4 bytes of 5th bits + 16 bytes of nibbles
    "Q5_1": (24, 32),  # block_q5_1: fp16 scale and min + 4 + 16 bytes
    "Q4_K": (144, 256),  # block_q4_K: 2 fp16 (d, dmin) + 12 bytes of 6-bit scales/mins + 128 bytes of nibbles: 4.5 bpw
    "Q5_K": (176, 256),  # block_q5_K: Q4_K's 144 bytes + 32 bytes of 5th bits (qh): 5.5 bpw
    "Q6_K": (210, 256),  # block_q6_K: 128 bytes low 4 bits + 64 bytes high 2 bits + 16 int8 scales + fp16 d: 6.5625 bpw
}
# trainscale's GGUF type names (export --type, quantize --to gguf --type in lower case) -> the ggml type of their
# matrices before llama.cpp's mix (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
GGUF_FTYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K",
               "q6_k": "Q6_K"}
# llama.cpp src/llama-quant.cpp tensor_type_fallback(): a K-quant's rows must be whole 256-weight super-blocks
# (QK_K); other rows take this 32-weight type instead (and F16 when they are not whole 32-weight blocks either)
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def bits_per_weight(ggml_type: str) -> float:
    nbytes, nweights = GGML_BLOCK[ggml_type]
    return 8 * nbytes / nweights


def gguf_name(name: str) -> str:
    """trainscale tensor name -> llama.cpp GGUF tensor name (gguf-py's TENSOR_NAMES; a bias keeps its leaf)."""
    fixed = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "output.weight": "output.weight", "pos_embeddings.weight": "position_embd.weight",
             # a MoE layer (llama.cpp's Mixtral tensors, gguf-py MODEL_TENSOR.FFN_GATE_INP / FFN_*_EXP): the
             # router and the routed experts stacked on their leading expert dim, one 3-D tensor each
             "moe.experts.w1": "ffn_gate_exps.weight", "moe.experts.w3": "ffn_up_exps.weight",
             "moe.experts.w2": "ffn_down_exps.weight"}
    if name in fixed:
        return fixed[name]
    _, i, *rest = name.split(".")
    sub = ".".join(rest)
    if sub in fixed:
        return f"blk.{i}.{fixed[sub]}"
    stem, _, leaf = sub.rpartition(".")
    table = {"attention_norm": "attn_norm", "ffn_norm": "ffn_norm", "attention.wq": "attn_q",
             "attention.wk": "attn_k", "attention.wv": "attn_v", "attention.wo": "attn_output",
             "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
             "moe.router": "ffn_gate_inp",
             # Qwen3's per-head Q/K norms, Gemma 2's norms on the attention's and the MLP's outputs
             "attention.q_norm": "attn_q_norm", "attention.k_norm": "attn_k_norm",
             "attention_post_norm": "post_attention_norm", "ffn_post_norm": "post_ffw_norm"}
    return f"blk.{i}.{table.get(stem, stem)}.{leaf}"


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp src/llama-quant.cpp use_more_bits(): first and last eighth of layers, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_tensor_types(m: ModelSpec, ftype: str, llama_cpp_mix: bool = True) -> dict[str, str]:
    """ggml type per GGUF tensor for a file type, following llama.cpp's llama_tensor_get_type() (src/llama-quant.cpp).

    f32 / f16: matrices F32 / F16; q8_0 / q4_0 / q4_k_m / q5_k_m / q6_k: matrices of that base type (Q4_K, Q5_K,
    Q6_K for the K-quants), then llama.cpp's mix: output.weight (token_embd when the head is tied) Q6_K unless the
    base is Q8_0 (Q8_0 when its rows are not whole blocks of the base); for q4_k_m / q5_k_m Q6_K attn_v and
    ffn_down(_exps) in the layers use_more_bits() picks; an 8-expert MoE gets Q8_0 attn_v and attn_k in every
    quantized type (llama.cpp's Mixtral rule) and Q5_K attn_output in q4_k_m. Norms are F32 throughout, and so is a
    MoE router (ffn_gate_inp: llama.cpp's convert_hf_to_gguf.py writes it F32 and its quantizer skips it).
    Routed experts are 3-D [E, rows, cols] tensors quantized row by row like a matrix. A row that is not a whole
    number of its type's blocks falls back (``K_FALLBACK``, then F16). With ``llama_cpp_mix`` off, every matrix
    gets the base type and F16 as its fallback (what trainscale's own writer does).
    """
    base = GGUF_FTYPES.get(ftype)
    if base is None:
        raise ValueError(f"GGUF type must be one of {', '.join(GGUF_FTYPES)}, not {ftype!r}")
    inventory = [(gguf_name(name), shape) for name, shape in tensor_inventory(m)]
    tied = all(g != "output.weight" for g, _ in inventory)
    out: dict[str, str] = {}
    for g, shape in inventory:
        if len(shape) == 1 or g.endswith("ffn_gate_inp.weight"):
            out[g] = "F32"
            continue
        quantized = base not in ("F16", "F32")
        t = _llama_cpp_mix(m, ftype, base, g, shape[-1], tied) if llama_cpp_mix and quantized else base
        if shape[-1] % GGML_BLOCK[t][1]:  # row not a whole number of blocks: llama.cpp falls back
            t = K_FALLBACK.get(t, "F16") if llama_cpp_mix else "F16"
            t = "F16" if shape[-1] % GGML_BLOCK[t][1] else t
        out[g] = t
    if m.rope_scaling == "llama3":  # convert_hf_to_gguf.py's LlamaModel: RoPE's per-frequency divisors, F32
        out["rope_freqs.weight"] = "F32"
    return out


def _llama_cpp_mix(m: ModelSpec, ftype: str, base: str, g: str, cols: int, tied: bool) -> str:
    """llama_tensor_get_type_impl() for one matrix of a quantized file type (the rules that touch our tensors)."""
    if g == "output.weight" or (tied and g == "token_embd.weight"):  # the head (a tied head: its embeddings)
        if cols % GGML_BLOCK[base][1]:
            return "Q8_0"
        return base if base == "Q8_0" else "Q6_K"
    layer = int(g.split(".")[1]) if g.startswith("blk.") else -1
    if g.endswith(("attn_v.weight", "attn_k.weight")) and m.n_experts == 8:
        return "Q8_0"  # llama-quant.cpp: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    if ftype in ("q4_k_m", "q5_k_m") and g.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        return "Q6_K" if _use_more_bits(layer, m.n_layers) else base
    if ftype == "q4_k_m" and g.endswith("attn_output.weight") and m.n_experts == 8:
        return "Q5_K"
    return base


def gguf_tensor_bytes(m: ModelSpec, ftype: str, llama_cpp_mix: bool = True) -> float:
    """Bytes of tensor data in a GGUF file: sum over tensors of numel x bytes-per-weight of its type."""
    types = gguf_tensor_types(m, ftype, llama_cpp_mix)
    total = 0.0
    for name, shape in tensor_inventory(m):
        nbytes, nweights = GGML_BLOCK[types[gguf_name(name)]]
        total += prod(shape) * nbytes / nweights
    if "rope_freqs.weight" in types:
        total += 4 * (m.head_dim // 2)
    return total
