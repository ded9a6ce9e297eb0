"""A trained model on disk, consolidated for inference and export: one folder with

  model.safetensors   full (unsharded) weights, trainscale tensor names, fp32 or bf16
  model.json          the ModelSpec (same fields as a catalog entry)
  tokenizer.json      the Hugging Face tokenizers file the run trained

``trainscale train`` writes it at the end of a run as RUN_DIR/final; infer/ (generate, quantize,
lora, export) reads it, as well as the folders infer/ writes beside it (quantized.safetensors or adapter.json
instead of model.safetensors). A run directory is accepted wherever a model folder is (its final/ is used):
``find_model_folder`` is the one place that says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainscale.errors import TrainscaleError
from trainscale.safeio import atomic_write, atomic_write_bytes, atomic_write_json, check_folder_files, read_json_object
from trainscale.specs import ModelSpec, load_model


def save_model_dir(out: str | Path, state_dict: dict[str, torch.Tensor], spec: ModelSpec,
                   tokenizer_json: str | Path | None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    atomic_write(out / "model.safetensors",
                 lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "trainscale"}))
    atomic_write_json(out / "model.json", spec.model_dump(by_alias=True, exclude_none=True))
    if tokenizer_json is not None and Path(tokenizer_json).resolve() != (out / "tokenizer.json").resolve():
        atomic_write_bytes(out / "tokenizer.json", Path(tokenizer_json).read_bytes())
    return out


def find_model_folder(path: str | Path) -> Path:
    """The model folder ``path`` names: itself, or a run folder's final/; it must hold model.json (beside
    model.safetensors, quantized.safetensors or adapter.json: infer/load.py tells them apart), and every
    model-folder file present must be a regular file."""
    p = Path(path)
    try:
        present = p.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte
        present = False
    if not present:
        raise TrainscaleError(f"checkpoint {str(path)[:200]} does not exist")
    if (p / "final" / "model.json").exists():
        p = p / "final"
    if not p.is_dir() or not (p / "model.json").exists():
        raise TrainscaleError(f"{path} is not a trainscale model folder (needs model.json with model.safetensors, "
                              "quantized.safetensors or adapter.json; or a run folder with final/)")
    check_folder_files(p)
    return p


def read_spec(folder: Path) -> ModelSpec:
    """The ModelSpec of a model folder's model.json."""
    return load_model(read_json_object(folder / "model.json", "model description"))


def load_model_dir(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """-> (Transformer with the saved weights, ModelSpec, folder)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from trainscale.runtime.model import build_model

    p = find_model_folder(path)
    if not (p / "model.safetensors").exists():
        raise TrainscaleError(f"{path} has no model.safetensors (a quantized or adapter folder loads through "
                              "infer/load.py)")
    spec = read_spec(p)
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
