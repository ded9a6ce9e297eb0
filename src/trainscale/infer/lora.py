"""LoRA fine-tuning (Hu et al. 2021, arXiv 2106.09685): frozen base weights, trainable low-rank updates.

Each adapted projection y = W0 x becomes y = W0 x + (alpha / r) · B A x with A [r, d_in] and
B [d_out, r]; A starts Kaiming-uniform and B at zero, so training starts from the base model exactly
(Sec. 4.1, and the authors' loralib). Only A and B get gradients and Adam state; ``merge`` folds
W = W0 + (alpha / r) · B A back into plain Linear layers, so a merged model is an ordinary model folder.

An adapter folder holds adapter.safetensors (A and B per adapted projection), adapter.json (base
folder, rank, alpha, targets, losses), model.json and tokenizer.json; with ``--merge`` also the
merged model.safetensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from trainscale.errors import TrainscaleError
from trainscale.estimate.lora import lora_targets
from trainscale.runtime.data.sources import corpus_text
from trainscale.runtime.model import lm_loss
from trainscale.safeio import read_json_object

ADAPTER_FILE = "adapter.safetensors"


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scaling = alpha / rank
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        # Kaiming-uniform with a = sqrt(5), as nn.Linear and loralib initialise A
        bound = 1.0 / math.sqrt(base.in_features)
        with torch.no_grad():
            self.lora_a.copy_(torch.rand(self.lora_a.shape, generator=generator) * 2 * bound - bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scaling

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.base.weight += (self.lora_b @ self.lora_a) * self.scaling
        return self.base


def _projections(model, targets: tuple[str, ...]):
    """(path, parent module, attribute) of each targeted projection, layer by layer."""
    for i, layer in model.layers.items():
        for t in targets:
            # a MoE layer has no dense feed_forward (estimate.lora.lora_targets keeps MoE models to attention)
            parent = layer.attention if t in ("wq", "wk", "wv", "wo") else getattr(layer, "feed_forward", None)
            if parent is not None and hasattr(parent, t):
                sub = "attention" if parent is layer.attention else "feed_forward"
                yield f"layers.{i}.{sub}.{t}", parent, t


def apply_lora(model, rank: int, alpha: float, targets: tuple[str, ...], seed: int = 0) -> list[str]:
    """Freeze every parameter, wrap the targeted projections with adapters; -> adapted paths."""
    if rank <= 0:
        raise TrainscaleError(f"LoRA rank must be positive, not {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for path, parent, attr in _projections(model, targets):
        base = getattr(parent, attr)
        if rank > min(base.in_features, base.out_features):
            raise TrainscaleError(f"LoRA rank {rank} exceeds the smaller side of {path} "
                                  f"({base.out_features} x {base.in_features})")
        setattr(parent, attr, LoRALinear(base, rank, alpha, gen))
        paths.append(path)
    return paths


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".lora_" in k}


def load_adapter_weights(model, sd: dict[str, torch.Tensor]) -> None:
    own = adapter_state_dict(model)
    if set(own) != set(sd):
        diff = sorted(set(own) ^ set(sd))[:3]
        raise TrainscaleError(f"the adapter file does not match its adapter.json: tensors {diff}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in sd:
                p.copy_(sd[name])


def merge_lora(model):
    """Replace every LoRALinear by its base Linear with W0 + (alpha/r)·B·A; names return to the base's."""
    for layer in model.layers.values():
        for parent in (layer.attention, getattr(layer, "feed_forward", None)):
            for attr, mod in list(parent.named_children()) if parent is not None else ():
                if isinstance(mod, LoRALinear):
                    setattr(parent, attr, mod.merged())
    return model


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the real Adam state: the m and v tensors, and torch's per-tensor step counters apart."""
    moments = steps = 0
    for st in opt.state.values():
        for key, t in st.items():
            if not isinstance(t, torch.Tensor):
                continue
            if key in ("exp_avg", "exp_avg_sq"):
                moments += t.numel() * t.element_size()
            else:
                steps += t.numel() * t.element_size()
    return {"moments": moments, "step_counters": steps}


MAX_DATA_BYTES = 1 << 30  # LoRA holds its token ids in memory (a list of ints): a gigabyte of text at most


def read_data(data: str, tokenizer, text_field: str = "text", folder: Path | None = None,
              vocab: int | None = None) -> list[int]:
    """Token ids of ``data``: corpus:train / corpus:val (the Shakespeare plays), else a file, folder or glob read
    as ``train`` reads its ``[data] files`` (runtime/data/sources.py: plain text, one document per paragraph;
    JSONL and Parquet, a document per line / row from ``text_field``; token files), each document's tokens
    followed by the end-of-text token, as the training shards pack them (runtime/data/shards.py)."""
    if data in ("corpus:train", "corpus:val"):
        ids = tokenizer.encode(corpus_text(data.split(":")[1])).ids
    else:
        ids = _document_ids(data, tokenizer, text_field, folder, vocab)
    if len(ids) < 64:
        raise TrainscaleError(f"data {data} has {len(ids)} tokens; LoRA training needs at least 64")
    return ids


def _document_ids(data: str, tokenizer, text_field: str, folder: Path | None, vocab: int | None) -> list[int]:
    from trainscale.runtime.data.sources import Settings, plan_units, resolve_sources, unit_documents
    from trainscale.runtime.data.tokenizer import encode_lengths, eot_of

    if not data.strip():
        raise TrainscaleError("--data is empty; name a text, JSONL or Parquet file, a folder or a glob")
    try:  # resolve_sources asks is_dir(), which raises for a name too long
        Path(data).expanduser().is_dir()
    except (OSError, ValueError) as e:
        raise TrainscaleError(f"data file {data[:200]} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    sources = resolve_sources((data,))
    if sum(s.size for s in sources) > MAX_DATA_BYTES:
        raise TrainscaleError(f"data {data} holds more than {MAX_DATA_BYTES >> 30} GiB; LoRA keeps its tokens in "
                              "memory: give it a smaller file")
    try:
        eot = tokenizer.token_to_id(eot_of(tokenizer, str(folder) if folder is not None else None, None))
    except TrainscaleError:
        raise TrainscaleError(f"the tokenizer of {folder} has no end-of-text token to end the documents of "
                              f"{data} with") from None
    settings = Settings(text_field=text_field, held_out=0.0)
    ids: list[int] = []
    for unit in plan_units(sources, settings.unit_bytes, settings.documents, eot):
        docs = unit_documents(sources, unit, settings, eot, vocab)
        for arr in docs.arrays or ():  # token files: ids as they are, the end-of-text token added where missing
            ids += arr.tolist() + ([eot] if arr[-1] != eot else [])
        if docs.texts:
            arr, _ = encode_lengths(tokenizer, docs.texts, [True] * len(docs.texts), eot, "int64")
            ids += arr.tolist()
    return ids


def train_lora(model, ids: list[int], steps: int, batch: int, seq_len: int, lr: float, seed: int = 0,
               progress=None) -> dict[str, Any]:
    """Adam on the adapters only, random windows of ``ids``; -> losses and measured state bytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainscaleError("the model has no trainable parameters; apply LoRA adapters first")
    seq_len = min(seq_len, len(ids) - 1, model.spec.max_seq_len)
    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=gen)
        chunk = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
        loss = lm_loss(model(chunk[:, :-1]), chunk[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, losses[-1])
    model.eval()
    return {"losses": losses, "optimizer_bytes": optimizer_state_bytes(opt),
            "trainable_params": trainable_params(model)}


# the tokenizer's files an adapter folder carries from its base: the vocabulary, and a Hugging Face folder's
# settings (eos_token, chat_template: transformers' tokenizer_config.json / special_tokens_map.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_adapter_folder(out: Path, model, spec, base_folder: Path, config: dict[str, Any]) -> Path:
    """OUT/{adapter.safetensors, adapter.json (its base: the folder's absolute path and its format, "trainscale" or
    "hf"), model.json (the base's ModelSpec), the base's tokenizer files}."""
    from trainscale.safeio import read_bytes

    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(model), str(out / ADAPTER_FILE), metadata={"producer": "trainscale", "kind": "lora"})
    fmt = "trainscale" if (base_folder / "model.json").exists() else "hf"
    (out / "adapter.json").write_text(json.dumps({"base": str(base_folder.resolve()), "base_format": fmt, **config},
                                                 indent=2))
    (out / "model.json").write_text(json.dumps(spec.model_dump(by_alias=True, exclude_none=True), indent=2))
    for name in TOKENIZER_FILES:
        tok = base_folder / name
        if tok.exists() and tok.resolve() != (out / name).resolve():
            (out / name).write_bytes(read_bytes(tok, f"the base's {name}"))
    return out


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter folder's adapter.json says: its base model folder and the adapters' shape."""

    base: str
    rank: int
    alpha: float
    targets: tuple[str, ...]


def read_adapter_config(folder: Path) -> AdapterConfig:
    """adapter.json of ``folder``, checked: rank and alpha in range, the base another folder than this one."""
    cfg = read_json_object(folder / "adapter.json", "adapter description")
    try:
        base, rank, alpha, targets = cfg["base"], int(cfg["rank"]), float(cfg["alpha"]), tuple(cfg["targets"])
    except (KeyError, TypeError, ValueError) as e:
        raise TrainscaleError(f"{folder / 'adapter.json'} is corrupt or incomplete: {e}") from None
    if not (0 < rank <= 1 << 16 and math.isfinite(alpha) and 0 < alpha <= 1e6):
        raise TrainscaleError(f"{folder / 'adapter.json'}: rank {rank} or alpha {alpha} is out of range")
    if not isinstance(base, str) or Path(base).resolve() == Path(folder).resolve() or \
            Path(folder).resolve() in Path(base).resolve().parents:
        raise TrainscaleError(f"{folder / 'adapter.json'}: its base {base!r} must be another model folder")
    return AdapterConfig(base, rank, alpha, targets)


def fold_adapter(model, spec, folder: Path, cfg: AdapterConfig):
    """The base ``model`` (fp32) with ``folder``'s adapters applied and merged into its weights."""
    try:
        names = lora_targets(spec, cfg.targets)
    except ValueError as e:
        raise TrainscaleError(f"{folder / 'adapter.json'}: {e}") from None
    apply_lora(model, cfg.rank, cfg.alpha, names)
    try:
        sd = load_file(str(folder / ADAPTER_FILE))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{folder / ADAPTER_FILE} is corrupt or unreadable: {e}") from None
    load_adapter_weights(model, sd)
    return merge_lora(model)
