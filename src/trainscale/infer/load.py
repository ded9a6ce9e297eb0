"""One loader for every folder infer/ reads: a model folder (or a run folder's final/), a quantized
folder (quantized.safetensors, dequantized to fp32 on load) and a LoRA adapter folder (adapter.json
naming its base; the adapters are folded into the base weights on load).

It sits above the folder formats it reads (infer/quantize.py, infer/lora.py, runtime/artifact.py), which
import nothing from it: the pipelines that start from a folder (commands/, export) load through here."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from trainscale.errors import TrainscaleError
from trainscale.infer.lora import fold_adapter, read_adapter_config
from trainscale.infer.quantize import QUANT_FILE, dequantize_state_dict, read_quant_config
from trainscale.runtime.artifact import find_model_folder, load_model_dir, read_spec
from trainscale.runtime.data.tokenizer import load_tokenizer
from trainscale.runtime.model import build_model
from trainscale.specs import ModelSpec


def folder_kind(folder: Path) -> str:
    if (folder / QUANT_FILE).exists():
        return "quantized"
    if (folder / "model.safetensors").exists():
        return "model"
    if (folder / "adapter.json").exists():
        return "adapter"
    raise TrainscaleError(f"{folder} has model.json but no model.safetensors, quantized.safetensors or adapter.json")


def load_for_inference(path: str | Path, dtype: torch.dtype = torch.float32):
    """-> (Transformer in eval mode, ModelSpec, folder) for any folder kind infer/ writes."""
    folder = find_model_folder(path)
    spec = read_spec(folder)
    kind = folder_kind(folder)
    if kind == "model":
        model, spec, folder = load_model_dir(folder, dtype=dtype)
        return model, spec, folder
    if kind == "quantized":
        return _load_quantized(folder, spec, dtype), spec, folder
    return _load_adapter(folder, dtype), spec, folder


def _load_adapter(folder: Path, dtype: torch.dtype):
    """The base model adapter.json names (any folder kind but this one), with the adapters folded in."""
    cfg = read_adapter_config(folder)
    base, base_spec, _ = load_for_inference(cfg.base, torch.float32)
    return fold_adapter(base, base_spec, folder, cfg).to(dtype).eval()


def _load_quantized(folder: Path, spec: ModelSpec, dtype: torch.dtype):
    path = folder / QUANT_FILE
    cfg = read_quant_config(path)
    try:
        qsd = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{path} is corrupt or unreadable: {e}") from None
    model = build_model(spec, "meta")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        sd = dequantize_state_dict(qsd, cfg, shapes)
    except (KeyError, RuntimeError) as e:
        raise TrainscaleError(f"{path} does not match model.json: {e}") from None
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    return model.eval()


def load_tokenizer_for(folder: Path):
    path = folder / "tokenizer.json"
    if not path.exists():
        raise TrainscaleError(f"{folder} has no tokenizer.json")
    return load_tokenizer(path)
