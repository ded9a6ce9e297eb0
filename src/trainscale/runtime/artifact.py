"""A trained model on disk, consolidated for inference and export: one folder with

  model.safetensors   full (unsharded) weights, trainscale tensor names, fp32 or bf16
  model.json          the ModelSpec (same fields as a catalog entry)
  tokenizer.json      the Hugging Face tokenizers file the run trained
  tokenizer_config.json, chat_template.jinja   when the run started from a model (or chat data) with a chat
                      template: copied, so LoRA and generation render conversations as training did

``trainscale train`` writes it at the end of a run as RUN_DIR/final; infer/ (generate, quantize,
lora, export) reads it, as well as the folders infer/ writes beside it (quantized.safetensors or adapter.json
instead of model.safetensors). This module is the folder's format: writing it, its header checked against
model.json before a tensor is read, a rank's slices of it (``load_folder_into``), the run folder around it
(config.toml, source.json). Which folder a path names (a run, a checkpoint resharded into a model) is
runtime/find_model.py's.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import torch

from trainscale.errors import TrainscaleError
from trainscale.safeio import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    read_bytes,
    read_json_object,
    read_text,
)
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


# what runtime/data/chat.py and infer/chatfiles.py read beside tokenizer.json: the template, special tokens, end ids
CHAT_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_chat_files(src: str | Path, out: str | Path) -> list[str]:
    """Copy ``CHAT_FILES`` present in ``src`` into the model folder ``out`` (each read through safeio: a regular
    file of bounded size, tokenizer_config.json a JSON object) -> the names copied."""
    copied = []
    for name in CHAT_FILES:
        f = Path(src) / name
        if not f.is_file():
            continue
        if name.endswith(".json"):
            read_json_object(f, "tokenizer settings")
        atomic_write_bytes(Path(out) / name, read_bytes(f, "chat template file"))
        copied.append(name)
    return copied


# ------------------------------------------------------------------ the run folder around a model folder

RUN_CONFIG = "config.toml"  # what runtime/job/runfolder.py writes into every run folder, with tokenizer.json
RUN_TOKENIZER = "tokenizer.json"
CHECKPOINT_MODEL = "model"  # the model folder inside a checkpoint folder
SOURCE_FILE = "source.json"  # in that folder: the checkpoint, its manifest's sha256, the run, the step
STEP = re.compile(r"^step-(\d{1,12})$")
TMP_STEP = re.compile(r"^\.tmp-step-\d{1,12}$")


def is_step_name(name: str) -> bool:
    """Whether a folder name is a checkpoint's: step-N, or a save in progress .tmp-step-N."""
    return bool(STEP.match(name) or TMP_STEP.match(name))


def holds_steps(folder: Path) -> bool:
    """Whether ``folder`` holds step-N checkpoint folders (a checkpoint root)."""
    try:
        return any(STEP.match(q.name) and q.is_dir() for q in folder.iterdir())
    except OSError:
        return False


def run_toml(run: Path) -> dict:
    """A run folder's config.toml as a dict (runtime/config.py's TrainConfig.to_toml wrote it: every model field
    spelled out), ``[model] init`` dropped: the weights are the run's own now, and its source need not exist."""
    path = Path(run) / RUN_CONFIG
    try:
        data = tomllib.loads(read_text(path, "run config"))
    except tomllib.TOMLDecodeError as e:
        raise TrainscaleError(f"run config {path} is not TOML: {e}") from None
    if isinstance(data.get("model"), dict):
        data["model"] = {k: v for k, v in data["model"].items() if k != "init"}
    return data


def run_spec(run: Path) -> ModelSpec:
    """The ModelSpec a run trained (its config.toml's [model])."""
    model = run_toml(run).get("model")
    if not isinstance(model, dict):
        raise TrainscaleError(f"run config {Path(run) / RUN_CONFIG} has no [model] section")
    return load_model(model)


# ------------------------------------------------------------------ the run a model folder came from


def run_folder_of(folder: Path) -> Path | None:
    """The run folder a model folder came from: RUN for RUN/final, the run source.json names for a model resharded
    from a checkpoint; None for any other folder."""
    folder = Path(folder)
    if (folder / SOURCE_FILE).is_file():
        try:
            run = read_json_object(folder / SOURCE_FILE, "model source").get("run")
        except TrainscaleError:
            return None
        return Path(run) if isinstance(run, str) and (Path(run) / RUN_CONFIG).is_file() else None
    parent = folder.resolve().parent
    return parent if folder.resolve().name == "final" and (parent / RUN_CONFIG).is_file() else None


def checkpoint_source(folder: Path) -> dict | None:
    """For a model folder resharded from a checkpoint: {checkpoint, step, run, layout, manifest_sha256}; else None."""
    try:
        return read_json_object(Path(folder) / SOURCE_FILE, "model source") if (Path(folder) / SOURCE_FILE).is_file() \
            else None
    except TrainscaleError:
        return None


def model_inputs(folder: Path) -> tuple[Path, ...]:
    """The folders a model folder's weights were read from (an output must not land in one): itself, and the
    checkpoint it was resharded from, if so."""
    origin = checkpoint_source(folder)
    ckpt = origin.get("checkpoint") if origin else None
    return (Path(folder), Path(ckpt)) if isinstance(ckpt, str) else (Path(folder),)


def beside(folder: Path, suffix: str) -> Path:
    """The default output folder for what is made from a model folder: FOLDER{suffix} beside it; for a model
    resharded from RUN/checkpoints/step-N, RUN/step-N{suffix} (never inside the checkpoint)."""
    folder = Path(folder).resolve()
    run = run_folder_of(folder) if (folder / SOURCE_FILE).is_file() else None
    if run is not None and folder.name == CHECKPOINT_MODEL and STEP.match(folder.parent.name):
        return run / f"{folder.parent.name}{suffix}"
    return folder.with_name(f"{folder.name}{suffix}")


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


def check_layer_count(path: Path, names, spec: ModelSpec, against: str = "model.json") -> None:
    """The layers a file's tensor names hold against model.json's n_layers: checked before the model is built
    (building it costs time in proportion to n_layers, so a model.json claiming 100,000 layers is refused here)."""
    found = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    if len(found) != spec.n_layers:
        raise TrainscaleError(f"{path} does not match {against}: it holds weights for {len(found)} layers, "
                              f"{against} says n_layers = {spec.n_layers}")


def check_header(path: Path, header: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, torch.Tensor],
                 against: str = "model.json") -> None:
    """Names, shapes and dtypes of a file's header against the tensors the model expects (meta tensors do)."""
    where = f"{path} does not match {against}:"
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


# ------------------------------------------------------------------ a rank's slices of a model folder


def load_folder_into(parts: list[torch.nn.Module], folder: str | Path) -> int:
    """Fill every parameter of the (parallelized, materialised) parts with its slice of a model folder's
    model.safetensors, by trainscale name (no renaming, no permutation; runtime/weights.py): -> elements this
    rank read."""
    from trainscale.runtime.weights import Safetensors, fill

    path = Path(folder) / "model.safetensors"
    try:
        weights = Safetensors(folder, path.name, what=f"[model] init {path}")
        for part in parts:
            fill(part, weights.read)
    except TrainscaleError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"[model] init {path} cannot be read: {str(e)[:200]}") from None
    return weights.elements_read
