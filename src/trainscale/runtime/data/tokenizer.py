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


def repeats_a_repeat(pattern: str) -> bool:
    """Whether a regex repeats (``*``, ``+``, ``{n,m}``) a group that itself holds a repeat or an alternation:
    ``(a+)+``, ``(a|aa)*``, the shape whose backtracking grows exponentially with the input (Onig gives up and the
    tokenizers library panics). The pre-tokenizer patterns of published tokenizers (GPT-2's, Llama 3's, Qwen's)
    repeat only characters and classes."""
    stack = [[False]]  # per open group: [holds a repeat or an alternation]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class is one character: skip to its end
            j = i + 1
            j += pattern[j] == "^" if j < n else 0
            j += pattern[j] == "]" if j < n else 0
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            stack.append([False])
            i += 2 if pattern[i + 1:i + 2] == "?" else 1  # (?: (?i: (?! ... : the ? is no quantifier
            continue
        if c == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            nxt = pattern[i + 1:i + 2]
            repeated = nxt in ("*", "+") or (nxt == "{" and not _at_most_once(pattern, i + 1))
            if repeated and inner:
                return True
            stack[-1][0] = stack[-1][0] or inner or repeated
            i += 1
            continue
        if c in "*+?{" or c == "|":
            stack[-1][0] = True
        i += 1
    return False


def _at_most_once(pattern: str, i: int) -> bool:
    """Whether the ``{...}`` quantifier at ``pattern[i]`` allows at most one repetition ({0}, {1}, {0,1})."""
    import re

    m = re.match(r"\{(\d*)(,?)(\d*)\}", pattern[i:])
    if not m:
        return True  # a literal brace
    hi = m.group(3) if m.group(2) else m.group(1)
    return hi != "" and int(hi) <= 1


def _check_patterns(node: Any, p: Path, depth: int = 0) -> None:
    """Every regex of the tokenizer (pre-tokenizer, normalizer, decoder ``pattern``s) can be searched in bounded
    time (``repeats_a_repeat``)."""
    if depth > 64:
        raise TrainscaleError(f"tokenizer {p} nests its settings deeper than any real one")
    if isinstance(node, dict):
        pat = node.get("pattern")
        if isinstance(pat, dict) and isinstance(pat.get("Regex"), str) and repeats_a_repeat(pat["Regex"]):
            raise TrainscaleError(f"tokenizer {p} has the pattern {pat['Regex'][:60]!r}, which repeats a repeated "
                                  "group: its search can backtrack without end on some text, and no published "
                                  "tokenizer's pattern does that")
        for v in node.values():
            _check_patterns(v, p, depth + 1)
    elif isinstance(node, list):
        for v in node:
            _check_patterns(v, p, depth + 1)


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
    for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        _check_patterns(data.get(part), p)
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
        names += tokenizer_settings(path, tok)[2]  # its eos_token(s), each in the vocabulary
        f = Path(path) / "special_tokens_map.json"
        if f.is_file():
            try:
                val = read_json_object(f, "tokenizer settings").get("eos_token")
            except TrainscaleError:  # unreadable: fall back to the usual names
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


# --------------------------------------------------------------------------- tokenizer_config.json

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_END_TOKENS = 64  # published configs name one eos_token; a list of a few end tokens is the most seen


def _settings_model():
    """tokenizer_config.json's schema (transformers' tokenization_utils_base: each named special token a string or
    an AddedToken object with 'content'; eos_token also a list of them, every one ending a reply; chat_template a
    string or named templates). Fields transformers adds over time pass through unread; the ones read are typed."""
    from typing import Annotated

    from pydantic import BaseModel, ConfigDict, Field, StrictBool

    text = Annotated[str, Field(max_length=MAX_TOKEN_CHARS)]

    class Added(BaseModel):
        model_config = ConfigDict(extra="allow")
        content: text

    token = text | Added

    class Named(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str | None = Field(default=None, max_length=200)
        template: str | None = None

    class Settings(BaseModel):
        model_config = ConfigDict(extra="allow")
        bos_token: token | None = None
        eos_token: token | Annotated[list[token], Field(min_length=1, max_length=MAX_END_TOKENS)] | None = None
        unk_token: token | None = None
        sep_token: token | None = None
        pad_token: token | None = None
        cls_token: token | None = None
        mask_token: token | None = None
        additional_special_tokens: Annotated[list[token], Field(max_length=1 << 20)] | None = None
        chat_template: str | Annotated[list[Named], Field(max_length=1000)] | None = None
        add_bos_token: StrictBool | None = None
        add_eos_token: StrictBool | None = None
        model_max_length: Annotated[float, Field(ge=0)] | None = None
        tokenizer_class: Annotated[str, Field(max_length=200)] | None = None
        clean_up_tokenization_spaces: StrictBool | None = None

    return Settings


def _content(value: Any) -> str:
    return value if isinstance(value, str) else value.content


def tokenizer_settings(folder: str | Path, tok: Any = None) -> tuple[dict[str, Any], dict[str, str], tuple[str, ...]]:
    """A folder's tokenizer_config.json through its schema -> (its fields, the named special tokens as strings,
    every token that ends a reply: eos_token, or each of an eos_token list). With ``tok`` (its tokenizers.Tokenizer)
    a bos or end token the vocabulary does not hold is refused (generation would never stop). No file: empty.
    One sentence (TrainscaleError) naming the file and the field otherwise."""
    from pydantic import ValidationError

    path = Path(folder) / TOKENIZER_CONFIG
    if not (path.exists() or path.is_symlink()):
        return {}, {}, ()
    raw = read_json_object(path, "tokenizer settings")
    try:
        cfg = _settings_model().model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err.get("loc") else "?"
        raise TrainscaleError(f"{path}: '{key}' is not what tokenizer_config.json holds there ("
                              f"{_FIELD_WORDS.get(key, 'a value of the type transformers writes')})") from None
    special = {k: _content(v) for k in SPECIAL_TOKEN_NAMES if (v := getattr(cfg, k)) is not None and
               not isinstance(v, list)}
    ends: tuple[str, ...] = ()
    if isinstance(cfg.eos_token, list):
        ends = tuple(dict.fromkeys(_content(v) for v in cfg.eos_token))
        special["eos_token"] = ends[0]
    elif cfg.eos_token is not None:
        ends = (special["eos_token"],)
    if tok is not None:
        for key, names in (("bos_token", (special.get("bos_token"),)), ("eos_token", ends)):
            for name in names:
                if name is not None and tok.token_to_id(name) is None:
                    raise TrainscaleError(f"{path}: '{key}' {name[:40]!r} is not a token of the folder's "
                                          "tokenizer.json")
    return raw, special, ends


_FIELD_WORDS = {**{k: "a token: a string, or an object with 'content'" for k in SPECIAL_TOKEN_NAMES},
                "eos_token": f"a token, or a list of 1 to {MAX_END_TOKENS} tokens, each a string or an object with "
                "'content'",
                "additional_special_tokens": "a list of tokens",
                "chat_template": "a Jinja template, or a list of {\"name\", \"template\"} objects",
                "add_bos_token": "true or false", "add_eos_token": "true or false",
                "clean_up_tokenization_spaces": "true or false", "model_max_length": "a non-negative number",
                "tokenizer_class": "a class name"}
