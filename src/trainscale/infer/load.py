"""One loader for every folder infer/ reads: a model folder (or a run folder's final/, or a checkpoint
resharded into one: runtime/artifact.find_model_folder), a quantized
folder (quantized.safetensors, dequantized to fp32 on load), a LoRA adapter folder (adapter.json
naming its base; the adapters are folded into the base weights on load) and a Hugging Face model folder
(config.json + model.safetensors or shards named by model.safetensors.index.json, + tokenizer.json), read into
trainscale's model by runtime/hf_init.py (hf_folder_spec, check_hf_weights, load_into) through trainscale/hf.py.

It sits above the folder formats it reads (infer/quantize.py, infer/lora.py, runtime/artifact.py), which
import nothing from it: the pipelines that start from a folder (commands/, export) load through here."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from trainscale.errors import TrainscaleError
from trainscale.estimate.lora import lora_targets
from trainscale.infer.lora import ADAPTER_FILE, adapter_state_dict, apply_lora, fold_adapter, read_adapter_config
from trainscale.infer.quantize import QUANT_FILE, dequantize_state_dict, quantize_state_dict, read_quant_config
from trainscale.runtime.artifact import (
    check_finite,
    check_header,
    check_layer_count,
    find_model_folder,
    load_model_dir,
    read_header,
    read_spec,
)
from trainscale.runtime.data.tokenizer import load_tokenizer
from trainscale.runtime.hf_init import INDEX, SINGLE
from trainscale.runtime.model import build_model
from trainscale.specs import ModelSpec


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder (config.json, no model.json): loaded through runtime/hf_init.py."""
    p = Path(path)
    try:
        return p.is_dir() and (p / "config.json").exists() and not (p / "model.json").exists()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def _hf_errors(e: TrainscaleError) -> TrainscaleError:
    """runtime/hf_init.py's sentences name the training option ([model] init); here the folder is a base model."""
    return TrainscaleError(str(e).replace("[model] init ", "the Hugging Face folder ", 1))


def source_folder(path: str | Path) -> Path:
    """The folder ``path`` names for infer/: a Hugging Face model folder as it is (its files checked regular, its
    weights present), else ``find_model_folder`` (model, run, checkpoint, quantized or adapter folder)."""
    if not is_hf_folder(path):
        return find_model_folder(path)
    p = Path(path)
    from trainscale.safeio import check_regular

    for name in ("config.json", SINGLE, INDEX, "tokenizer.json"):
        if (p / name).exists():
            check_regular(p / name, f"{p}'s {name}")
    if not (p / SINGLE).exists() and not (p / INDEX).exists():
        raise TrainscaleError(f"the Hugging Face folder {p} has no {SINGLE} or {INDEX} (only safetensors weights "
                              "load)")
    return p


def spec_of(folder: Path) -> ModelSpec:
    """The ModelSpec of a folder ``source_folder`` gave: model.json, or a Hugging Face folder's config.json
    (``hf_folder_spec``: a model trainscale would compute differently is refused in one sentence)."""
    if not is_hf_folder(folder):
        return read_spec(folder)
    from trainscale.runtime.hf_init import hf_folder_spec

    try:
        return hf_folder_spec(folder)
    except TrainscaleError as e:
        raise _hf_errors(e) from None


def folder_kind(folder: Path) -> str:
    if is_hf_folder(folder):
        return "hf"
    if (folder / QUANT_FILE).exists():
        return "quantized"
    if (folder / "model.safetensors").exists():
        return "model"
    if (folder / "adapter.json").exists():
        return "adapter"
    raise TrainscaleError(f"{folder} has model.json but no model.safetensors, quantized.safetensors or adapter.json")


# An adapter's base may itself be an adapter folder; a chain this deep is refused rather than followed
# (a cycle, a -> b -> a, would otherwise recurse until Python's stack runs out).
MAX_ADAPTER_DEPTH = 4


def load_for_inference(path: str | Path, dtype: torch.dtype = torch.float32):
    """-> (Transformer in eval mode, ModelSpec, folder) for any folder kind infer/ writes. Every weights file is
    checked against model.json from its header before a tensor is read, and its weights checked finite."""
    return _load(path, dtype, ())


def _load(path: str | Path, dtype: torch.dtype, chain: tuple[Path, ...]):
    folder = source_folder(path)
    spec = spec_of(folder)
    kind = folder_kind(folder)
    if kind == "hf":
        return _load_hf(folder, spec, dtype), spec, folder
    if kind == "model":
        model, spec, folder = load_model_dir(folder, dtype=dtype)
        return model, spec, folder
    if kind == "quantized":
        return _load_quantized(folder, spec, dtype), spec, folder
    return _load_adapter(folder, spec, dtype, chain), spec, folder


def _check_chain(folder: Path, chain: tuple[Path, ...]) -> tuple[Path, ...]:
    here = folder.resolve()
    if here in chain:
        raise TrainscaleError(f"{chain[0]}'s chain of adapter bases loops back to {folder}")
    if len(chain) >= MAX_ADAPTER_DEPTH:
        raise TrainscaleError(f"{chain[0]} is an adapter on an adapter more than {MAX_ADAPTER_DEPTH} levels deep; "
                              "merge the chain first (trainscale lora --merge)")
    return (*chain, here)


def _load_adapter(folder: Path, spec: ModelSpec, dtype: torch.dtype, chain: tuple[Path, ...]):
    """The base model adapter.json names (any folder kind but this one), with the adapters folded in; the
    adapter file checked against the base's projections (header, then finiteness) before it is read."""
    chain = _check_chain(folder, chain)
    cfg = read_adapter_config(folder)
    base, base_spec, _ = _load(cfg.base, torch.float32, chain)
    if base_spec.model_copy(update={"source": ""}) != spec.model_copy(update={"source": ""}):  # provenance aside
        raise TrainscaleError(f"{folder / 'model.json'} does not describe the model its base {cfg.base} holds")
    _check_adapter_file(folder, base_spec, cfg)
    return fold_adapter(base, base_spec, folder, cfg).to(dtype).eval()


def _check_adapter_file(folder: Path, spec: ModelSpec, cfg) -> None:
    path = folder / ADAPTER_FILE
    meta = build_model(spec, "meta")
    try:
        apply_lora(meta, cfg.rank, cfg.alpha, lora_targets(spec, cfg.targets))
    except ValueError as e:
        raise TrainscaleError(f"{folder / 'adapter.json'}: {e}") from None
    check_header(path, read_header(path), adapter_state_dict(meta))
    check_finite(path, load_file(str(path)))


def _load_hf(folder: Path, spec: ModelSpec, dtype: torch.dtype):
    """A Hugging Face folder's weights in trainscale's model: every tensor's shape checked from the headers
    (``check_hf_weights``) before any is read, then read by name with Q/K rows permuted (``load_into``), then
    checked finite."""
    from trainscale.runtime.hf_init import HFWeights, check_hf_weights, load_into

    try:
        check_hf_weights(folder, spec)
        model = build_model(spec, "meta")
        model.to_empty(device="cpu")
        load_into(model, HFWeights(folder), spec)
    except TrainscaleError as e:
        raise _hf_errors(e) from None
    check_finite(folder, dict(model.state_dict()))
    return model.to(dtype).eval()


def _load_quantized(folder: Path, spec: ModelSpec, dtype: torch.dtype):
    """quantized.safetensors' header against what quantizing this model.json's model gives (names, shapes,
    dtypes: quantize_state_dict on meta tensors), then its scales checked finite, then dequantized."""
    path = folder / QUANT_FILE
    cfg = read_quant_config(path)
    header = read_header(path)
    check_layer_count(path, header, spec)
    model = build_model(spec, "meta")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_header(path, header, quantize_state_dict(model.state_dict(), cfg))
    try:
        qsd = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{path} is corrupt or unreadable: {str(e)[:200]}") from None
    check_finite(path, qsd)
    sd = dequantize_state_dict(qsd, cfg, shapes)
    check_finite(path, sd)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    return model.eval()


def load_tokenizer_for(folder: Path):
    path = folder / "tokenizer.json"
    if not path.exists():
        raise TrainscaleError(f"{folder} has no tokenizer.json")
    return load_tokenizer(path)


def stop_token_id(tok, folder: Path) -> int | None:
    """The end-of-text token generation stops at: the folder's eos_token (tokenizer_config.json, a Hugging Face
    folder's), else a usual name (runtime/data/tokenizer.eot_of); None when the tokenizer has none."""
    from trainscale.runtime.data.tokenizer import eot_of

    try:
        return tok.token_to_id(eot_of(tok, str(folder), None))
    except TrainscaleError:
        return None
