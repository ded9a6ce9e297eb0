"""``[model] init = "PATH"``: where a training run's starting weights come from, resolved after the config is
parsed (runtime/config.py reads the TOML as data and opens no folder) and before any rank starts.

PATH names a Hugging Face folder (config.json and safetensors: runtime/hf_init.py reads it) or a trainscale
model: a model folder, a run folder (its final/, else its newest committed checkpoint), a checkpoint or a
checkpoint root (runtime/find_model.py finds the model folder, resharding a checkpoint once, here). ``resolve_init``
turns the config's raw tables into ones ``config_from_dict`` validates: the folder's model fields with [model]'s
over them, the weights' own tokenizer when [data] names none, and every tensor's header checked against the
model (no weight read). ``resolved_config`` is the loader every place that starts a run calls (``train``,
``launch``, each rank's main, the probes); ``load_init`` fills a rank's (parallelized) model from the folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from trainscale.errors import TrainscaleError
from trainscale.runtime.artifact import (
    RUN_CONFIG,
    check_model_file,
    holds_steps,
    is_step_name,
    load_folder_into,
    read_spec,
)
from trainscale.runtime.config import TrainConfig, check_sections, config_from_dict, config_tables
from trainscale.runtime.find_model import find_model_folder
from trainscale.runtime.hf_init import check_hf_weights, hf_folder_spec, load_hf_init
from trainscale.specs import ModelSpec, load_model


def is_model_reference(path: str | Path) -> bool:
    """Whether a ``[model] init`` path names a trainscale model (a model folder, a run folder, a checkpoint or a
    checkpoint root) rather than a Hugging Face folder (config.json: runtime/hf_init.py reads those)."""
    p = Path(path).expanduser()
    try:
        if (p / "config.json").exists() and not (p / "model.json").exists():
            return False
        return (p / "model.json").exists() or (p / "final" / "model.json").exists() or (p / RUN_CONFIG).exists() \
            or is_step_name(p.name) or (p.is_dir() and holds_steps(p))
    except (OSError, ValueError):
        return False


def init_folder(path: str) -> str:
    """``[model] init`` resolved: a trainscale reference -> its model folder (a checkpoint resharded here, once,
    before any rank starts), which must hold full weights (model.safetensors); a Hugging Face folder -> itself."""
    if not is_model_reference(path):
        return str(Path(path).expanduser().resolve())
    quiet = os.environ.get("RANK", "0") != "0"  # every rank reads the config: rank 0 says which checkpoint it took
    folder = find_model_folder(Path(path).expanduser(), log=(lambda _m: None) if quiet else None)
    if not (folder / "model.safetensors").exists():
        raise TrainscaleError(f"[model] init {path} names {folder}, which holds no model.safetensors (a quantized or "
                              "adapter folder: merge or export it first)")
    return str(folder.resolve())


def init_spec_fields(path: str) -> dict:
    """The ModelSpec fields of a resolved ``[model] init``: a trainscale model folder's model.json, a Hugging
    Face folder's config.json (``hf_folder_spec``: a model trainscale would compute differently is refused)."""
    p = Path(path)
    spec = read_spec(p) if (p / "model.json").exists() else hf_folder_spec(p)
    return spec.model_dump(by_alias=True, exclude_none=True)


def check_init_weights(path: str, spec: ModelSpec) -> None:
    """Every tensor of a resolved ``[model] init`` matches ``spec``'s model (headers only: no tensor read)."""
    if (Path(path) / "model.json").exists():
        check_model_file(Path(path) / "model.safetensors", spec)
    else:
        check_hf_weights(path, spec)


def init_tokenizer(init: str, folder: str) -> str:
    """The tokenizer of a resolved ``[model] init`` folder, for a config whose [data] names none: a trainscale
    model folder's tokenizer.json, a Hugging Face folder itself (tokenizer.json, or a byte-level BPE's vocab.json +
    merges.txt: runtime/data/tokenizer.load_tokenizer reads it with its special tokens). A folder without one is
    refused: its embeddings were trained on some tokenizer's ids, and a new BPE would give the same ids to other
    text, silently."""
    p = Path(folder)
    if (p / "model.json").exists() and (p / "tokenizer.json").exists():
        return str(p / "tokenizer.json")
    if not (p / "model.json").exists() and ((p / "tokenizer.json").exists() or (
            (p / "vocab.json").exists() and (p / "merges.txt").exists())):
        return str(p)
    raise TrainscaleError(f"[model] init {init} holds no tokenizer (tokenizer.json) for the token ids its weights "
                          "were trained on; name that tokenizer with [data] tokenizer (a tokenizer.json or a "
                          "Hugging Face tokenizer folder)")


def resolve_init(data: dict[str, Any], what: str = "config") -> tuple[dict[str, Any], str | None]:
    """A config's raw tables with ``[model] init`` resolved -> (tables for ``config_from_dict``, the folder or
    None). [model] becomes the folder's model fields with the section's over them, [data] tokenizer defaults to
    the folder's tokenizer (``init_tokenizer``: the weights' own token ids, never a new BPE; a folder without one
    is refused), and the weights are checked."""
    check_sections(data, what)
    init = data["model"].get("init")
    if init is None:
        return data, None
    folder = init_folder(init)
    data = dict(data)
    section = {k: v for k, v in data["model"].items() if k != "init"}
    fields = {**init_spec_fields(folder), **section}
    check_init_weights(folder, load_model(fields))
    own_data = data.get("data", {})
    if isinstance(own_data, dict) and own_data.get("tokenizer") is None:
        data["data"] = {**own_data, "tokenizer": init_tokenizer(init, folder)}
    data["model"] = fields
    return data, folder


def resolved_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None,
                    sets: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """A training config TOML read (``config.config_tables``: ``sets``, then ``overrides``), its ``[model] init``
    resolved (``resolve_init``) and validated (``config.config_from_dict``): what a run trains."""
    data, what = config_tables(path, overrides, sets)
    data, folder = resolve_init(data, what)
    return config_from_dict(data, what, init=folder)


def load_init(parts: list[nn.Module], path: str | Path, spec: ModelSpec) -> int:
    """Fill the (already parallelized, materialised) parts from a resolved ``[model] init`` folder, each rank its
    own slices (runtime/weights.py) -> elements this rank read."""
    if (Path(path) / "model.json").exists():  # a trainscale model folder: its tensors by trainscale name
        return load_folder_into(parts, path)
    return load_hf_init(parts, path, spec)
