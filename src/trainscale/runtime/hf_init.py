"""Start training from a Hugging Face folder: ``[model] init = "PATH"`` (Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3).

The folder holds ``config.json`` (the model: ``hf.spec_fields``) and the weights, one
``model.safetensors`` or several shards named by ``model.safetensors.index.json``. The model is built
on the meta device, parallelized (TP, FSDP, pipeline stages...), given empty local shards, and each
rank then fills exactly the slice of each tensor it owns with ``safe_open(...).get_slice`` (a read of
those bytes from the file, no full tensor): a DTensor's local shard is the box
``compute_local_shape_and_global_offset`` names, a pipeline stage reads only its own layers.

Names and row orders go through ``trainscale.hf``, the one trainscale <-> Hugging Face mapping (the
exporter uses it the other way): the folder's ``model_type`` picks the family's tensor names
(``hf.FAMILIES``), and Q and K rows, in Hugging Face's rotate-half order, are permuted head by head
(``hf.rope_half_to_interleaved``); a shard that starts or ends inside a head reads the whole heads around it
(at most two heads more) and keeps its rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainscale import hf
from trainscale.errors import TrainscaleError
from trainscale.runtime.model import build_model
from trainscale.specs import ModelSpec, load_model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def hf_folder(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise TrainscaleError(f"[model] init {path} is not a folder (a Hugging Face model folder with config.json "
                              "and safetensors)")
    if not (p / "config.json").exists():
        raise TrainscaleError(f"[model] init {path} has no config.json")
    if not (p / INDEX).exists() and not (p / SINGLE).exists():
        raise TrainscaleError(f"[model] init {path} has no {SINGLE} or {INDEX} (only safetensors weights load)")
    return p


def hf_folder_spec(path: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face folder the runtime loads; anything trainscale's model would compute
    differently is refused in one sentence (``hf.check_loadable``)."""
    config = hf_folder(path) / "config.json"
    hf.check_loadable(hf.read_config(config), path)
    return load_model(config)


class HFWeights:
    """The tensors of a Hugging Face folder by name, read slice by slice, each file opened once."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.folder = hf_folder(path)
        self.family = hf.check_loadable(hf.read_config(self.folder / "config.json"), path)
        self.file_of = _weight_map(self.folder / INDEX) if (self.folder / INDEX).exists() else {}
        self._open = safe_open
        self._files: dict[str, object] = {}
        if not self.file_of:  # one file: its header names the tensors
            self.file_of = {k: SINGLE for k in self._file(SINGLE).keys()}  # type: ignore[attr-defined]
        self.elements_read = 0

    def _file(self, name: str):
        if name not in self._files:
            path = self.folder / name
            try:
                self._files[name] = self._open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types and OSError
                raise TrainscaleError(f"{path} cannot be read as safetensors: {e}") from None
        return self._files[name]

    def slice(self, name: str):
        if name not in self.file_of:
            raise TrainscaleError(f"[model] init {self.folder} lacks the tensor {name}")
        return self._file(self.file_of[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        t = self.slice(name)[box]
        self.elements_read += t.numel()
        return t


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded folder's index: tensor name -> the file holding it (``hf.read_index``: a file name in the folder)."""
    return hf.read_index(index)


def expected_tensors(spec: ModelSpec, family: hf.Family) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor trainscale's model of ``spec`` takes from a ``family`` folder."""
    return {hf.hf_name(n, family): tuple(p.shape) for n, p in build_model(spec, "meta").named_parameters()}


def check_hf_weights(path: str | Path, spec: ModelSpec) -> None:
    """Every tensor the model needs is in the folder with its shape (headers only: no weights are read)."""
    w = HFWeights(path)
    for name, shape in expected_tensors(spec, w.family).items():
        got = w.shape(name)
        if got != shape:
            raise TrainscaleError(f"[model] init {path}: {name} has shape {list(got)}, but the model needs "
                                  f"{list(shape)} (a [model] field overriding config.json?)")


def _local_box(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the tensor holding this rank's elements, their shape, their offset in the global tensor)."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p._local_tensor, tuple(shape), tuple(offset)
    return p, tuple(p.shape), (0,) * p.ndim


def load_into(module: nn.Module, weights: HFWeights, spec: ModelSpec) -> None:
    """Fill every parameter of ``module`` (a model, a pipeline stage; plain or sharded) with its slice."""
    hd = spec.head_dim
    with torch.no_grad():
        for name, p in module.named_parameters():
            local, shape, offset = _local_box(p)
            if 0 in shape:
                continue  # an FSDP rank past the end of an unevenly sharded tensor holds nothing of it
            box = [slice(o, o + n) for o, n in zip(offset, shape, strict=True)]
            heads, hf_name = hf.rope_permuted_heads(name, spec), hf.hf_name(name, weights.family)
            if heads is None:
                t = weights.read(hf_name, tuple(box))
            else:  # read whole heads, permute them, keep this rank's rows
                lo, hi = box[0].start, box[0].stop
                h0, h1 = lo // hd, -(-hi // hd)
                t = weights.read(hf_name, (slice(h0 * hd, h1 * hd), *box[1:]))
                t = hf.rope_half_to_interleaved(t, h1 - h0, hd)[lo - h0 * hd:hi - h0 * hd]
            local.copy_(t.to(local.dtype))


def load_hf_init(parts: list[nn.Module], path: str | Path, spec: ModelSpec) -> int:
    """Fill the (already parallelized, materialised) parts from the folder; -> elements this rank read."""
    if (Path(path) / "model.json").exists():  # a trainscale model folder (runtime/artifact.init_folder)
        from trainscale.runtime.artifact import load_folder_into

        return load_folder_into(parts, path)
    weights = HFWeights(path)
    for part in parts:
        load_into(part, weights, spec)
    return weights.elements_read
