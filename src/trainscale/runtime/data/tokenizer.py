"""Tokenizers: a Hugging Face ``tokenizers`` file or folder loaded, or a byte-level BPE trained here (Radford et
al. 2019, the GPT-2 scheme); the end-of-text token that closes each document; documents encoded in batches."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.safeio import read_json_object, read_text

EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BATCH_CHARS, BATCH_DOCS = 1 << 20, 4096  # documents go to the tokenizer's batch encode in batches this big


MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json of a 256K-token vocabulary (Gemma's) is ~34 MB; merges.txt less
MAX_TOKEN_CHARS = 1024  # the longest token of a published vocabulary is tens of characters; a megabyte one is an attack


def _check_tokens(strings: Iterable[Any], p: Path) -> None:
    """No vocabulary entry, merge or added token longer than MAX_TOKEN_CHARS."""
    for t in strings:
        if isinstance(t, str) and len(t) > MAX_TOKEN_CHARS:
            raise TrainscaleError(f"tokenizer {p} has a token of {len(t):,} characters, longer than any real one "
                                  f"({MAX_TOKEN_CHARS:,})")


def _json(text: str, p: Path) -> Any:
    import json

    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TrainscaleError(f"tokenizer {p} is not valid JSON ({str(e).splitlines()[0][:200]})") from None


def _tokenizer_file(p: Path):
    """A tokenizer.json, read through safeio (a regular file of bounded size) and its tokens' lengths checked."""
    from tokenizers import Tokenizer

    text = read_text(p, "tokenizer", MAX_TOKENIZER_BYTES)
    data = _json(text, p)
    if not isinstance(data, dict):
        raise TrainscaleError(f"tokenizer {p} is not a JSON object")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    _check_tokens(vocab if isinstance(vocab, dict) else (v[0] for v in vocab or () if isinstance(v, list) and v), p)
    merges = model.get("merges") or []
    _check_tokens((m if isinstance(m, str) else x for m in merges for x in (m if isinstance(m, list) else [m])), p)
    _check_tokens((a.get("content") for a in data.get("added_tokens") or () if isinstance(a, dict)), p)
    return Tokenizer.from_str(text)


def _bpe_files(p: Path):
    """A byte-level BPE from a folder's vocab.json + merges.txt (GPT-2's files), read through safeio."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = _json(read_text(p / "vocab.json", "tokenizer vocabulary", MAX_TOKENIZER_BYTES), p / "vocab.json")
    if not isinstance(vocab, dict) or not all(type(v) is int for v in vocab.values()):
        raise TrainscaleError(f"tokenizer vocabulary {p / 'vocab.json'} is not a JSON object of token ids")
    _check_tokens(vocab, p / "vocab.json")
    lines = read_text(p / "merges.txt", "tokenizer merges", MAX_TOKENIZER_BYTES).splitlines()
    merges = [tuple(ln.split(" ")) for ln in lines if ln.strip() and not ln.startswith("#version")]
    if any(len(m) != 2 for m in merges):
        raise TrainscaleError(f"tokenizer merges {p / 'merges.txt'} has a line that is not two tokens")
    _check_tokens((x for m in merges for x in m), p / "merges.txt")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(path: str | Path):
    """A ``tokenizer.json`` file, or a Hugging Face tokenizer folder (tokenizer.json, or a byte-level BPE's
    vocab.json + merges.txt); files read through safeio (regular files of bounded size, never a FIFO), tokens
    at most MAX_TOKEN_CHARS long."""
    p = Path(path).expanduser()
    if not os.path.lexists(p):
        raise TrainscaleError(f"tokenizer {p} does not exist")
    try:
        if p.is_dir():
            if os.path.lexists(p / "tokenizer.json"):
                return _tokenizer_file(p / "tokenizer.json")
            if os.path.lexists(p / "vocab.json") and os.path.lexists(p / "merges.txt"):
                return _bpe_files(p)
            raise TrainscaleError(f"tokenizer folder {p} has neither tokenizer.json nor vocab.json + merges.txt")
        return _tokenizer_file(p)
    except TrainscaleError:
        raise
    except Exception as e:  # tokenizers raises its own Exception type
        raise TrainscaleError(f"tokenizer {p} cannot be read ({str(e).splitlines()[0][:200]})") from None


def eot_of(tok, path: str | None, eot: str | None) -> str:
    """The end-of-text token: the one named, else the folder's eos_token, else a usual name."""
    if eot is not None:
        if tok.token_to_id(eot) is None:
            raise TrainscaleError(f"the end-of-text token {eot!r} is not in the tokenizer's vocabulary")
        return eot
    names: list[str] = []
    if path is not None and Path(path).is_dir():
        for meta in ("tokenizer_config.json", "special_tokens_map.json"):
            f = Path(path) / meta
            if f.is_file():
                try:
                    val = read_json_object(f, "tokenizer settings").get("eos_token")
                except TrainscaleError:  # unreadable settings: fall back to the usual names
                    val = None
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    names.append(val)
    for name in (*names, *EOT_CANDIDATES):
        if tok.token_to_id(name) is not None:
            return name
    raise TrainscaleError(f"tokenizer {path} has no end-of-text token that trainscale knows; name one with "
                          "[data] eot = \"...\"")


def train_bpe(texts: Iterable[str], vocab_size: int, eot: str = "<|endoftext|>"):
    """Byte-level BPE (Radford et al. 2019, GPT-2 scheme) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eot],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


_TOKENIZER: tuple[str, Any] | None = None  # (path, Tokenizer): loaded once per worker process


def cached_tokenizer(path: str):
    """``load_tokenizer(path)``, loaded once per process (a prepare-data worker tokenises many units)."""
    global _TOKENIZER
    if _TOKENIZER is None or _TOKENIZER[0] != path:
        _TOKENIZER = (path, load_tokenizer(path))
    return _TOKENIZER[1]


def encode(tok, texts: list[str], ends: list[bool], eot: int, dtype) -> np.ndarray:
    """Token ids of ``texts``, each followed by ``eot`` where its document ends, as one array."""
    return encode_lengths(tok, texts, ends, eot, dtype)[0]


def encode_lengths(tok, texts: list[str], ends: list[bool], eot: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``encode``, and the tokens of each text (its ``eot`` included): where documents end in the array."""
    from itertools import chain

    encs = tok.encode_batch_fast(texts, add_special_tokens=False) if hasattr(tok, "encode_batch_fast") \
        else tok.encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encs]
    for i, end in zip(ids, ends, strict=True):
        if end:
            i.append(eot)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    n = int(lengths.sum())
    return np.fromiter(chain.from_iterable(ids), dtype=dtype, count=n), lengths


def batches(texts: list[str]) -> Iterator[tuple[int, int]]:
    """[a, b) ranges of ``texts`` of about BATCH_CHARS characters or BATCH_DOCS documents."""
    a, size = 0, 0
    for i, t in enumerate(texts):
        size += len(t)
        if size >= BATCH_CHARS or i + 1 - a >= BATCH_DOCS:
            yield a, i + 1
            a, size = i + 1, 0
    if a < len(texts):
        yield a, len(texts)
