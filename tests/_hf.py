"""Helpers of the Hugging Face family tests (test_hf_families.py, test_hf_rope_scaling.py): trainscale's model read
from a transformers-saved folder through the one bridge, and the largest logit difference between two models."""

from __future__ import annotations

from pathlib import Path

import torch

from trainscale.runtime.hf_init import hf_folder_spec, load_hf_init
from trainscale.runtime.model import build_model


def ours(folder: Path, **update) -> torch.nn.Module:
    """trainscale's model of ``folder`` (its config.json's spec, ``update`` applied), its weights read by
    runtime.hf_init, in eval mode."""
    spec = hf_folder_spec(folder).model_copy(update=update)
    model = build_model(spec, "meta")
    model.to_empty(device="cpu")
    load_hf_init([model], folder, spec)
    return model.eval()


def logit_diff(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    """max |logits(a) - logits(b)| on ``x`` (a transformers model's output read through its .logits)."""
    with torch.no_grad():
        la, lb = (m(x) for m in (a, b))
        la, lb = (getattr(t, "logits", t) for t in (la, lb))
        return (la - lb).abs().max().item()
