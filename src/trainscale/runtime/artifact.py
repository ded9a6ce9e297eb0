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

import re
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


# safetensors' dtype names (the header's "dtype" field, safetensors format spec: F32, BF16, F16, I8, U8, ...)
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8"}
_LAYER = re.compile(r"^layers\.(\d{1,9})\.")


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype)} from a safetensors file's header alone: no tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{path} is corrupt or unreadable: {str(e)[:200]}") from None


def check_layer_count(path: Path, names, spec: ModelSpec) -> None:
    """The layers a file's tensor names hold against model.json's n_layers: checked before the model is built
    (building it costs time in proportion to n_layers, so a model.json claiming 100,000 layers is refused here)."""
    found = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    if len(found) != spec.n_layers:
        raise TrainscaleError(f"{path} does not match model.json: it holds weights for {len(found)} layers, "
                              f"model.json says n_layers = {spec.n_layers}")


def check_header(path: Path, header: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, torch.Tensor]) -> None:
    """Names, shapes and dtypes of a file's header against the tensors the model expects (meta tensors do)."""
    where = f"{path} does not match model.json:"
    missing = [k for k in expected if k not in header]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TrainscaleError(f"{where} it lacks tensor {missing[0]!r}{more}")
    extra = [k for k in header if k not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise TrainscaleError(f"{where} it holds tensor {extra[0][:200]!r}{more}, which the model does not have")
    for name, t in expected.items():
        shape, dtype = header[name]
        if shape != tuple(t.shape):
            raise TrainscaleError(f"{where} tensor {name!r} has shape {list(shape)}, the model expects "
                                  f"{list(t.shape)}")
        if dtype != ST_DTYPES.get(t.dtype):
            raise TrainscaleError(f"{path}: tensor {name!r} is {dtype}, expected {ST_DTYPES.get(t.dtype)} "
                                  "like the rest of the file")


def check_finite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every floating tensor finite: a NaN or infinite weight would make every output NaN."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise TrainscaleError(f"{path}: tensor {name!r} holds {bad} NaN or infinite values; refusing to load it")


def check_model_file(path: Path, spec: ModelSpec):
    """model.safetensors' header against ``spec`` before any tensor is loaded: layer count, then names, shapes
    and one dtype for the whole file (F32, or BF16 throughout). -> the meta model (built once, reused)."""
    from trainscale.runtime.model import build_model

    header = read_header(path)
    check_layer_count(path, header, spec)
    model = build_model(spec, "meta")
    dt = torch.bfloat16 if header and all(d == "BF16" for _, d in header.values()) else torch.float32
    check_header(path, header, {k: v.to(dt) for k, v in model.state_dict().items()})
    return model


def load_model_dir(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """-> (Transformer with the saved weights, ModelSpec, folder). The file is checked against model.json
    (check_model_file) before its tensors are read, and its weights are checked finite after."""
    from safetensors.torch import load_file

    p = find_model_folder(path)
    if not (p / "model.safetensors").exists():
        raise TrainscaleError(f"{path} has no model.safetensors (a quantized or adapter folder loads through "
                              "infer/load.py)")
    spec = read_spec(p)
    model = check_model_file(p / "model.safetensors", spec)
    try:
        sd = load_file(str(p / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{p / 'model.safetensors'} is corrupt or unreadable: {str(e)[:200]}") from None
    check_finite(p / "model.safetensors", sd)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True)
    return model.to(device).eval(), spec, p
