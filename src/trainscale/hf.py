"""The one Hugging Face bridge: a folder's ``config.json`` <-> the fields of a ModelSpec, and the names and
row orders of the tensors between trainscale's model and Hugging Face checkpoints.

Readers: ``specs.load_model`` (a config.json for the planner; every ``model_type`` in ``CONFIG_KEYS``),
``runtime/hf_init.py`` (a folder's weights into the model, slice by slice; the families with ``loads``),
``infer/export.py`` (our model written as a Hugging Face folder; the family ``export_family`` names).

This module sits beside ``specs.py`` and below it (specs reads config.json through it), so it imports neither
specs nor torch: it returns field dicts, takes a ModelSpec as anything with its attributes (``ModelShape``),
and permutes rows of a torch tensor or a numpy array alike. A new family is data: one ``CONFIG_KEYS`` entry
for its config.json, one ``FAMILIES`` entry for its tensor names, and what it adds to the Llama block as
ModelSpec fields (``family_fields``; runtime/model.py computes them).

Families the runtime loads and export writes back, each computed as transformers computes it (fp32 logits
equal to 1e-5, tests/test_hf_families.py, tests/test_hf_rope_scaling.py): Llama 1-3.x (RoPE unscaled, "linear",
"llama3" or "yarn"; tied embeddings), Mistral (its sliding window), Qwen2/2.5 (Q/K/V biases; "yarn" as Qwen2.5's
long-context configs set it), Qwen3 (per-head Q/K RMSNorm), Gemma ((1 + w) RMSNorm,
sqrt(d)-scaled tied embeddings, GeGLU) and Gemma 2 (with output norms, soft-capped scores and logits,
query_pre_attn_scalar, the window on alternate layers), Gemma 3's text model (Gemma 2's block with per-head Q/K
norms, the window on the layers layer_types names, those layers' own unscaled RoPE base), Phi-3 / Phi-4 (Q/K/V in
one qkv_proj and gate / up in one gate_up_proj: ``Family.fused``, ``hf_place``), OLMo-2 (norms after attention and
the MLP only, Q/K norms over the whole projections). Refused in one sentence (``check_loadable``): other model
types, partial rotary (Phi-4-mini), RoPE "longrope" and "dynamic" (transformers
recomputes its frequencies per forward from the longest sequence seen, a state a fixed RoPE cannot hold), Qwen's
per-layer sliding window, biases that trainscale's one ``bias`` switch does not express.

RoPE. trainscale rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's original Llama code does;
Hugging Face's Llama-family models rotate (x[i], x[i + d/2]) (``rotate_half`` in transformers'
modeling_llama.py), so the HF form of each head's Q and K rows (and biases) is permuted: new row i <- old row
2i, new row d/2 + i <- old row 2i + 1, the permutation of transformers' convert_llama_weights_to_hf.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainscale.errors import TrainscaleError

# ------------------------------------------------------------------------------------ config.json -> fields

# How each ``model_type`` names the fields a ModelSpec needs (transformers' configuration_*.py); {}: Llama's
# names (``_LLAMA_KEYS``).
CONFIG_KEYS: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {}, "mixtral": {}, "qwen2_moe": {},
    "qwen3_moe": {}, "phi3": {}, "olmo2": {}, "gemma3_text": {},
    "deepseek_v2": {}, "deepseek_v3": {},
    "gpt2": {"n_layers": "n_layer", "d_model": "n_embd", "n_heads": "n_head", "d_ff": "n_inner",
             "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon"},
    "gpt_neox": {"norm_eps": "layer_norm_eps", "rope_pct": "rotary_pct"},
    "opt": {"d_ff": "ffn_dim", "norm_eps": None},
    "bloom": {"n_layers": "n_layer", "n_heads": "n_head", "norm_eps": "layer_norm_epsilon"},
    "mpt": {"n_layers": "n_layers", "d_model": "d_model", "n_heads": "n_heads", "max_seq_len": "max_seq_len"},
}
_LLAMA_KEYS = {"n_layers": "num_hidden_layers", "d_model": "hidden_size", "n_heads": "num_attention_heads",
               "d_ff": "intermediate_size", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps"}
_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe",
                "deepseek_v2", "deepseek_v3", "phi3", "olmo2", "gemma3_text")
GEMMAS = ("gemma", "gemma2", "gemma3_text")
_INTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "max_position_embeddings", "head_dim")
MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few kilobytes
MAX_JSON_DEPTH = 32  # a config.json nests 3 deep (rope_scaling, quantization_config...); Python's json recurses


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count), read without
    recursion: a file of 100,000 '[' is a number here, not a RecursionError in ``json.loads``."""
    import itertools
    import re

    brackets = re.sub(r'[^\[\]{}]', "", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))
    steps = (1 if c in "[{" else -1 for c in brackets)
    return max(itertools.accumulate(steps), default=0)


def read_json_bounded(path: str | Path, what: str, limit: int) -> dict[str, Any]:
    """The JSON object in ``path`` (safeio's checks: a small regular UTF-8 file holding an object), its nesting
    bounded by ``MAX_JSON_DEPTH``: one sentence otherwise."""
    import json

    from trainscale.safeio import read_text

    text = read_text(path, what, limit)
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise TrainscaleError(f"{what} {path} nests {depth} levels deep; trainscale reads at most {MAX_JSON_DEPTH}")
    try:
        got = json.loads(text)
    except ValueError as e:
        raise TrainscaleError(f"{what} {path} is not valid JSON ({e})") from None
    if not isinstance(got, dict):
        raise TrainscaleError(f"{what} {path} is not a JSON object (it holds a {type(got).__name__})")
    return got


def read_config(path: str | Path) -> dict[str, Any]:
    """A config.json, checked at the edge: a regular file (a FIFO would block), UTF-8 JSON nested at most
    ``MAX_JSON_DEPTH`` deep, an object whose size fields, where given, are positive integers (a 0 or a string
    would divide by zero or fail deep inside)."""
    cfg = read_json_bounded(path, "model file", MAX_CONFIG_BYTES)
    for key in _INTS:
        config_int(cfg, key, path)
    return cfg


MAX_INDEX_BYTES = 64 << 20  # a 405B model's index names ~2,000 tensors in ~100 kB


def read_index(path: str | Path) -> dict[str, str]:
    """A sharded folder's ``model.safetensors.index.json``: its ``weight_map``, tensor name -> the name of a
    ``.safetensors`` file in the same folder (no folder part, so no path leads outside it); one sentence
    otherwise."""
    got = read_json_bounded(path, "safetensors index", MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(got, dict):
        raise TrainscaleError(f"{path} is not a safetensors index (no weight_map object)")
    for name, file in got.items():
        if not isinstance(file, str) or not _plain_file_name(file):
            raise TrainscaleError(f"{path}: the tensor {name!r} is mapped to {file!r}, which is not the name of a "
                                  ".safetensors file in the folder")
    return dict(got)


def _plain_file_name(name: str) -> bool:
    """A file name alone (no '/', '\\', '..', NUL or leading '.') ending in .safetensors."""
    return (name.endswith(".safetensors") and Path(name).name == name and "\\" not in name and "\0" not in name
            and not name.startswith(".") and len(name) <= 255)


def config_int(cfg: dict[str, Any], key: str, path: str | Path, default: Any = None, least: int = 1) -> Any:
    """``cfg[key]`` as an integer of at least ``least`` (``default`` where absent or null); one sentence
    naming the file and the key otherwise (a bool, a float, a string, a negative)."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        kind = "a positive" if least == 1 else "a non-negative"
        raise TrainscaleError(f"model file {path}: {key} must be {kind} integer, not {v!r}")
    return v


def _sub(cfg: dict[str, Any], key: str, path: str | Path = "config.json") -> dict[str, Any]:
    """A nested object of the config (rope_scaling, rope_parameters), {} when absent or null; one sentence
    naming the file and the key when it is something else (a list, a string: never dropped without a word)."""
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TrainscaleError(f"model file {path}: {key} must be an object, not {v!r}")
    return v


# transformers' default rms_norm_eps / layer_norm_eps per model_type where config.json does not give it
# (configuration_*.py: 1e-6 in Llama, Mistral, Qwen2/3, Gemma 1-3 and their MoEs; 1e-5 in Mixtral, Phi-3, OLMo-2 and
# the GPT-style families, whose LayerNorm default it is)
_EPS_1E5 = ("mixtral", "phi3", "olmo2", "gpt2", "gpt_neox", "opt", "bloom", "mpt")


def norm_eps(cfg: dict[str, Any], mt: str, key: str | None, path: str | Path) -> float:
    """The norms' epsilon: ``cfg[key]`` when given, a positive number (0 or a string is one sentence: transformers
    would divide by sqrt(0) where a token is all zeros), else the family's transformers default."""
    v = cfg.get(key) if key else None
    if v is None:
        return 1e-5 if mt in _EPS_1E5 else 1e-6
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
        raise TrainscaleError(f"model file {path}: {key} must be a number in (0, 1], not {v!r}")
    return float(v)


def spec_fields(cfg: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The ModelSpec fields of a config.json read by its ``model_type``: Llama-style (llama, mistral, qwen2,
    qwen3), mixture-of-experts (mixtral, qwen2_moe, qwen3_moe, deepseek_v2/v3 with their multi-head latent
    attention), GPT-style (gpt2, gpt_neox, opt, bloom, mpt). An unknown type is refused."""
    mt = cfg.get("model_type")
    if mt not in CONFIG_KEYS:
        raise TrainscaleError(f"model file {path} has model_type {mt!r}, which trainscale does not read; known: "
                              f"{', '.join(sorted(CONFIG_KEYS))}")
    llama = mt in _LLAMA_TYPES
    keys = {**_LLAMA_KEYS, **CONFIG_KEYS[mt]}
    if mt == "mpt":
        cfg = {**cfg, "d_ff": cfg.get("d_model", 0) * cfg.get("expansion_ratio", 4)}
        keys["d_ff"] = "d_ff"
    if mt in ("gpt2", "bloom") and not cfg.get(keys.get("d_ff", "")):
        keys["d_ff"] = "_d_ff"
        cfg = {**cfg, "_d_ff": 4 * cfg.get(keys["d_model"], 0)}  # GPT-2 and BLOOM: n_inner = 4 x hidden
    missing = [keys[k] for k in ("n_layers", "d_model", "n_heads", "d_ff") if keys.get(k) not in cfg]
    if missing or "vocab_size" not in cfg:
        raise TrainscaleError(f"model file {path} ({mt}) lacks the fields {', '.join(missing or ['vocab_size'])}")
    act = str(cfg.get("hidden_act") or cfg.get("activation_function") or ("silu" if llama else "gelu"))
    if mt in GEMMAS:  # a gated MLP whatever its activation (GeGLU: family_fields)
        act = "silu"
    heads = cfg[keys["n_heads"]]
    eps_key = keys.get("norm_eps")
    data = {
        "name": cfg.get("_name_or_path") or Path(path).parent.name or "hf-model",
        "source": f"Hugging Face config.json, model_type {mt} ({path})",
        "n_layers": cfg[keys["n_layers"]],
        "d_model": cfg[keys["d_model"]],
        "n_heads": heads,
        "n_kv_heads": (cfg.get("num_key_value_heads") or heads) if llama else heads,
        "d_ff": cfg[keys["d_ff"]],
        "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg.get(keys.get("max_seq_len") or "", 2048) or 2048,
        "mlp": "swiglu" if act in ("silu", "swish") else "gelu",
        "norm": "rmsnorm" if llama else "layernorm",
        # GPT-2 and OPT learn absolute positions; NeoX rotates (partial rotary changes no parameter or GEMM
        # shape); BLOOM and MPT use ALiBi, which has no parameters and no GEMM, like RoPE (trainscale's
        # runtime would build RoPE for them)
        "positions": "learned" if mt in ("gpt2", "opt") else "rope",
        # newer configs (transformers 5) keep the base under rope_parameters
        "rope_theta": rope_theta(cfg, path),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings",
                                        mt in ("gpt2", "bloom", "mpt", "opt", *GEMMAS))),
        "bias": bool(cfg.get("attention_bias", False)) if llama else not cfg.get("no_bias", False),
        "norm_eps": norm_eps(cfg, mt, eps_key, path),
    }
    if llama and cfg.get("head_dim") and cfg["head_dim"] != cfg["hidden_size"] // heads:
        data["head_dim"] = cfg["head_dim"]
    data.update(moe_fields(cfg, mt, path))
    data.update(family_fields(cfg, mt, path))
    return data


def rope_settings(cfg: dict[str, Any], path: str | Path = "config.json") -> dict[str, Any]:
    """The RoPE scaling object of a config: ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5), with its type under ``rope_type`` (or the older ``type``); {"rope_type": "default"} when
    neither scales. Either key holding something else than an object or null, a type that is not a string, or
    ``rope_parameters`` given per layer type (Gemma 3's {"full_attention": {...}, "sliding_attention": {...}}) is
    one sentence naming the file and the key."""
    if cfg.get("model_type") == "gemma3_text":
        return gemma3_rope(cfg, path)[0]
    for key in ("rope_scaling", "rope_parameters"):
        got = _sub(cfg, key, path)
        nested = [k for k, v in got.items() if isinstance(v, dict)]
        if nested:
            raise TrainscaleError(f"model file {path}: {key} gives RoPE per layer type ({', '.join(nested)}), which "
                                  "trainscale does not read (one RoPE for every layer)")
        kind = got.get("rope_type", got.get("type"))
        if kind is not None and not isinstance(kind, str):
            raise TrainscaleError(f"model file {path}: {key}'s rope_type must be a string, not {kind!r}")
    got = _sub(cfg, "rope_scaling", path) or _sub(cfg, "rope_parameters", path)
    kind = got.get("rope_type", got.get("type")) or "default"
    return {**got, "rope_type": kind}


def gemma3_rope(cfg: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's two RoPEs (transformers' Gemma3TextConfig.convert_rope_params_to_dict): (the full-attention
    layers', the sliding-window layers'), each with its rope_type and rope_theta, from ``rope_parameters``
    {"full_attention": ..., "sliding_attention": ...} (transformers 5) or rope_scaling, rope_theta and
    rope_local_base_freq (transformers 4); defaults: bases 1e6 and 1e4, unscaled."""
    rp = _sub(cfg, "rope_parameters", path)
    if "full_attention" in rp or "sliding_attention" in rp:
        full, local = _sub(rp, "full_attention", path), _sub(rp, "sliding_attention", path)
    else:
        full = {**_sub(cfg, "rope_scaling", path), **rp}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        full.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    out = []
    for got, base in ((full, 1e6), (local, 1e4)):
        kind = got.get("rope_type", got.get("type")) or "default"
        if not isinstance(kind, str):
            raise TrainscaleError(f"model file {path}: rope_parameters' rope_type must be a string, not {kind!r}")
        out.append({"rope_theta": base, **got, "rope_type": kind})
    return out[0], out[1]


def rope_theta(cfg: dict[str, Any], path: str | Path) -> float:
    """RoPE's base: ``rope_theta`` at the top (transformers 4) or in ``rope_parameters`` (transformers 5), else
    transformers' 10000; a positive number, one sentence otherwise."""
    key, v = "rope_theta", cfg.get("rope_theta")
    if cfg.get("model_type") == "gemma3_text":
        key, v = "rope_parameters' full_attention rope_theta", gemma3_rope(cfg, path)[0]["rope_theta"]
    if v is None:
        key, v = "rope_parameters' rope_theta", _sub(cfg, "rope_parameters", path).get("rope_theta", 10000.0)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise TrainscaleError(f"model file {path}: {key} must be a positive number, not {v!r}")
    return float(v)


def _number(cfg: dict[str, Any], key: str, default: float, path: str | Path) -> float:
    v = cfg.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TrainscaleError(f"model file {path}: rope scaling's {key} must be a number, not {v!r}")
    return float(v)


def gemma2_fields(cfg: dict[str, Any], path: str | Path, pattern: int = 2) -> dict[str, Any]:
    """Gemma 2 (transformers' configuration_gemma2 and its defaults): output norms, soft-capped attention scores
    and logits, scores scaled by query_pre_attn_scalar^-0.5, the sliding window on the layers ``layer_types``
    names "sliding_attention" (by default the even ones: 0, 2, ...)."""
    n = config_int(cfg, "num_hidden_layers", path, 0)
    types = cfg.get("layer_types")
    if not isinstance(types, list):
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return {"sandwich_norms": True, "attn_softcap": _number(cfg, "attn_logit_softcapping", 0.0, path),
            "final_softcap": _number(cfg, "final_logit_softcapping", 0.0, path),
            "query_scale": _number(cfg, "query_pre_attn_scalar", 256.0, path),
            "sliding_window": sliding_window(cfg, "gemma2", path),  # Gemma 3's default is 4096 too
            "window_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention")}


def yarn_fields(cfg: dict[str, Any], rope: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """RoPE "yarn" as transformers reads it (modeling_rope_utils: standardize_rope_params and
    _compute_yarn_parameters): the original length from the top-level ``original_max_position_embeddings`` (Phi-3's
    place) or rope_scaling's, else max_position_embeddings; a missing factor is max_position_embeddings over it;
    beta_fast / beta_slow 32 / 1 when absent or 0; the attention factor as given, else mscale / mscale_all_dim's
    ratio of yarn_get_mscale when both are set, else None (0.1 ln(factor) + 1, computed by the runtime)."""
    longest = config_int(cfg, "max_position_embeddings", path, 2048)
    if cfg.get("original_max_position_embeddings") is not None:
        old = config_int(cfg, "original_max_position_embeddings", path, longest)
    else:
        old = config_int(rope, "original_max_position_embeddings", path, longest)
    factor = _number(rope, "factor", longest / old, path)
    attn = rope.get("attention_factor")
    if attn is not None:
        attn = _number(rope, "attention_factor", 1.0, path)
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        def mscale(m: float) -> float:  # yarn_get_mscale: 0.1 m ln(factor) + 1, 1 for a factor <= 1
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        attn = mscale(_number(rope, "mscale", 1.0, path)) / mscale(_number(rope, "mscale_all_dim", 1.0, path))
    return {"rope_scaling": "yarn", "rope_factor": factor, "rope_original_max_len": old,
            "rope_beta_fast": _number(rope, "beta_fast", 32.0, path) or 32.0,
            "rope_beta_slow": _number(rope, "beta_slow", 1.0, path) or 1.0,
            "rope_attention_factor": attn, "rope_truncate": bool(rope.get("truncate", True))}


def family_fields(cfg: dict[str, Any], mt: str, path: str | Path) -> dict[str, Any]:
    """What a Llama-family config adds to the Llama block (transformers' configuration_llama / _mistral /
    _qwen2 / _qwen3 and modeling_rope_utils): the family, RoPE scaling (linear, llama3, yarn; other types change no
    shape, so the planner reads them as unscaled and ``check_loadable`` refuses them), Qwen2's Q/K/V biases,
    Qwen3's per-head Q/K norms, Mistral's sliding window. {} for other model types."""
    if mt == "qwen2_moe":  # Qwen2MoeAttention: q/k/v_proj with bias=True, as Qwen2's
        return {"qkv_bias": True}
    if mt == "qwen3_moe":  # Qwen3MoeAttention: q_norm / k_norm over each head, as Qwen3's
        return {"qk_norm": True}
    if mt not in ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", *GEMMAS):
        return {}
    out: dict[str, Any] = {"family": mt}
    if mt == "olmo2":  # Olmo2DecoderLayer: RMSNorms after attention and the MLP only; Q/K norms over the projections
        out.update(post_norms=True, qk_norm=True, qk_norm_whole=True)
    if mt == "phi3":  # Phi3Attention / Phi3MLP: no biases whatever the config says; RoPE other than the default is
        # "longrope" there (check_loadable refuses it; the planner's shapes do not depend on it)
        return {**out, "bias": False, "sliding_window": sliding_window(cfg, mt, path)}
    if mt in GEMMAS:  # transformers' modeling_gemma: GemmaRMSNorm (1 + w), embeddings x sqrt(d), GeGLU
        out.update(norm_offset=True, embed_scale=True, gate_act="gelu_tanh")
    if mt == "gemma2":
        out.update(gemma2_fields(cfg, path))
    if mt == "gemma3_text":  # Gemma 2's block with per-head Q/K norms, a window on 5 layers of 6 by default, and
        # those layers' own unscaled RoPE base
        pattern = config_int(cfg, "sliding_window_pattern", path, 6)
        out.update(gemma2_fields(cfg, path, pattern), qk_norm=True,
                   rope_local_theta=_number(gemma3_rope(cfg, path)[1], "rope_theta", 1e4, path))
    rope = rope_settings(cfg, path)
    if rope["rope_type"] in ("linear", "llama3"):
        out.update(rope_scaling=rope["rope_type"], rope_factor=_number(rope, "factor", 1.0, path))
    if rope["rope_type"] == "yarn":
        out.update(yarn_fields(cfg, rope, path))
    if rope["rope_type"] == "llama3":
        out.update(rope_low_freq_factor=_number(rope, "low_freq_factor", 1.0, path),
                   rope_high_freq_factor=_number(rope, "high_freq_factor", 4.0, path),
                   rope_original_max_len=config_int(rope, "original_max_position_embeddings", path, 8192))
    if mt == "qwen2":  # Qwen2Attention: q/k/v_proj with bias=True, o_proj without; no attention_bias key
        out["qkv_bias"] = True
    if mt == "qwen3":
        out["qk_norm"] = True
    if mt == "mistral" or (mt not in ("gemma2", "gemma3_text") and cfg.get("use_sliding_window")):
        out["sliding_window"] = sliding_window(cfg, mt, path)
    return out


def sliding_window(cfg: dict[str, Any], mt: str, path: str | Path) -> int:
    """The sliding window of a family that has one: ``sliding_window`` a positive integer, null for none (0 is
    one sentence: transformers' masks would let a query see no key), absent: transformers' default (4096 in
    Mistral and Gemma 2, none elsewhere)."""
    if "sliding_window" not in cfg:
        return 4096 if mt in ("mistral", "gemma2") else 0
    if cfg["sliding_window"] == 0 and not isinstance(cfg["sliding_window"], bool):
        raise TrainscaleError(f"model file {path}: sliding_window must be a positive integer or null (none), not 0")
    return config_int(cfg, "sliding_window", path, 0)


def moe_fields(cfg: dict[str, Any], mt: str, path: str | Path) -> dict[str, Any]:
    """The mixture-of-experts and MLA fields of a config (transformers' configuration_mixtral, _qwen2_moe,
    _qwen3_moe, _deepseek_v3 name them differently); {} for a dense model."""
    def num(key: str, default: Any = 0) -> Any:
        return config_int(cfg, key, path, default, least=0)

    out: dict[str, Any] = {}
    if mt == "mixtral" or (mt in ("mistral", "llama") and num("num_local_experts", 1) > 1):
        out = {"n_experts": num("num_local_experts", 8), "experts_per_token": num("num_experts_per_tok", 2),
               "d_ff_expert": cfg["intermediate_size"], "router_norm_topk": True}
    elif mt in ("qwen2_moe", "qwen3_moe"):
        if num("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise TrainscaleError(f"model file {path}: dense layers interleaved among MoE layers (decoder_sparse_step "
                                  "or mlp_only_layers) are not modelled")
        out = {"n_experts": num("num_experts"), "experts_per_token": num("num_experts_per_tok"),
               "d_ff_expert": num("moe_intermediate_size"), "router_norm_topk": bool(cfg.get("norm_topk_prob", False))}
        if mt == "qwen2_moe" and num("shared_expert_intermediate_size"):
            out.update(d_ff_shared=num("shared_expert_intermediate_size"), shared_expert_gate=True)
    elif mt in ("deepseek_v2", "deepseek_v3"):
        if num("moe_layer_freq", 1) != 1:
            raise TrainscaleError(f"model file {path}: moe_layer_freq other than 1 is not modelled")
        out = {"n_experts": num("n_routed_experts"), "experts_per_token": num("num_experts_per_tok"),
               "d_ff_expert": num("moe_intermediate_size"),
               "d_ff_shared": num("n_shared_experts") * num("moe_intermediate_size"),
               "first_dense_layers": num("first_k_dense_replace"),
               "router_norm_topk": bool(cfg.get("norm_topk_prob", mt == "deepseek_v3")),
               "attention": "mla", "q_lora_rank": num("q_lora_rank"), "kv_lora_rank": num("kv_lora_rank"),
               "qk_rope_head_dim": num("qk_rope_head_dim"), "v_head_dim": num("v_head_dim"),
               "head_dim": num("qk_nope_head_dim") or None}
    else:
        return out
    if not out["n_experts"]:  # transformers builds no dense model from 0 experts: one sentence, never a guess
        key = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}.get(
            mt, "n_routed_experts")
        raise TrainscaleError(f"model file {path}: {key} is {cfg.get(key)!r}; a {mt} model needs at least one "
                              "routed expert")
    if mt != "mixtral" and not out["d_ff_expert"]:
        raise TrainscaleError(f"model file {path}: moe_intermediate_size (each expert's FFN width) must be a "
                              "positive integer for a mixture of experts")
    coef = cfg.get("router_aux_loss_coef", cfg.get("aux_loss_alpha", 0.01))
    if coef is not None and (isinstance(coef, bool) or not isinstance(coef, int | float)):
        raise TrainscaleError(f"model file {path}: the router's auxiliary loss weight must be a number, not {coef!r}")
    out["aux_loss_coef"] = float(coef or 0.0)
    return out


# ------------------------------------------------------------------------------------ tensor names


@dataclass(frozen=True)
class Family:
    """How one Hugging Face architecture stores our model. ``names``: trainscale parameter name (``{i}``: the
    layer) -> HF tensor name; ``experts``: the leaf of a stacked expert tensor ``layers.{i}.moe.experts.{w}``
    ([E, rows, cols]) -> the HF name of expert ``{e}``'s matrix; ``loads``: runtime/hf_init.py reads folders of
    this family (each tensor one name there). Q and K rows are in rotate-half order in every family here."""

    model_type: str
    architecture: str
    names: dict[str, str]
    experts: dict[str, str] = field(default_factory=dict)
    loads: bool = False
    # trainscale parameter pattern -> (the HF tensor that holds it with others, row-wise, and which part it is:
    # "q", "k", "v" of a fused Q/K/V projection, "gate", "up" of a fused gate/up projection; Phi-3's)
    fused: dict[str, tuple[str, str]] = field(default_factory=dict)


_LINEARS = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
            "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
_LLAMA_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"layers.{{i}}.{ours}.{leaf}": f"model.layers.{{i}}.{theirs}.{leaf}"
       for ours, theirs in _LINEARS.items() for leaf in ("weight", "bias")},
}
_QWEN3_NAMES = {**_LLAMA_NAMES, "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
                "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
_GEMMA2_NAMES = {**_LLAMA_NAMES,  # four norms a layer: input, post-attention, pre- and post-feed-forward
                 "layers.{i}.attention_post_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
                 "layers.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
                 "layers.{i}.ffn_post_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight"}
_PHI3_FUSED = {"layers.{i}.attention.wq.weight": ("model.layers.{i}.self_attn.qkv_proj.weight", "q"),
               "layers.{i}.attention.wk.weight": ("model.layers.{i}.self_attn.qkv_proj.weight", "k"),
               "layers.{i}.attention.wv.weight": ("model.layers.{i}.self_attn.qkv_proj.weight", "v"),
               "layers.{i}.feed_forward.w1.weight": ("model.layers.{i}.mlp.gate_up_proj.weight", "gate"),
               "layers.{i}.feed_forward.w3.weight": ("model.layers.{i}.mlp.gate_up_proj.weight", "up")}
_PHI3_NAMES = {k: v for k, v in _LLAMA_NAMES.items() if not k.endswith(".bias") and k not in _PHI3_FUSED}
_OLMO2_NAMES = {**{k: v for k, v in _QWEN3_NAMES.items() if ("attention_norm" not in k and "ffn_norm" not in k)},
                "layers.{i}.attention_post_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
                "layers.{i}.ffn_post_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight"}
_GEMMA3_NAMES = {**_GEMMA2_NAMES, "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
                 "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", _LLAMA_NAMES, loads=True),
    "mistral": Family("mistral", "MistralForCausalLM", _LLAMA_NAMES, loads=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _LLAMA_NAMES, loads=True),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", _QWEN3_NAMES, loads=True),
    "gemma": Family("gemma", "GemmaForCausalLM", _LLAMA_NAMES, loads=True),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM", _GEMMA2_NAMES, loads=True),
    # Phi-3 and Phi-4 (Phi3ForCausalLM): Q, K, V in one qkv_proj (rows q | k | v), gate and up in one gate_up_proj
    # (rows gate | up: Phi3MLP's chunk(2)), Llama's block otherwise
    "phi3": Family("phi3", "Phi3ForCausalLM", _PHI3_NAMES, fused=_PHI3_FUSED, loads=True),
    # OLMo-2: no input norms, a norm after attention and one after the MLP, Q/K norms over the whole projections
    "olmo2": Family("olmo2", "Olmo2ForCausalLM", _OLMO2_NAMES, loads=True),
    # Gemma 3's text model (Gemma3ForCausalLM; the multimodal model_type "gemma3" is another folder layout)
    "gemma3_text": Family("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_NAMES, loads=True),
    # the published Mixtral checkpoints' layout; Mixtral names its experts' gate, up, down w1, w3, w2, as we do
    "mixtral": Family("mixtral", "MixtralForCausalLM",
                      {**_LLAMA_NAMES, "layers.{i}.moe.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight"},
                      {w: f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")}),
}
LOADED_TYPES = tuple(t for t, f in FAMILIES.items() if f.loads)


class ModelShape(Protocol):
    """The ModelSpec attributes this module reads (specs.ModelSpec has them all)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float
    tied_embeddings: bool
    bias: bool
    norm_eps: float
    n_experts: int
    experts_per_token: int
    aux_loss_coef: float

    @property
    def head_dim(self) -> int: ...

    @property
    def is_moe(self) -> bool: ...

    @property
    def expert_width(self) -> int: ...


def export_family(spec: ModelShape) -> Family:
    """The family our model is written as: the one it was read from (``spec.family``), else Llama, or Mixtral
    for a mixture of experts."""
    if spec.is_moe:
        return FAMILIES["mixtral"]
    return FAMILIES[getattr(spec, "family", "") or "llama"]


def _pattern(name: str) -> tuple[str, str]:
    """``layers.7.attention.wq.weight`` -> (``layers.{i}.attention.wq.weight``, "7")."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        return ".".join(["layers", "{i}", *parts[2:]]), parts[1]
    return name, ""


def hf_name(name: str, family: Family) -> str:
    """trainscale parameter name -> the family's Hugging Face tensor name."""
    pattern, i = _pattern(name)
    if pattern in family.fused:
        raise TrainscaleError(f"the tensor {name} is part of {family.fused[pattern][0].format(i=i)} in a Hugging Face "
                              f"{family.architecture} folder, not a tensor of its own")
    if pattern not in family.names:
        raise TrainscaleError(f"the tensor {name} has no name in a Hugging Face {family.architecture} folder")
    return family.names[pattern].format(i=i)


def hf_place(name: str, family: Family, spec: ModelShape) -> tuple[str, int, int]:
    """Where a trainscale parameter lives in a ``family`` folder: (HF tensor name, its first row there, the rows
    of that HF tensor). A fused tensor holds its parts one after the other: Q, K, V rows (q_dim, kv_dim, kv_dim) in
    ``qkv_proj``, gate then up rows (d_ff each) in ``gate_up_proj``; any other parameter is a whole tensor."""
    pattern, i = _pattern(name)
    if pattern not in family.fused:
        return hf_name(name, family), 0, 0
    fused, part = family.fused[pattern]
    q, kv, ff = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.d_ff
    first = {"q": 0, "k": q, "v": q + kv, "gate": 0, "up": ff}[part]
    return fused.format(i=i), first, (q + 2 * kv if part in "qkv" else 2 * ff)


def expert_names(name: str, n_experts: int, family: Family) -> list[str] | None:
    """A stacked expert tensor ``layers.{i}.moe.experts.{w}`` -> its per-expert HF names, else None."""
    pattern, i = _pattern(name)
    stem, _, leaf = pattern.rpartition(".")
    if stem != "layers.{i}.moe.experts" or leaf not in family.experts:
        return None
    return [family.experts[leaf].format(i=i, e=e) for e in range(n_experts)]


def rope_permuted_heads(name: str, spec: ModelShape) -> int | None:
    """How many heads' rows a trainscale tensor's HF form permutes (Q: n_heads, K: n_kv_heads), or None."""
    if ".attention.wq." in name:
        return spec.n_heads
    if ".attention.wk." in name:
        return spec.n_kv_heads
    if name.endswith((".attention.q_norm.weight", ".attention.k_norm.weight")):
        if getattr(spec, "qk_norm_whole", False):  # OLMo-2's gain over the whole projection: its rows' order
            return spec.n_heads if ".q_norm." in name else spec.n_kv_heads
        return 1  # Qwen3's per-head norm gain: one head's dims, in the same order as the rows it scales
    return None


def rope_interleaved_to_half(w: Any, n_heads: int, head_dim: int) -> Any:
    """Rows of a Q or K projection (or bias), per head: pairs (2i, 2i+1) -> (i, i + d/2). A torch tensor or
    a numpy array."""
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(n_heads * head_dim, *rest)


def rope_half_to_interleaved(w: Any, n_heads: int, head_dim: int) -> Any:
    """The inverse of ``rope_interleaved_to_half`` (Hugging Face rows -> trainscale rows), per head."""
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(n_heads * head_dim, *rest)


# ------------------------------------------------------------------------------------ loading a folder


def check_loadable(cfg: dict[str, Any], path: str | Path) -> Family:
    """The family of a config.json whose model trainscale's runtime computes exactly as transformers does (a
    family with ``loads``, SwiGLU, RoPE unscaled or scaled linear / llama3 / yarn, biases as the family has them);
    one sentence otherwise."""
    kind = cfg.get("model_type")
    if kind not in LOADED_TYPES:
        raise TrainscaleError(f"[model] init {path} holds a {kind!r} model; only Llama-family folders "
                              f"(model_type {', '.join(LOADED_TYPES)}) can be loaded")
    if kind == "gemma3_text" and gemma3_rope(cfg, path)[1]["rope_type"] != "default":
        raise TrainscaleError(f"[model] init {path}: RoPE scaling on Gemma 3's sliding-window layers "
                              f"({gemma3_rope(cfg, path)[1]['rope_type']!r}) is not computed by trainscale (it "
                              "scales only the full-attention layers' RoPE)")
    if kind in ("gemma2", "gemma3_text") and cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise TrainscaleError(f"[model] init {path}: hidden_activation {cfg['hidden_activation']!r} is not Gemma's "
                              "GeGLU (gelu_pytorch_tanh)")
    if kind in ("gemma2", "gemma3_text") and cfg.get("use_bidirectional_attention"):
        raise TrainscaleError(f"[model] init {path}: use_bidirectional_attention is not a causal language model's "
                              "attention, which trainscale trains")
    if kind in GEMMAS:  # transformers reads Gemma's legacy "gelu" as the tanh approximation
        if cfg.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
            raise TrainscaleError(f"[model] init {path}: hidden_act {cfg['hidden_act']!r} is not Gemma's GeGLU "
                                  "(gelu_pytorch_tanh)")
    elif cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise TrainscaleError(f"[model] init {path}: hidden_act {cfg['hidden_act']!r} is not Llama's SwiGLU (silu)")
    rope = rope_settings(cfg, path).get("rope_type")
    partial = cfg.get("partial_rotary_factor", rope_settings(cfg, path).get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise TrainscaleError(f"[model] init {path}: partial_rotary_factor {partial!r} rotates only part of each head "
                              "(Phi-4-mini's 0.75), which trainscale's RoPE (every dim of the head) does not compute")
    if kind == "phi3" and rope != "default":  # Phi3Config reads "su" and "yarn" as "longrope"
        raise TrainscaleError(f"[model] init {path} uses RoPE scaling 'longrope' (Phi-3's {rope!r}: per-dim short "
                              "and long factors switched by sequence length), which trainscale's RoPE does not "
                              "implement (it computes default, linear, llama3 and yarn exactly)")
    if rope == "dynamic":
        raise TrainscaleError(f"[model] init {path} uses RoPE scaling 'dynamic', whose frequencies transformers "
                              "recomputes on each forward from the longest sequence seen so far (keys already cached "
                              "keep the old ones), which trainscale's fixed per-model RoPE cannot reproduce exactly")
    if rope not in ("default", "linear", "llama3", "yarn"):
        raise TrainscaleError(f"[model] init {path} uses RoPE scaling {rope!r}, which trainscale's RoPE does not "
                              "implement (it computes default, linear, llama3 and yarn exactly)")
    layer_types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    if kind in ("qwen2", "qwen3") and (cfg.get("use_sliding_window") or "sliding_attention" in layer_types):
        raise TrainscaleError(f"[model] init {path} uses Qwen's sliding window on some layers (use_sliding_window), "
                              "which trainscale's attention does not implement")
    if kind == "olmo2" and cfg.get("attention_bias"):  # Olmo2MLP has no bias whatever mlp_bias says
        raise TrainscaleError(f"[model] init {path}: olmo2 with attention_bias has no bias in its MLP, which "
                              "trainscale's bias setting (attention and MLP together) does not express")
    if bool(cfg.get("mlp_bias", cfg.get("attention_bias", False))) != bool(cfg.get("attention_bias", False)):
        raise TrainscaleError(f"[model] init {path} has biases in attention or the MLP but not both; trainscale's "
                              "bias setting covers both")
    if kind in ("qwen2", "qwen3", *GEMMAS) and cfg.get("attention_bias") and not cfg.get("mlp_bias"):
        raise TrainscaleError(f"[model] init {path}: {kind} with attention_bias has no bias in its MLP, which "
                              "trainscale's bias setting (attention and MLP together) does not express")
    return FAMILIES[kind]


# ------------------------------------------------------------------------------------ fields -> config.json


def hf_rope(spec: ModelShape) -> dict[str, Any]:
    """The model's RoPE as transformers' ``rope_parameters`` (modeling_rope_utils' keys)."""
    kind = getattr(spec, "rope_scaling", "none")
    rope: dict[str, Any] = {"rope_type": "default" if kind == "none" else kind, "rope_theta": spec.rope_theta}
    if kind != "none":
        rope["factor"] = spec.rope_factor
    if kind == "llama3":
        rope.update(low_freq_factor=spec.rope_low_freq_factor, high_freq_factor=spec.rope_high_freq_factor,
                    original_max_position_embeddings=spec.rope_original_max_len)
    if kind == "yarn":
        rope.update(original_max_position_embeddings=spec.rope_original_max_len, beta_fast=spec.rope_beta_fast,
                    beta_slow=spec.rope_beta_slow)
        if spec.rope_attention_factor is not None:
            rope["attention_factor"] = spec.rope_attention_factor
        if not spec.rope_truncate:
            rope["truncate"] = False
    return rope


def hf_config(spec: ModelShape, dtype: str, token: int | None) -> dict[str, Any]:
    """The config.json of our model written as its ``export_family`` (transformers' LlamaConfig, MistralConfig,
    Qwen2Config, Qwen3Config or MixtralConfig keys); ``token``: the bos / eos id."""
    family = export_family(spec)
    rope = hf_rope(spec)
    cfg = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.expert_width if spec.is_moe else spec.d_ff,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": rope,
        "hidden_act": "gelu_pytorch_tanh" if getattr(spec, "gate_act", "silu") == "gelu_tanh" else "silu",
        "tie_word_embeddings": spec.tied_embeddings,
        "attention_bias": spec.bias,
        "mlp_bias": spec.bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": token,
        "eos_token_id": token,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if rope["rope_type"] != "default":  # transformers 4 reads the scaling from rope_scaling
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if family.model_type == "mistral":
        cfg["sliding_window"] = spec.sliding_window or None
    if family.model_type in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.n_layers)
    if family.model_type in ("gemma2", "gemma3_text"):
        window = [i in spec.window_layers if spec.window_layers is not None else True for i in range(spec.n_layers)]
        scalar = spec.query_scale or spec.head_dim  # an int in Gemma2Config
        cfg.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   attn_logit_softcapping=spec.attn_softcap or None, final_logit_softcapping=spec.final_softcap or None,
                   sliding_window=spec.sliding_window or None, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention" if w and spec.sliding_window else "full_attention" for w in window])
    if family.model_type == "phi3":  # Phi3Config: no bias keys, its own pad id default (32000) set to none
        cfg.update(sliding_window=spec.sliding_window or None, pad_token_id=None, partial_rotary_factor=1.0,
                   original_max_position_embeddings=spec.max_seq_len, resid_pdrop=0.0, embd_pdrop=0.0)
    if family.model_type == "gemma3_text":  # one RoPE per layer type; no soft-capping keys when none
        local = {"rope_type": "default", "rope_theta": spec.rope_local_theta or spec.rope_theta}
        cfg = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
        cfg.update(rope_parameters={"full_attention": rope, "sliding_attention": local})
    if family.model_type == "olmo2":  # Olmo2Config's pad id default (1) set to none, its attention without biases
        cfg.update(pad_token_id=None)
    if family.model_type in ("mistral", "qwen2", "phi3", "olmo2", *GEMMAS):  # no bias keys: none in Mistral, Phi-3,
        # Qwen2's Q/K/V (Gemma's attention_bias would leave its MLP without; check_loadable refuses it)
        cfg = {k: v for k, v in cfg.items() if k not in ("attention_bias", "mlp_bias")}
    if not spec.is_moe:
        return cfg
    cfg = {k: v for k, v in cfg.items() if k not in ("attention_bias", "mlp_bias")}  # Mixtral has no biases
    return {**cfg, "num_local_experts": spec.n_experts, "num_experts_per_tok": spec.experts_per_token,
            "router_aux_loss_coef": spec.aux_loss_coef, "output_router_logits": False, "router_jitter_noise": 0.0,
            "sliding_window": None}


def check_exportable(spec: ModelShape) -> None:
    """The model has a form in its ``export_family``: Q/K/V-only biases only in Qwen2, per-head Q/K norms only in
    Qwen3 and Gemma 3, Q/K norms over the projections and norms after the sub-layers only in OLMo-2, a sliding
    window only in Mistral, Phi-3 and Gemma 2/3, biases everywhere only in Llama (attention_bias with mlp_bias);
    one sentence otherwise."""
    fam = export_family(spec).model_type
    bad = []
    if getattr(spec, "qkv_bias", False) and fam != "qwen2":
        bad.append("biases on Q/K/V only (Qwen2's)")
    whole = getattr(spec, "qk_norm_whole", False)
    if getattr(spec, "qk_norm", False) and not whole and fam not in ("qwen3", "gemma3_text"):
        bad.append("per-head Q/K norms (Qwen3's)")
    olmo2 = [whole, getattr(spec, "post_norms", False)]
    if any(olmo2) and fam != "olmo2":
        bad.append("Q/K norms over the whole projections or norms after the sub-layers only (OLMo-2's)")
    if fam == "olmo2" and not all(olmo2):
        bad.append("a model without OLMo-2's Q/K norms over the projections and norms after each sub-layer")
    if getattr(spec, "sliding_window", 0) and fam not in ("mistral", "gemma2", "phi3", "gemma3_text"):
        bad.append("a sliding window (Mistral's)")
    gemma = [getattr(spec, "norm_offset", False), getattr(spec, "embed_scale", False),
             getattr(spec, "gate_act", "silu") != "silu", spec.tied_embeddings]
    if any(gemma[:3]) and fam not in GEMMAS:
        bad.append("Gemma's (1 + w) norms, sqrt(d)-scaled embeddings or GeGLU")
    if fam in GEMMAS and not all(gemma):
        bad.append("a model without all of Gemma's (1 + w) norms, scaled tied embeddings and GeGLU")
    gemma2 = [getattr(spec, k, 0) for k in ("sandwich_norms", "attn_softcap", "final_softcap", "query_scale")]
    if getattr(spec, "rope_local_theta", 0) and fam != "gemma3_text":
        bad.append("a RoPE base of its own on the sliding-window layers (Gemma 3's)")
    if any(gemma2) and fam not in ("gemma2", "gemma3_text"):
        bad.append("Gemma 2's output norms, soft-capping or query_pre_attn_scalar")
    if fam in ("gemma2", "gemma3_text") and not gemma2[0]:
        bad.append("a model without Gemma 2's output norms")
    if getattr(spec, "window_layers", None) is not None and fam not in ("gemma2", "gemma3_text"):
        bad.append("a sliding window on some layers only (Gemma 2's)")
    if spec.bias and fam not in ("llama",):
        bad.append("biases in attention and the MLP (Llama's attention_bias + mlp_bias)")
    if bad:
        raise TrainscaleError(f"a Hugging Face {export_family(spec).architecture} folder cannot hold "
                              f"{', '.join(bad)}")
