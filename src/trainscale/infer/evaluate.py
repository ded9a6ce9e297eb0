"""Loss and perplexity of a model on a text, and which text it was.

Perplexity is exp(mean next-token cross-entropy) over the windows the trainer's held-out loss uses too
(runtime/evaluator.window_spans; ``perplexity``: infer/lora.py's ``lora_loss`` summed). The text is chosen in one
place, ``evaluation_text``, for ``evaluate``, ``quantize`` and ``lora``: a file the user names (all its documents,
or those the trainer's hash rule holds out), else the model's own held-out data (``held_out_of``: a LoRA folder's
data's held-out documents, a run's prepared held-out split, a run on the plays' held-out plays), and it says which
in one sentence with the token count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainscale.errors import TrainscaleError
from trainscale.infer.lora import (
    LORA_HELD_OUT,
    MAX_DATA_BYTES,
    ChatSplit,
    chat_rows,
    is_chat_data,
    lora_loss,
    split_chat,
    split_data,
)
from trainscale.runtime.artifact import RUN_CONFIG, RUN_TOKENIZER, run_folder_of, run_toml
from trainscale.runtime.data.sources import corpus_text
from trainscale.runtime.evaluator import window_batches
from trainscale.safeio import read_json_object

SPLITS = ("all", "held-out")
# A line of a text or JSONL file evaluate reads: a document, or a conversation, of at most ~250K tokens. A window
# scores at most max_seq_len + 1 tokens of it; a longer line (a 10 MB message) would be tokenised whole first.
MAX_EVAL_LINE_BYTES = 1 << 20
BATCH_TOKENS = 8192  # tokens a forward pass of short windows holds (8 windows of the model's own length at least)
FORMATS = ("auto", "text", "chat")


def eval_ids(tokenizer, text: str | None = None, max_tokens: int = 32768) -> list[int]:
    """Token ids of held-out text (default: the corpus's held-out plays), at most ``max_tokens``."""
    if text is None:
        text = corpus_text("val", max_chars=max_tokens * 8)
    ids = tokenizer.encode(text).ids[:max_tokens]
    if len(ids) < 2:
        raise TrainscaleError("the evaluation text is shorter than two tokens")
    return ids


@torch.no_grad()
def perplexity(model, ids: list[int], seq_len: int | None = None, batch: int | None = None) -> float:
    """exp of the mean NLL of every token after the first in each window of ``seq_len`` + 1 tokens."""
    total, count = nll_sum(model, ids, seq_len, batch)
    return math.exp(total / count)


@torch.no_grad()
def nll_sum(model, ids: list[int], seq_len: int | None = None, batch: int | None = None) -> tuple[float, int]:
    """(summed next-token NLL, tokens scored) over the windows of ``seq_len`` + 1 tokens that cover ``ids``
    (runtime/evaluator.window_spans: the trainer's held-out loss cuts its text the same way), ``batch`` windows a
    forward pass (default: 8, or as many as fill BATCH_TOKENS tokens: short windows are not one pass each)."""
    seq_len = min(seq_len or model.spec.max_seq_len, model.spec.max_seq_len)
    batch = batch or max(8, BATCH_TOKENS // seq_len)
    data = torch.tensor(ids)
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for group in window_batches(len(ids), seq_len, batch=batch):
        w = torch.stack([data[a:b] for a, b in group]).to(device)
        nll, k = lora_loss(model, w[:, :-1], w[:, 1:])
        total += float(nll)
        count += k
    return total, count


@torch.no_grad()
def chat_nll_sum(model, convs, seq_len: int | None = None, batch: int = 8) -> tuple[float, int]:
    """(summed NLL of the learned targets, their count) over conversations, one per row (infer/lora.chat_rows)."""
    seq_len = min(seq_len or model.spec.max_seq_len, model.spec.max_seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(convs), batch):
        inputs, targets = chat_rows(convs[i:i + batch], seq_len)
        nll, k = lora_loss(model, inputs.to(device), targets.to(device))
        total += float(nll)
        count += k
    return total, count


def score(model, text: EvalText, seq_len: int | None = None) -> tuple[float, int]:
    """(summed NLL, tokens scored) of ``model`` on an evaluation text: windows of its tokens, or, for chat data,
    its conversations' learned (assistant) tokens."""
    if text.conversations is not None:
        return chat_nll_sum(model, text.conversations, seq_len)
    return nll_sum(model, text.ids, seq_len)


# ------------------------------------------------------------------ which text


@dataclass(frozen=True)
class EvalText:
    """The text a model is evaluated on: its token ids, and what it is (one sentence, and its parts)."""

    ids: list[int]
    what: str
    kind: str  # "data" (--data), "adapter-data", "run-prepared", "run-plays", "default-plays"
    source: str  # the file, folder or corpus read
    split: str  # "all" or "held-out"
    conversations: list | None = None  # chat data: (ids, learned flags) each; ``ids`` then holds them all

    def report(self) -> dict[str, Any]:
        out = {"text": self.what, "text_kind": self.kind, "text_source": self.source, "split": self.split,
               "tokens": len(self.ids), "format": "chat" if self.conversations is not None else "text"}
        if self.conversations is not None:
            out |= {"conversations": len(self.conversations), "learned_tokens": ChatSplit.learned(self.conversations)}
        return out


def evaluation_text(folder: Path, tok, data: str | None = None, text_field: str = "text", split: str | None = None,
                    max_tokens: int = 32768, vocab: int | None = None, default_plays: bool = False,
                    fmt: str = "auto") -> EvalText:
    """The text to evaluate the model of ``folder`` on, at most ``max_tokens`` tokens of it.

    ``data`` given: its documents, all (``split`` "all", the default) or those the trainer's hash rule holds out
    (``held_fraction``: the fraction the model's adapter or run held out of it). No ``data``: the model's own
    held-out data (``held_out_of``); where there is none, the held-out plays if ``default_plays`` (quantize's
    default), else one sentence asking for --data. Chat data (``fmt`` "chat", or "auto" and a JSONL file of
    conversations) is scored on its learned (assistant) tokens only."""
    if fmt not in FORMATS:
        raise TrainscaleError(f"--format must be auto, text or chat, not {fmt!r}")
    if split is not None and split not in SPLITS:
        raise TrainscaleError(f"--split must be all or held-out, not {split!r}")
    if max_tokens < 2:
        raise TrainscaleError(f"an evaluation needs at least 2 tokens, not {max_tokens}")
    if data is not None:
        split = split or "all"
        check_lines(data)
        fraction, why = held_fraction(folder, data)
        if fmt == "chat" or (fmt == "auto" and is_chat_data(data, text_field)):
            return _chat_text(folder, data, split, fraction, why, max_tokens, vocab, "data")
        got = split_data(data, tok, text_field, folder, vocab, held_out=fraction, max_tokens=max_tokens,
                         keep="held-out" if split == "held-out" else "all")
        ids = got.held if split == "held-out" else got.train
        what = got.describe(split) + (f" ({why})" if split == "held-out" else "")
        return EvalText(_enough(ids, what), what, "data", data, split)
    if split == "all":
        raise TrainscaleError("--split all needs --data: name the text to evaluate on")
    held = held_out_of(folder, max_tokens)
    if held.kind == "default-plays" and not default_plays:
        raise TrainscaleError(f"{folder} has no held-out data of its own (not a LoRA folder, nor from a run folder "
                              "that says what it trained on); name the text to evaluate on with --data")
    if held.kind == "adapter-data":
        check_lines(held.data)
    if held.kind == "adapter-data" and held.chat:
        return _chat_text(folder, held.data, "held-out", held.fraction, f"what the LoRA adapter {folder} held out",
                          max_tokens, vocab, held.kind)
    if held.kind == "adapter-data":
        got = split_data(held.data, tok, held.text_field, folder, vocab, held_out=held.fraction,
                         max_tokens=max_tokens, keep="held-out")
        what = f"{got.describe('held-out')}, what the LoRA adapter {folder} held out of its data"
        return EvalText(_enough(got.held, what), what, held.kind, held.data, "held-out")
    ids = held.ids if held.ids is not None else eval_ids(tok, None, max_tokens)
    source = held.data or "the Shakespeare plays (runtime/data/sources.py)"
    return EvalText(_enough(ids, held.what), f"{held.what}, {len(ids):,} tokens", held.kind, source, "held-out")


def check_lines(data: str, limit: int | None = None) -> None:
    """Every line of the text, JSONL and chat files ``data`` names is at most ``limit`` bytes (default
    MAX_EVAL_LINE_BYTES), checked by streaming each file before any is tokenised; else one sentence naming the
    line. corpus:train / corpus:val, Parquet and token files are not line-based and are not scanned."""
    from trainscale.runtime.data.sources import resolve_sources

    if data in ("corpus:train", "corpus:val") or not data.strip():
        return
    limit = limit or MAX_EVAL_LINE_BYTES
    try:  # resolve_sources asks is_dir(), which raises for a name too long
        Path(data).expanduser().is_dir()
    except (OSError, ValueError):
        return  # split_data says so in its own sentence
    sources = resolve_sources((data,))
    if sum(s.size for s in sources) > MAX_DATA_BYTES:
        return  # split_data and split_chat refuse it in their own sentence, before reading it
    for src in sources:
        if src.format in ("text", "jsonl", "chat"):
            _check_file_lines(src.path, limit)


def _check_file_lines(path: str, limit: int) -> None:
    """Stream ``path`` in 1 MiB chunks; a line (counted across chunks) longer than ``limit`` is one sentence. The
    newlines are found by numpy, so a gigabyte of short lines takes seconds, not a Python loop per line."""
    import numpy as np

    from trainscale.safeio import check_regular

    line, carry = 1, 0  # the line the chunk starts in, and its bytes before the chunk
    try:
        with open(check_regular(path, "data file"), "rb") as f:
            while chunk := f.read(1 << 20):
                nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                # each line's bytes in this chunk (its last one: to the chunk's end), the first one's carry added
                lengths = np.diff(np.concatenate(([-1], nl, [len(chunk)]))) - 1
                lengths[0] += carry
                if int(lengths.max()) > limit:
                    raise TrainscaleError(f"data file {path} line {line + int(np.argmax(lengths > limit)):,} is "
                                          f"longer than {limit:,} bytes, more than evaluate reads as one document or "
                                          "conversation (a window scores at most the model's max_seq_len tokens of "
                                          "it); split it")
                carry, line = int(lengths[-1]), line + len(nl)
    except OSError as e:
        raise TrainscaleError(f"data file {path} cannot be read: {e.strerror}") from None


def _chat_text(folder: Path, data: str, split: str, fraction: float, why: str, max_tokens: int, vocab: int | None,
               kind: str) -> EvalText:
    got = split_chat(data, folder, fraction, vocab, max_tokens, keep="held-out" if split == "held-out" else "all")
    convs = got.held if split == "held-out" else got.train
    what = got.describe(split) + (f" ({why})" if split == "held-out" else "")
    if not ChatSplit.learned(convs):
        raise TrainscaleError(f"the evaluation text, {what}, has no learned (assistant) token; name more "
                              "conversations with --data (or --split all)")
    return EvalText([i for ids, _ in convs for i in ids], what, kind, data, split, convs)


def _enough(ids: list[int], what: str) -> list[int]:
    if len(ids) < 2:
        raise TrainscaleError(f"the evaluation text, {what}, is shorter than two tokens; name more text with --data "
                              "(or --split all)")
    return ids


def held_fraction(folder: Path, data: str) -> tuple[float, str]:
    """The fraction of ``data``'s documents held out for the model of ``folder``, and whose rule it is: the LoRA
    adapter's when it trained on this data, else its run's [data] held_out, else the trainer's default."""
    adapter = _adapter_data(folder)
    if adapter is not None and _same_data(adapter[0], data):
        return adapter[2], f"as the LoRA adapter held them out, {adapter[2]:.0%}"
    run = run_folder_of(folder)
    if run is not None:
        try:
            from trainscale.runtime.config import config_from_dict

            cfg = config_from_dict(run_toml(run), f"run config {run / RUN_CONFIG}")
            return cfg.data.held_out, f"run {run}'s [data] held_out, {cfg.data.held_out:.0%}"
        except TrainscaleError:
            pass
    from trainscale.runtime.config import DataSection

    default = DataSection.model_fields["held_out"].default
    return default, f"the trainer's default [data] held_out, {default:.0%}"


def _same_data(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, ValueError):
        return False


def _adapter_data(folder: Path) -> tuple[str, str, float, bool] | None:
    """(data, text field, held-out fraction, chat or not) a LoRA folder's adapter.json records; None for another
    folder."""
    if not (Path(folder) / "adapter.json").is_file():
        return None
    try:
        cfg = read_json_object(Path(folder) / "adapter.json", "adapter description")
    except TrainscaleError:
        return None
    data, field, frac = cfg.get("data"), cfg.get("text_field", "text"), cfg.get("held_out", LORA_HELD_OUT)
    if not isinstance(data, str) or not isinstance(field, str) or not isinstance(frac, (int, float)) \
            or not 0 < frac < 1:
        return None
    return data, field, float(frac), cfg.get("format") == "chat"


# ------------------------------------------------------------------ the model's own held-out data


@dataclass(frozen=True)
class HeldOut:
    """The held-out text a model is evaluated on: token ids (None: tokenise the held-out plays, or ``data``'s
    held-out documents), and a sentence saying what it is."""

    what: str
    kind: str  # "adapter-data", "run-prepared", "run-plays" or "default-plays"
    ids: list[int] | None = None
    data: str | None = None  # adapter-data: the file the adapter trained on; run-prepared: the prepared folder
    text_field: str = "text"
    fraction: float = LORA_HELD_OUT
    chat: bool = False  # adapter-data: conversations (the adapter trained with --format chat)


def held_out_of(folder: Path, max_tokens: int) -> HeldOut:
    """The model's own held-out data: a LoRA folder's data (the documents it held out); when its run folder says
    what it trained on, the prepared corpus's held-out split (its tokenizer must be the run's), or, for a run on
    the plays, the held-out plays; else the default, the held-out plays (runtime/data/sources.py)."""
    adapter = _adapter_data(folder)
    if adapter is not None:
        data, field, frac, chat = adapter
        return HeldOut(f"the held-out documents of {data}", "adapter-data", None, data, field, frac, chat)
    run = run_folder_of(folder)
    if run is None:
        return HeldOut(f"the held-out Shakespeare plays (default: {folder} is not from a run folder)", "default-plays")
    try:
        from trainscale.runtime.config import config_from_dict

        cfg = config_from_dict(run_toml(run), f"run config {run / RUN_CONFIG}")
    except TrainscaleError as e:
        return HeldOut(f"the held-out Shakespeare plays (default: the run's config is unreadable: {e})",
                       "default-plays")
    req = cfg.data.request()
    if req is None:
        return HeldOut(f"the held-out Shakespeare plays, the held-out split of run {run}", "run-plays")
    prepared = _prepared_folder(cfg, req)
    if prepared is None or not _same_tokenizer(prepared / RUN_TOKENIZER, run / RUN_TOKENIZER):
        return HeldOut(f"the held-out Shakespeare plays (default: the prepared data of run {run} is not found "
                       "where its config.toml says)", "default-plays")
    from trainscale.runtime.data.shards import ShardCorpus

    try:
        tokens = ShardCorpus(prepared).tokens("val")
        ids = [int(i) for i in tokens[0:min(len(tokens), max_tokens)]]
    except (OSError, KeyError, TypeError, ValueError, TrainscaleError):
        ids = []
    if len(ids) < 2:
        return HeldOut(f"the held-out Shakespeare plays (default: the prepared data of run {run} has no held-out "
                       "split)", "default-plays")
    return HeldOut(f"the held-out split of run {run}'s prepared data {prepared}", "run-prepared", ids, str(prepared))


def _prepared_folder(cfg, req) -> Path | None:
    from trainscale.runtime.data.corpus import cache_root
    from trainscale.runtime.data.shards import default_folder

    cache = Path(cfg.data.cache) if cfg.data.cache else cache_root()
    folder = Path(req.folder).expanduser() if req.folder else default_folder(req, cache)
    return folder if (folder / "index.json").is_file() else None


def _same_tokenizer(a: Path, b: Path) -> bool:
    """Two tokenizer.json files hold the same tokenizer (the same JSON, however it was formatted)."""
    try:
        return read_json_object(a, "tokenizer") == read_json_object(b, "tokenizer")
    except TrainscaleError:
        return False


def check_window(seq_len: int | None, spec) -> int:
    """The tokens per window of an evaluation: ``seq_len`` (default: the model's max_seq_len), at most the model's
    window; a longer one is refused rather than cut down silently."""
    if seq_len is None:
        return spec.max_seq_len
    if not 1 <= seq_len <= spec.max_seq_len:
        raise TrainscaleError(f"--seq-len must be 1 to the model's window, {spec.max_seq_len:,} tokens (its "
                              f"max_seq_len), not {seq_len:,}")
    return seq_len


def default_prompt(tok: Any, ids: list[int], n: int = 24, room: int | None = None) -> str:
    """The start of the held-out text as a prompt: its first ``n`` tokens, cut after their last whole line (else
    their last whole word) so that the prompt ends where the text paused; with ``room`` (the model's window less
    the tokens to generate) at most that many tokens once encoded again."""
    n = max(1, min(n, room)) if room is not None else n
    while True:
        text = tok.decode(ids[:n])
        for sep in ("\n", " "):
            cut = text.rstrip().rfind(sep)
            if cut > 0:
                text = text[:cut + 1] if sep == "\n" else text[:cut]
                break
        if room is None or n == 1 or len(tok.encode(text).ids) <= room:
            return text
        n -= 1


def held_out_prompt(folder: Path, tok: Any, room: int | None = None) -> str:
    """``generate``'s and ``quantize``'s default prompt: the start of the model's own held-out text
    (``evaluation_text``: its run's or adapter's held-out data, else the held-out plays), not a line of Hamlet for a
    model trained on something else."""
    return default_prompt(tok, evaluation_text(folder, tok, max_tokens=64, default_plays=True).ids, room=room)
