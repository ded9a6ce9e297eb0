"""This rank's part of a model's weights, read from safetensors files: the one loader both ``[model] init`` paths use
(a trainscale model folder, runtime/artifact.py; a Hugging Face folder, runtime/hf_init.py).

A parameter may be a plain tensor, a DTensor (TP, FSDP, EP shards) or a pipeline stage's share: ``local_box`` names
the box of the global tensor this rank holds (DTensor's ``compute_local_shape_and_global_offset``), and
``Safetensors.read`` reads exactly that box with ``safe_open(...).get_slice`` (those bytes from the file, never the
whole tensor). ``fill`` puts them together: every parameter of a module gets its box, by a reader the caller gives
(trainscale names as stored, or Hugging Face names with Q/K rows permuted).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from trainscale.errors import TrainscaleError

Box = tuple[slice, ...]


def local_box(p: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """(the tensor holding this rank's elements of ``p``, the box of the global tensor they are)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p._local_tensor, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return p, tuple(slice(0, n) for n in p.shape)


class Safetensors:
    """Tensors by name over the safetensors files of one folder, each file opened once, read box by box (a slice
    of the file, never a whole tensor); ``elements_read`` counts what was read. ``file_of``: name -> file in the
    folder (a sharded folder's index); without it, the tensors ``single``'s header names. ``what`` starts the
    sentence for a tensor the folder lacks."""

    def __init__(self, folder: str | Path, single: str, file_of: dict[str, str] | None = None,
                 what: str = "") -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.what = what or str(self.folder)
        self._open = safe_open
        self._files: dict[str, object] = {}
        self.file_of = dict(file_of or {})
        if not self.file_of:  # one file: its header names the tensors
            self.file_of = {k: single for k in self._file(single).keys()}  # type: ignore[attr-defined]
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
            raise TrainscaleError(f"{self.what} lacks the tensor {name}")
        return self._file(self.file_of[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())

    def read(self, name: str, box: Box) -> torch.Tensor:
        """The ``box`` of tensor ``name`` (only those bytes are read); a NaN or an infinity in it is one sentence
        naming the tensor (a model started from it would train NaN)."""
        t = self.slice(name)[box]
        self.elements_read += t.numel()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TrainscaleError(f"{self.what}: the tensor {name} holds NaN or infinite values")
        return t


def fill(module: nn.Module, read: Callable[[str, Box], torch.Tensor]) -> None:
    """Every parameter of ``module`` (a model, a pipeline stage; plain or sharded) gets this rank's box of it,
    ``read(parameter name, box)``."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            local, box = local_box(p)
            if any(s.stop <= s.start for s in box):
                continue  # an FSDP rank past the end of an unevenly sharded tensor holds nothing of it
            local.copy_(read(name, box).reshape(local.shape).to(local.dtype))
