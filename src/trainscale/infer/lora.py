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
from trainscale.infer.quantize import GROUP_SIZES, QuantConfig, QuantizedLinear, quantize_linears
from trainscale.runtime.data.sources import corpus_text
from trainscale.runtime.model import IGNORE, lm_loss_sum
from trainscale.safeio import read_json_object

ADAPTER_FILE = "adapter.safetensors"


class LoRALinear(nn.Module):
    """A frozen projection (an ``nn.Linear``, or a ``QuantizedLinear``: QLoRA's base) plus (alpha / r) · B A; the
    adapters in the base's dtype, fp32 over a quantized base."""

    def __init__(self, base: nn.Linear | QuantizedLinear, rank: int, alpha: float,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scaling = alpha / rank
        ref = base.weight if isinstance(base, nn.Linear) else base.qweight
        dtype = ref.dtype if isinstance(base, nn.Linear) else torch.float32
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=dtype, device=ref.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=ref.device))
        # Kaiming-uniform with a = sqrt(5), as nn.Linear and loralib initialise A
        bound = 1.0 / math.sqrt(base.in_features)
        with torch.no_grad():
            self.lora_a.copy_(torch.rand(self.lora_a.shape, generator=generator) * 2 * bound - bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scaling

    def merged(self) -> nn.Linear:
        """The base with the update folded in: W0 + (alpha/r)·B·A (a quantized base: its dequantized weight)."""
        base = self.base.to_linear() if isinstance(self.base, QuantizedLinear) else self.base
        with torch.no_grad():
            base.weight += (self.lora_b @ self.lora_a).to(base.weight.dtype) * self.scaling
        return base


def _projections(model, targets: tuple[str, ...]):
    """(path, parent module, attribute) of each targeted projection, layer by layer."""
    for i, layer in model.layers.items():
        for t in targets:
            # a MoE layer has no dense feed_forward (estimate.lora.lora_targets keeps MoE models to attention)
            parent = layer.attention if t in ("wq", "wk", "wv", "wo") else getattr(layer, "feed_forward", None)
            if parent is not None and hasattr(parent, t):
                sub = "attention" if parent is layer.attention else "feed_forward"
                yield f"layers.{i}.{sub}.{t}", parent, t


BASE_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # every dense projection of a layer (a MoE: attention)
QLORA_GROUP_SIZE = 64  # QLoRA's block size for the base weights (Dettmers et al. 2023, arXiv 2305.14314, Sec. 3)


def quantize_base(model, bits: int, group_size: int = QLORA_GROUP_SIZE) -> dict[str, int]:
    """Hold every layer's dense projections quantized (int4 or int8 groups of ``group_size``, infer/quantize.py's
    quantizer; a ``QuantizedLinear`` each), the rest (embeddings, norms, output head) as they are: QLoRA's frozen
    base. Call before ``apply_lora``. -> quantize_linears' counts (weights, bytes held, their bf16 bytes)."""
    if bits not in (4, 8):
        raise TrainscaleError(f"--base-bits must be 4 or 8, not {bits}")
    return quantize_linears(model, QuantConfig(f"int{bits}", group_size), list(_projections(model, BASE_LINEARS)))


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
    """Replace every LoRALinear by its base Linear with W0 + (alpha/r)·B·A, and every QuantizedLinear left (a
    projection a QLoRA run did not adapt) by its dequantized Linear; names return to the base's."""
    for layer in model.layers.values():
        for parent in (layer.attention, getattr(layer, "feed_forward", None)):
            for attr, mod in list(parent.named_children()) if parent is not None else ():
                if isinstance(mod, LoRALinear):
                    setattr(parent, attr, mod.merged())
                elif isinstance(mod, QuantizedLinear):
                    setattr(parent, attr, mod.to_linear())
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
# The fraction of documents LoRA holds out to measure itself: the trainer's rule (runtime/data/sources.py:
# Settings.held_mask, a hash of each document's position, never chance), with a larger fraction than the
# trainer's default 0.05 (runtime/config.py [data] held_out), as fine-tuning sets are small.
LORA_HELD_OUT = 0.1
EVAL_TOKENS = 32768  # held-out tokens LoRA measures itself on at most (evaluate's default --max-tokens)


@dataclass
class DataSplit:
    """``data``'s documents, each tokenised and followed by the end-of-text token, in reading order: those the
    trainer's hash rule holds out (``fraction`` of them) and the rest."""

    data: str
    text_field: str
    fraction: float
    train: list[int]
    held: list[int]
    documents: int = 0
    held_documents: int = 0
    truncated: bool = False  # reading stopped at max_tokens

    def describe(self, which: str = "held-out") -> str:
        """One sentence: which text, which split, how many documents and tokens."""
        field = f" (field '{self.text_field}')" if not self.data.startswith("corpus:") else ""
        if which == "all":
            n, docs = len(self.train) + len(self.held), self.documents
            return f"{self.data}{field}: all {docs:,} documents, {n:,} tokens" + (" (first)" if self.truncated else "")
        if which == "held-out":
            n, docs = len(self.held), self.held_documents
        else:
            n, docs = len(self.train), self.documents - self.held_documents
        return (f"{self.data}{field}: the {which} documents ({docs:,} of {self.documents:,}"
                f"{' read' if self.truncated else ''}; the trainer's hash rule, {self.fraction:.0%} held out), "
                f"{n:,} tokens")


def data_record(data: str) -> str:
    """``data`` as adapter.json records it: an existing file or folder by its absolute path (so that ``evaluate``
    finds it again from anywhere), a glob or corpus:NAME as given."""
    try:
        p = Path(data).expanduser()
        return str(p.resolve()) if not data.startswith("corpus:") and p.exists() else data
    except (OSError, ValueError):
        return data


def read_data(data: str, tokenizer, text_field: str = "text", folder: Path | None = None,
              vocab: int | None = None) -> list[int]:
    """Token ids of every document of ``data`` in order (``split_data`` with nothing held out)."""
    ids = split_data(data, tokenizer, text_field, folder, vocab, held_out=0.0).train
    if len(ids) < 64:
        raise TrainscaleError(f"data {data} has {len(ids)} tokens; LoRA training needs at least 64")
    return ids


def split_data(data: str, tokenizer, text_field: str = "text", folder: Path | None = None, vocab: int | None = None,
               held_out: float = LORA_HELD_OUT, max_tokens: int | None = None, keep: str = "both") -> DataSplit:
    """``data``'s documents split as the trainer splits them: corpus:train / corpus:val (the Shakespeare plays, a
    document per paragraph), else a file, folder or glob read as ``train`` reads its ``[data] files``
    (runtime/data/sources.py: plain text, one document per paragraph; JSONL and Parquet, a document per line / row
    from ``text_field``; token files), each document's tokens followed by the end-of-text token as the training
    shards pack them (runtime/data/shards.py); a document is held out by ``Settings.held_mask`` (the hash of its
    position). ``keep`` ("both", "held-out", "all") and ``max_tokens`` let an evaluation stop reading early."""
    out = DataSplit(data, text_field, held_out, [], [])
    for docs, held in _unit_documents(data, tokenizer, text_field, folder, vocab, held_out):
        for ids, h in zip(docs, held.tolist(), strict=True):
            out.documents += 1
            out.held_documents += bool(h)
            if keep == "held-out" and not h:
                continue
            (out.held if h and keep != "all" else out.train).extend(ids)
        if max_tokens is not None and len(out.train) + len(out.held) >= max_tokens:
            out.truncated = True
            break
    if max_tokens is not None:
        out.train, out.held = out.train[:max_tokens], out.held[:max_tokens]
    return out


def _eot(tokenizer, folder: Path | None, data: str, required: bool = True) -> int | None:
    from trainscale.runtime.data.tokenizer import eot_of

    try:
        return tokenizer.token_to_id(eot_of(tokenizer, str(folder) if folder is not None else None, None))
    except TrainscaleError:
        if not required:
            return None
        raise TrainscaleError(f"the tokenizer of {folder} has no end-of-text token to end the documents of "
                              f"{data} with") from None


def _unit_documents(data: str, tokenizer, text_field: str, folder: Path | None, vocab: int | None, held_out: float):
    """-> per unit of the data: (token ids of each document, whether each is held out)."""
    import re

    import numpy as np

    from trainscale.runtime.data.sources import Settings, plan_units, resolve_sources, unit_documents
    from trainscale.runtime.data.tokenizer import encode_lengths

    settings = Settings(text_field=text_field, held_out=held_out)
    if data in ("corpus:train", "corpus:val"):
        texts = [t.strip("\n") for t in re.split(r"\n[ \t\f\v]*\n", corpus_text(data.split(":")[1])) if t.strip()]
        eot = _eot(tokenizer, folder, data, required=False)
        encs = tokenizer.encode_batch(texts, add_special_tokens=False)
        yield [e.ids + ([eot] if eot is not None else []) for e in encs], settings.held_mask(data, len(texts))
        return
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
    eot = _eot(tokenizer, folder, data)
    for unit in plan_units(sources, settings.unit_bytes, settings.documents, eot):
        docs = unit_documents(sources, unit, settings, eot, vocab)
        # token files: ids as they are, the end-of-text token added where missing (a unit never mixes them with text)
        out = [arr.tolist() + ([eot] if arr[-1] != eot else []) for arr in docs.arrays or ()]
        if docs.texts:
            arr, lengths = encode_lengths(tokenizer, docs.texts, [True] * len(docs.texts), eot, "int64")
            out += [a.tolist() for a in np.split(arr, np.cumsum(lengths)[:-1])]
        yield out, docs.held


# ------------------------------------------------------------------ chat data


def is_chat_data(data: str, text_field: str = "text") -> bool:
    """Whether ``data`` is one JSONL file of conversations: its first record has ``messages``, or ``prompt`` and
    ``response`` (runtime/data/chat.py's two forms), and no ``text_field``."""
    import json

    p = Path(data).expanduser()
    try:
        if p.suffix.lower() not in (".jsonl", ".ndjson") or not p.is_file():
            return False
        from trainscale.runtime.data.chat import MAX_LINE_BYTES
        from trainscale.safeio import check_regular

        with open(check_regular(p, "data file"), "rb") as f:
            while line := f.readline(MAX_LINE_BYTES + 1):
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and text_field not in obj and \
                        ("messages" in obj or ("prompt" in obj and "response" in obj))
    except (OSError, ValueError, RecursionError, TrainscaleError):
        return False
    return False


Conversation = tuple[list[int], list[bool]]  # token ids, and which are learned (runtime/data/chat.encode_example)


@dataclass
class ChatSplit:
    """A chat JSONL file's conversations, rendered with the base's chat template and tokenized, each with its
    learned flags (the assistant's words and end-of-turn): those the trainer's hash rule holds out and the rest."""

    data: str
    fraction: float
    train: list[Conversation]
    held: list[Conversation]
    documents: int = 0
    held_documents: int = 0
    truncated: bool = False

    @staticmethod
    def learned(convs: list[Conversation]) -> int:
        """Learned targets: flags on every token but each conversation's first (which no position predicts)."""
        return sum(sum(f[1:]) for _, f in convs)

    def describe(self, which: str = "held-out") -> str:
        convs = self.train + self.held if which == "all" else self.held if which == "held-out" else self.train
        n = self.documents if which == "all" else self.held_documents if which == "held-out" else \
            self.documents - self.held_documents
        read = " read" if self.truncated else ""
        rule = f"; the trainer's hash rule, {self.fraction:.0%} held out" if which != "all" else ""
        which = f"the {which} conversations ({n:,} of {self.documents:,}{read}{rule})" if which != "all" else \
            f"all {n:,} conversations{' (first)' if self.truncated else ''}"
        return (f"{self.data} (chat): {which}, {sum(len(i) for i, _ in convs):,} tokens of which "
                f"{self.learned(convs):,} learned (assistant)")


def split_chat(data: str, folder: Path, held_out: float = LORA_HELD_OUT, vocab: int | None = None,
               max_tokens: int | None = None, keep: str = "both") -> ChatSplit:
    """The conversations of the chat JSONL file ``data`` as the trainer reads them (runtime/data/sources.py, format
    "chat": a conversation per line, held out by ``Settings.held_mask``), rendered with the chat template of the
    model folder ``folder`` (runtime/data/chat.py: ``encode_line``, learned flags). ``keep`` / ``max_tokens`` as
    ``split_data``'s."""
    from trainscale.runtime.data.chat import encode_line, load_chat_tokenizer
    from trainscale.runtime.data.sources import Settings, line_of, plan_units, resolve_sources, unit_documents

    chat = load_chat_tokenizer(folder)
    settings = Settings(held_out=held_out)
    sources = resolve_sources((data,), fmt="chat")
    if sum(s.size for s in sources) > MAX_DATA_BYTES:
        raise TrainscaleError(f"data {data} holds more than {MAX_DATA_BYTES >> 30} GiB; LoRA keeps its tokens in "
                              "memory: give it a smaller file")
    out, tokens = ChatSplit(data, held_out, [], []), 0
    for unit in plan_units(sources, settings.unit_bytes, settings.documents, None):
        docs = unit_documents(sources, unit, settings, None, vocab)
        for line, (path, offset), h in zip(docs.texts, docs.origins, docs.held.tolist(), strict=True):
            out.documents += 1
            out.held_documents += bool(h)
            if keep == "held-out" and not h:
                continue
            ids, flags = encode_line(line, chat, lambda p=path, o=offset: f"chat data file {p} line {line_of(p, o)}")
            if vocab is not None and max(ids, default=0) >= vocab:
                raise TrainscaleError(f"the chat tokenizer of {folder} made token id {max(ids)}, outside the model's "
                                      f"vocabulary of {vocab:,}")
            (out.held if h and keep != "all" else out.train).append((ids, flags))
            tokens += len(ids)
            if max_tokens is not None and tokens >= max_tokens:
                out.truncated = True
                return out
    return out


def chat_rows(convs: list[Conversation], seq_len: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One conversation per row, its first ``seq_len`` + 1 tokens: inputs [n, s] (right-padded with ``pad``) and
    targets [n, s], the next token where it is learned, IGNORE elsewhere (prompts, template text, padding). Causal
    attention keeps a row's real tokens from seeing the padding after them, and each row's positions start at 0:
    the padded batch computes each conversation exactly as alone."""
    cut = [(ids[: seq_len + 1], flags[: seq_len + 1]) for ids, flags in convs]
    width = max(len(ids) for ids, _ in cut) - 1
    inputs = torch.full((len(cut), max(width, 1)), pad, dtype=torch.long)
    targets = torch.full((len(cut), max(width, 1)), IGNORE, dtype=torch.long)
    for r, (ids, flags) in enumerate(cut):
        n = len(ids) - 1
        if n < 1:
            continue
        inputs[r, :n] = torch.tensor(ids[:-1])
        t = torch.tensor(ids[1:])
        t[~torch.tensor(flags[1:], dtype=torch.bool)] = IGNORE
        targets[r, :n] = t
    return inputs, targets


def train_lora_chat(model, convs: list[Conversation], steps: int, batch: int, seq_len: int, lr: float,
                    seed: int = 0, progress=None) -> dict[str, Any]:
    """``train_adapters`` on ``batch`` random conversations a step (``chat_rows``): the loss over learned tokens."""
    if not ChatSplit.learned(convs):
        raise TrainscaleError("the training conversations have no assistant token to learn")
    seq_len = min(seq_len, model.spec.max_seq_len)

    def rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(convs), (batch,), generator=gen).tolist()
        return chat_rows([convs[i] for i in pick], seq_len)

    return train_adapters(model, rows, steps, lr, seed, progress)


def lora_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy, number of tokens counted) of ``model`` on ``inputs`` [b, s], over the
    ``targets`` [b, s] that are not IGNORE (-100: padding, or a chat's prompt tokens). The one loss of LoRA's
    training (its mean) and of every evaluation in infer/ (infer/evaluate.perplexity sums it). The loss itself is
    the trainer's (runtime/model.lm_loss_sum); this adds the forward pass and the count."""
    return lm_loss_sum(model(inputs), targets), int((targets != IGNORE).sum())


def train_lora(model, ids: list[int], steps: int, batch: int, seq_len: int, lr: float, seed: int = 0,
               progress=None) -> dict[str, Any]:
    """Adam on the adapters only, random windows of ``ids``; -> losses and measured state bytes."""
    seq_len = min(seq_len, len(ids) - 1, model.spec.max_seq_len)
    if seq_len < 1:
        raise TrainscaleError(f"LoRA training needs at least two tokens, not {len(ids)}")
    data = torch.tensor(ids)

    def windows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=gen)
        chunk = torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()])
        return chunk[:, :-1], chunk[:, 1:]

    return train_adapters(model, windows, steps, lr, seed, progress)


def train_adapters(model, next_batch, steps: int, lr: float, seed: int = 0, progress=None) -> dict[str, Any]:
    """AdamW on the trainable parameters (the adapters), ``steps`` batches of ``next_batch(generator)`` ->
    (inputs, targets), each step the mean of ``lora_loss``; -> losses and measured state bytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainscaleError("the model has no trainable parameters; apply LoRA adapters first")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        inputs, targets = next_batch(gen)
        nll, count = lora_loss(model, inputs, targets)
        loss = nll / max(count, 1)
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")  # and every id that ends a reply (infer/chatfiles.py)


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
    base_bits: int = 0  # QLoRA: the adapters were trained on the base quantized to this many bits (0: as it is)
    base_group_size: int = QLORA_GROUP_SIZE


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
    bits, group = cfg.get("base_bits") or 0, cfg.get("base_group_size", QLORA_GROUP_SIZE)
    if bits not in (0, 4, 8) or group not in GROUP_SIZES:
        raise TrainscaleError(f"{folder / 'adapter.json'}: base_bits {bits!r} (0, 4 or 8) or base_group_size "
                              f"{group!r} ({', '.join(map(str, GROUP_SIZES))}) is out of range")
    return AdapterConfig(base, rank, alpha, targets, bits, group)


def fold_adapter(model, spec, folder: Path, cfg: AdapterConfig):
    """The base ``model`` (fp32) with ``folder``'s adapters applied and merged into its weights."""
    try:
        names = lora_targets(spec, cfg.targets)
    except ValueError as e:
        raise TrainscaleError(f"{folder / 'adapter.json'}: {e}") from None
    if cfg.base_bits:  # trained on the quantized base: the adapters fold into its dequantized weights
        quantize_base(model, cfg.base_bits, cfg.base_group_size)
    apply_lora(model, cfg.rank, cfg.alpha, names)
    try:
        sd = load_file(str(folder / ADAPTER_FILE))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{folder / ADAPTER_FILE} is corrupt or unreadable: {e}") from None
    load_adapter_weights(model, sd)
    return merge_lora(model)
