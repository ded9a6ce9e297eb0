"""Start training from a Hugging Face folder: ``[model] init = "PATH"`` (the families of ``hf.LOADED_TYPES``).

The folder holds ``config.json`` (the model: ``hf.spec_fields``) and the weights, one
``model.safetensors`` or several shards named by ``model.safetensors.index.json``. The model is built
on the meta device, parallelized (TP, FSDP, pipeline stages...), given empty local shards, and each
rank then fills exactly the slice of each tensor it owns (runtime/weights.py, the one loader of a rank's
box: a read of those bytes from the file, no full tensor); a pipeline stage reads only its own layers.
runtime/init.py decides that an ``[model] init`` folder is a Hugging Face one and calls this module.

Names and row orders go through ``trainscale.hf``, the one trainscale <-> Hugging Face mapping (the
exporter uses it the other way): the folder's ``model_type`` picks the family's tensor names
(``hf.FAMILIES``), and Q and K rows, in Hugging Face's rotate-half order, are permuted head by head
(``hf.rope_half_to_interleaved``); a shard that starts or ends inside a head reads the whole heads around it
(at most two heads more) and keeps its rows. A part of a fused tensor (Phi-3's qkv_proj, gate_up_proj) is read as
the rows of that tensor from the part's first row on (``hf.hf_place``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainscale import hf
from trainscale.errors import TrainscaleError
from trainscale.runtime.model import build_model
from trainscale.runtime.weights import Box, Safetensors, fill
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


class HFWeights(Safetensors):
    """The tensors of a Hugging Face folder by name (runtime/weights.py's reader), with the folder's family."""

    def __init__(self, path: str | Path) -> None:
        folder = hf_folder(path)
        self.family = hf.check_loadable(hf.read_config(folder / "config.json"), path)
        super().__init__(folder, SINGLE, _weight_map(folder / INDEX) if (folder / INDEX).exists() else None,
                         what=f"[model] init {folder}")


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded folder's index: tensor name -> the file holding it (``hf.read_index``: a file name in the folder)."""
    return hf.read_index(index)


def expected_tensors(spec: ModelSpec, family: hf.Family) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor trainscale's model of ``spec`` takes from a ``family`` folder (a fused one,
    Phi-3's qkv_proj / gate_up_proj: the rows of all its parts)."""
    out: dict[str, tuple[int, ...]] = {}
    for n, p in build_model(spec, "meta").named_parameters():
        name, _, rows = hf.hf_place(n, family, spec)
        out[name] = (rows, *p.shape[1:]) if rows else tuple(p.shape)
    return out


def check_hf_weights(path: str | Path, spec: ModelSpec) -> None:
    """Every tensor the model needs is in the folder with its shape, and the folder holds no other (a layer more
    than config.json says, a tensor of another architecture: never left unread without a word); headers only, no
    weights are read. RoPE's ``inv_freq`` buffers, which older checkpoints saved, are recomputed and so ignored."""
    w = HFWeights(path)
    expected = expected_tensors(spec, w.family)
    for name, shape in expected.items():
        got = w.shape(name)
        if got != shape:
            raise TrainscaleError(f"[model] init {path}: {name} has shape {list(got)}, but the model needs "
                                  f"{list(shape)} (a [model] field overriding config.json?)")
    extra = sorted(n for n in w.file_of if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise TrainscaleError(f"[model] init {path} holds the tensor {extra[0]}{more}, which the model its "
                              f"config.json describes ({spec.n_layers} layers) has no place for")


def load_into(module: nn.Module, weights: HFWeights, spec: ModelSpec) -> None:
    """Fill every parameter of ``module`` (a model, a pipeline stage; plain or sharded) with its slice."""
    hd = spec.head_dim

    def read(name: str, box: Box) -> torch.Tensor:
        heads = hf.rope_permuted_heads(name, spec)
        hf_name, first, _ = hf.hf_place(name, weights.family, spec)  # first: the part's first row in a fused tensor
        if heads is None and not first:
            return weights.read(hf_name, box)
        lo, hi = box[0].start, box[0].stop
        if heads is None:
            return weights.read(hf_name, (slice(first + lo, first + hi), *box[1:]))
        h0, h1 = lo // hd, -(-hi // hd)  # read whole heads, permute them, keep this rank's rows
        t = weights.read(hf_name, (slice(first + h0 * hd, first + h1 * hd), *box[1:]))
        return hf.rope_half_to_interleaved(t, h1 - h0, hd)[lo - h0 * hd:hi - h0 * hd]

    fill(module, read)


def load_hf_init(parts: list[nn.Module], path: str | Path, spec: ModelSpec) -> int:
    """Fill the (already parallelized, materialised) parts from a Hugging Face folder; -> elements this rank read
    (runtime/init.load_init picks this or a trainscale model folder's loader)."""
    weights = HFWeights(path)
    for part in parts:
        load_into(part, weights, spec)
    return weights.elements_read
