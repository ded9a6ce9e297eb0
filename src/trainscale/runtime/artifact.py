"""A trained model on disk, consolidated for inference and export: one folder with

  model.safetensors   full (unsharded) weights, trainscale tensor names, fp32 or bf16
  model.json          the ModelSpec (same fields as a catalog entry)
  tokenizer.json      the Hugging Face tokenizers file the run trained

``trainscale train`` writes it at the end of a run as RUN_DIR/final; infer/ (generate, quantize,
lora, export) reads it. A run directory is accepted wherever a model folder is (its final/ is used).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainscale.errors import TrainscaleError
from trainscale.specs import ModelSpec, load_model


def save_model_dir(out: str | Path, state_dict: dict[str, torch.Tensor], spec: ModelSpec,
                   tokenizer_json: str | Path | None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "trainscale"})
    tmp.replace(out / "model.safetensors")
    (out / "model.json").write_text(json.dumps(spec.model_dump(by_alias=True, exclude_none=True), indent=2))
    if tokenizer_json is not None and Path(tokenizer_json).resolve() != (out / "tokenizer.json").resolve():
        (out / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    return out


def resolve_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if (p / "final" / "model.json").exists():
        p = p / "final"
    if not (p / "model.json").exists() or not (p / "model.safetensors").exists():
        raise TrainscaleError(f"{path} is not a trainscale model folder (needs model.json and model.safetensors, "
                              "or a run folder with final/)")
    from trainscale.safeio import check_folder_files

    check_folder_files(p)
    return p


def load_model_dir(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """-> (Transformer with the saved weights, ModelSpec, folder)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from trainscale.runtime.model import build_model

    p = resolve_model_dir(path)
    from trainscale.safeio import read_text

    try:
        data = json.loads(read_text(p / "model.json", "model description"))
    except ValueError as e:
        raise TrainscaleError(f"{p / 'model.json'} is corrupt: {e}") from None
    if not isinstance(data, dict):
        raise TrainscaleError(f"{p / 'model.json'} is not a model description (a JSON object)")
    spec = load_model(data)
    model = build_model(spec, "meta")
    try:
        sd = load_file(str(p / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise TrainscaleError(f"{p / 'model.safetensors'} is corrupt or unreadable: {e}") from None
    missing = set(model.state_dict()) ^ set(sd)
    if missing:
        raise TrainscaleError(f"{p / 'model.safetensors'} does not match model.json: tensors {sorted(missing)[:3]}")
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    return model.to(device).eval(), spec, p
