"""A user's corpus as memory-mapped token shards: what ``trainscale prepare-data`` writes and training reads.

Inputs (``[data] files``, or the ``[[data.sources]]`` of a weighted mixture) are read by sources.py in units of
about ``shard_mb`` input megabytes, decoupled from files: a unit gathers many small files and a large file is
cut into many units. Each unit is read, tokenised (tokenizer.py; token files: their ids checked and copied) and
written as one shard per split by a worker process, so no process ever holds more than a unit: corpora larger
than memory work, and a corpus of 100,000 files makes a few shards, not 100,000.

Output folder (format 3; format 2, the same without flags, is still read):
    index.json            what is there: shards (with their mixture component) and token counts per split,
                          tokenizer, end-of-text id, the content hash of inputs + tokenizer + settings, the
                          inputs' size and mtime, the mixture's components
    tokenizer.json        the tokenizer (trained on the train split, or the one loaded)
    train-00000.npy ...   uint16 (vocabulary <= 65,536) or uint32 token ids, documents packed, each
    val-00000.npy ...     followed by the end-of-text token; numpy .npy read with mmap (no pickle)
    train-docs.npy        int64: where each document of the split ends (token offset after its end-of-text
    val-docs.npy          token, in the split's stream: its shards in order)
    unigram.npy           train-split token counts (the unigram baseline, without rereading the shards)
    train-00000.flags.npy chat data only (``[data] format = "chat"``, runtime/data/chat.py): uint8 per token,
    val-00000.flags.npy   bit 0 (LEARNED) set where the token is a target to learn (an assistant's words and
                          end-of-turn), bit 1 (DOC_START) on each conversation's first token; conversations are
                          packed without an end-of-text token between them (the template writes their ends)
    unit-00000.json ...   one per unit: done (what an interrupted run keeps)

Training opens shards on demand through a bounded cache of memory maps (``MapCache``, 64 by default), so the
number of open files does not grow with the number of shards. A folder of format 1 (one shard per input file,
written before) is rewritten by the next prepare-data, or refused in one sentence if opened directly.

Documents go to the held-out split by a hash of their position (sources.Settings). Everything is written
to a temporary name and renamed into place; units finished before an interruption are kept in
``.NAME.partial-HASH`` and not redone; the finished folder replaces the old one only when complete.
Re-running on the same inputs (by content), tokenizer and settings is a no-op; unchanged files (same size
and mtime) are not even reread.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.pretokenized import read_npy
from trainscale.runtime.data.sources import (
    TOKEN_FORMATS,
    Settings,
    Source,
    Unit,
    file_sha256,
    plan_units,
    resolve_sources,
    unit_documents,
)
from trainscale.runtime.data.tokenizer import (
    batches,
    cached_tokenizer,
    encode_lengths,
    eot_of,
    load_tokenizer,
    train_bpe,
)
from trainscale.safeio import atomic_write, atomic_write_text, read_json_object

FORMAT_VERSION = 3  # 1: a shard per input file, no document ends; 2: no flags (chat data)
READ_VERSIONS = (2, 3)  # a format-2 folder is a format-3 folder without chat data
TOKENS_VERSION = 2  # what the token shards of text hold has not changed since format 2: their hash key stays
LEARNED, DOC_START = 1, 2  # the bits of a flags shard
MAX_OPEN_SHARDS = 64  # memory maps a reader keeps open (each holds a file descriptor)
MAX_INDEX_BYTES = 256 << 20  # index.json and jobs.json list every shard: kilobytes per thousand shards
Progress = Callable[[str, int, int], None]  # (stage, done, total)


# --------------------------------------------------------------------------- one unit, in a worker


def _npy(path: Path) -> np.ndarray:
    """A small .npy of the folder (document ends, unigram counts) read into memory through ``read_npy``: a regular
    file (a FIFO or device among the folder's files is refused, not waited on) whose header matches its size."""
    return np.array(read_npy(path).array())


def _save_array(path: Path, array: np.ndarray) -> None:
    """``array`` as a .npy file, whole or not at all."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    atomic_write(path, write)


def tokenize_unit(work: str, sources: list[Source], unit: Unit, s: Settings, tokenizer: str, eot: int,
                  dtype: str, vocab: int, chat: str | None = None) -> dict[str, int]:
    """Tokenise one unit into ``train-NNNNN.npy`` and ``val-NNNNN.npy`` (and where their documents end);
    ``unit-NNNNN.json`` last marks it done. ``chat``: the folder whose chat template renders the conversations
    (then the flags shards too)."""
    import gc

    if chat is not None:
        from trainscale.runtime.data.chat import cached_chat_tokenizer

        tok = cached_chat_tokenizer(chat)
    else:
        tok = cached_tokenizer(tokenizer)
    gc.disable()  # millions of short-lived id lists: the cyclic collector would only scan them
    try:
        return _tokenize_unit(work, tok, sources, unit, s, eot, dtype, vocab)
    finally:
        gc.enable()


def _chat_tokens(chat, docs, keep: np.ndarray, dtype: str, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kept conversations, rendered and tokenized (runtime/data/chat.py), packed: (tokens, where each ends,
    flags: LEARNED on the targets to learn, DOC_START on each conversation's first token)."""
    from trainscale.runtime.data.chat import encode_line
    from trainscale.runtime.data.sources import line_of

    ids_parts, flag_parts = [], []
    for i in keep.tolist():
        path, offset = docs.origins[i]
        ids, learned = encode_line(docs.texts[i], chat,
                                   lambda p=path, o=offset: f"chat data file {p} line {line_of(p, o)}")
        f = np.asarray(learned, dtype=np.uint8) * np.uint8(LEARNED)
        f[0] |= DOC_START
        ids_parts.append(np.asarray(ids, dtype=np.int64))
        flag_parts.append(f)
    if not ids_parts:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    arr = np.concatenate(ids_parts)
    if arr.max() >= vocab:
        raise TrainscaleError(f"the chat tokenizer of {chat.folder} made token id {int(arr.max())}, outside its "
                              f"vocabulary of {vocab:,}")
    lengths = np.fromiter(map(len, ids_parts), dtype=np.int64, count=len(ids_parts))
    return arr.astype(dtype), np.cumsum(lengths), np.concatenate(flag_parts)


def _split_tokens(tok, docs, keep: np.ndarray, eot: int, dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The kept documents' tokens, packed: (tokens, where documents end in them, documents ended)."""
    if docs.arrays is not None:  # token files: each document ends with the end-of-text token (added if missing)
        arrays = [docs.arrays[i] for i in keep]
        parts = [a if a[-1] == eot else np.append(a, eot) for a in arrays]
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        arr = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
        return arr, np.cumsum(lengths), len(parts)
    texts = docs.texts if len(keep) == len(docs.texts) else [docs.texts[i] for i in keep]
    ends = [True] * len(texts) if docs.ends is None else [docs.ends[i] for i in keep]
    pieces = [encode_lengths(tok, texts[a:b], ends[a:b], eot, dtype) for a, b in batches(texts)]
    arr = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, dtype=dtype)
    lengths = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, dtype=np.int64)
    ends_a = np.asarray(ends, dtype=bool)
    return arr, np.cumsum(lengths)[ends_a] if len(lengths) else lengths, int(ends_a.sum())


def _tokenize_unit(work: str, tok, sources: list[Source], unit: Unit, s: Settings, eot: int, dtype: str,
                   vocab: int) -> dict[str, int]:
    docs = unit_documents(sources, unit, s, eot, vocab)
    meta = {"unit": unit.index, "group": sources[unit.pieces[0][0]].group}
    folder = Path(work)
    for split, held in (("train", False), ("val", True)):
        keep = np.flatnonzero(docs.held == held)
        if docs.origins is not None:  # chat: conversations rendered by the template, with their flags
            arr, doc_ends, flags = _chat_tokens(tok, docs, keep, dtype, vocab)
            n_docs = len(doc_ends)
            _save_array(folder / f"{split}-{unit.index:05d}.flags.npy", flags)
        else:
            arr, doc_ends, n_docs = _split_tokens(tok, docs, keep, eot, dtype)
        _save_array(folder / f"{split}-{unit.index:05d}.npy", arr)
        _save_array(folder / f"{split}-{unit.index:05d}.ends.npy", doc_ends.astype(np.int64))
        meta[f"{split}_tokens"], meta[f"{split}_docs"] = int(arr.size), n_docs
    atomic_write_text(folder / f"unit-{unit.index:05d}.json", json.dumps(meta))
    return meta


# --------------------------------------------------------------------------- the prepared corpus


class MapCache:
    """Memory maps of shard files, at most ``max_open`` at a time: each map holds a file descriptor, so a corpus
    of any number of shards reads within ``ulimit -n``; the least recently used map is dropped first."""

    def __init__(self, max_open: int = MAX_OPEN_SHARDS) -> None:
        self.max_open = max(1, max_open)
        self.maps: OrderedDict[Path, np.ndarray] = OrderedDict()
        self.opened = 0  # maps opened so far (a reader that thrashes shows here)

    def get(self, path: Path, length: int, dtype: np.dtype) -> np.ndarray:
        m = self.maps.get(path)
        if m is not None:
            self.maps.move_to_end(path)
            return m
        m = self._open(path, length, dtype)
        self.maps[path] = m
        self.opened += 1
        while len(self.maps) > self.max_open:
            self.maps.popitem(last=False)  # its mmap closes with its last reference (slices handed out are copies)
        return m

    @staticmethod
    def _open(path: Path, length: int, dtype: np.dtype) -> np.ndarray:
        npy = read_npy(path)
        if npy.shape != (length,) or npy.dtype != dtype:
            raise TrainscaleError(f"shard {path} holds {npy.shape} {npy.dtype}, but its index.json says ({length},) "
                                  f"{dtype}; re-run prepare-data")
        return npy.array()


class TokenStream:
    """Several token arrays (or shard files, opened on demand through a MapCache) read as one: ``len()`` and
    ``[a:b]`` slices (the loader's whole interface). Slices of files are copies, so no map outlives the cache."""

    def __init__(self, arrays: list[np.ndarray] | None = None, *, files: list[Path] | None = None,
                 lengths: list[int] | None = None, dtype: str | np.dtype = "uint16",
                 cache: MapCache | None = None) -> None:
        self.arrays, self.files = arrays, files
        sizes = [len(a) for a in arrays] if arrays is not None else list(lengths or [])
        self.dtype = np.dtype(arrays[0].dtype if arrays else dtype)
        self.cache = cache if cache is not None else MapCache()
        self.starts = np.cumsum([0] + sizes)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _part(self, i: int) -> np.ndarray:
        if self.arrays is not None:
            return self.arrays[i]
        assert self.files is not None
        return self.cache.get(self.files[i], int(self.starts[i + 1] - self.starts[i]), self.dtype)

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, step = s.indices(len(self))
        if step != 1:
            raise IndexError("TokenStream slices take step 1")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            a0 = int(self.starts[i])
            take = min(stop, int(self.starts[i + 1])) - start
            if take > 0:
                pieces.append(self._part(i)[start - a0: start - a0 + take])
            start += take
            i += 1
        if len(pieces) == 1:
            return pieces[0] if self.arrays is not None else np.array(pieces[0])
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)


class MixtureStream(TokenStream):
    """A mixture's train split: its components' streams (each windowed and drawn apart by the loader, by
    ``weights``) and, read as one stream, all of them in order."""

    def __init__(self, components: list[TokenStream], weights: list[float], names: list[str] | None = None) -> None:
        if all(c.arrays is not None for c in components):
            super().__init__([a for c in components for a in c.arrays or []])
        else:
            super().__init__(files=[f for c in components for f in (c.files or [])],
                             lengths=[int(n) for c in components for n in np.diff(c.starts)],
                             dtype=components[0].dtype, cache=components[0].cache)
        self.components, self.weights = components, list(weights)
        self.names = names or [f"source {i + 1}" for i in range(len(components))]


@dataclass(frozen=True)
class ShardCorpus:
    """A prepare-data folder, opened: same interface as corpus.Corpus (tokenizer_path, tokens, unigram_counts).
    ``weights``: the mixture's weights to draw by (default: those recorded when it was prepared)."""

    folder: Path
    weights: tuple[float, ...] | None = None
    max_open: int = MAX_OPEN_SHARDS
    _cache: MapCache = field(default_factory=MapCache, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._cache.max_open = max(1, self.max_open)

    @cached_property
    def index(self) -> dict[str, Any]:
        index = read_json_object(self.folder / "index.json", "prepared corpus index", limit=MAX_INDEX_BYTES)
        if index.get("version") not in READ_VERSIONS:
            raise TrainscaleError(f"prepared corpus {self.folder} is in format {index.get('version')} of an earlier "
                                  f"trainscale, not {FORMAT_VERSION}; re-run prepare-data to rewrite it")
        return index

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / "tokenizer.json"

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    def _stream(self, shards: list[dict[str, Any]], key: str = "file", dtype: str | None = None) -> TokenStream:
        return TokenStream(files=[self.folder / sh[key] for sh in shards], lengths=[sh["tokens"] for sh in shards],
                           dtype=dtype or self.index["dtype"], cache=self._cache)

    def tokens(self, split: str, key: str = "file", dtype: str | None = None) -> TokenStream:
        """The split's tokens; a mixture's train split is a MixtureStream (its components apart). ``key``
        "flags_file" (dtype uint8): the split's flags, laid out as its tokens (``flags``)."""
        shards = self.index["splits"][split]["shards"]
        components = self.index.get("components") or [{"name": "", "weight": 1.0}]
        if split != "train" or len(components) == 1:
            return self._stream(shards, key, dtype)
        weights = list(self.weights) if self.weights is not None else [float(c["weight"]) for c in components]
        parts = [self._stream([sh for sh in shards if sh.get("group", 0) == g], key, dtype)
                 for g in range(len(components))]
        return MixtureStream(parts, weights, [str(c["name"]) for c in components])

    @property
    def chat(self) -> bool:
        """Whether the corpus is chat data (its shards have flags)."""
        return bool(self.index.get("flags"))

    @property
    def eot_id(self) -> int | None:
        return self.index.get("eot_id")

    def flags(self, split: str) -> TokenStream | None:
        """Chat data: the split's per-token flags (LEARNED, DOC_START bits), read as ``tokens(split)`` is; None
        for text, whose every target is learned and whose documents end with the end-of-text token."""
        return self.tokens(split, "flags_file", "uint8") if self.chat else None

    def documents(self, split: str) -> np.ndarray:
        """Where each document of the split ends (int64 token offsets in ``tokens(split)``)."""
        return _npy(self.folder / self.index["splits"][split]["documents_file"])

    def unigram_counts(self) -> np.ndarray:
        return _npy(self.folder / "unigram.npy")


# --------------------------------------------------------------------------- prepare


# What prepare-data writes, by name: a finished folder (index.json, tokenizer.json, unigram.npy, the shards and
# the unit markers) and, while at work, its temporary files, job list and worker logs.
OUTPUT_FILES = re.compile(r"index\.json|tokenizer\.json|unigram\.npy|(train|val)-(\d{5,}(\.flags)?|docs)\.npy"
                          r"|unit-\d{5,}\.json")
WORK_FILES = re.compile(OUTPUT_FILES.pattern + r"|(train|val)-\d{5,}\.ends\.npy|jobs\.json|worker-\d+\.log"
                        r"|\..+\.tmp\d+")
MAX_FOLDER_ENTRIES = 1_000_000  # a prepared folder holds three files per unit of shard_mb input megabytes


def _only_ours(folder: Path, names: re.Pattern[str]) -> bool:
    """Whether ``folder`` holds only regular files named as prepare-data names its files (no link, no subfolder)."""
    return _foreign(folder, names) is None


def _foreign(folder: Path, names: re.Pattern[str]) -> str | None:
    """The first entry of ``folder`` that prepare-data did not write, or None."""
    try:
        with os.scandir(folder) as it:
            for n, e in enumerate(it):
                if n >= MAX_FOLDER_ENTRIES or not names.fullmatch(e.name) or not e.is_file(follow_symlinks=False):
                    return e.name
    except OSError as e:
        return f"(unreadable: {e.strerror})"
    return None


def _check_folder(folder: Path) -> dict[str, Any] | None:
    """The output folder must be new, empty, or a prepare-data folder holding only what prepare-data writes
    (a folder of the user's own files is never written into nor replaced): -> its index, if any."""
    if not os.path.lexists(folder):
        return None
    if folder.is_symlink() or not folder.is_dir():
        raise TrainscaleError(f"data.prepared {folder} exists and is not a folder; name a new or empty folder")
    stranger = _foreign(folder, OUTPUT_FILES)
    if stranger is not None:
        raise TrainscaleError(f"data.prepared folder {folder} holds {stranger}, which prepare-data did not write; "
                              "name a new or empty folder")
    if not any(folder.iterdir()):
        return None
    index = read_json_object(folder / "index.json", "prepared corpus index", limit=MAX_INDEX_BYTES)
    if type(index.get("version")) is not int or not isinstance(index.get("hash"), str) \
            or not isinstance(index.get("splits"), dict):
        raise TrainscaleError(f"data.prepared folder {folder} has an index.json that prepare-data did not write "
                              "(no version, hash and splits); name a new or empty folder")
    return index


def _settings_key(s: Settings, tokenizer_key: str) -> str:
    return json.dumps({"version": TOKENS_VERSION, "documents": s.documents, "text_field": s.text_field,
                       "held_out": s.held_out, "unit_bytes": s.unit_bytes, "tokenizer": tokenizer_key},
                      sort_keys=True)


def _content_hash(sources: list[Source], hashes: list[str], settings_key: str) -> str:
    h = hashlib.sha256(settings_key.encode())
    for src, digest in zip(sources, hashes, strict=True):
        tag = f"{src.group}:" if src.group else ""  # a single source hashes as before mixtures existed
        h.update(f"|{tag}{src.format}:{digest}".encode())
    return h.hexdigest()


def _source_hashes(sources: list[Source], old: dict[str, Any] | None, progress: Progress | None) -> list[str]:
    """Content hashes; a file whose path, size and mtime are those the old index recorded keeps its hash."""
    known = {(s["path"], s["size"], s["mtime_ns"]): s["sha256"] for s in (old or {}).get("sources", [])}
    out, total, done, shown = [], sum(s.size for s in sources), 0, 0
    for src in sources:
        digest = known.get((src.path, src.size, src.mtime_ns))
        out.append(digest or file_sha256(src.path, src.format))
        done += src.size
        if progress and digest is None and (done - shown > total // 200 or done == total):  # at most ~200 updates
            progress("hashing inputs", done, total)
            shown = done
    return out


@dataclass(frozen=True)
class Component:
    """One source of a weighted mixture (``[[data.sources]]``): its files and the share of sequences drawn from it."""

    files: tuple[str, ...]
    weight: float = 1.0
    name: str = ""


@dataclass(frozen=True)
class DataRequest:
    """What to prepare: ``[data]``'s keys, resolved (runtime/config.DataSection.request() builds it). ``files``
    (one source) or ``components`` (a mixture)."""

    files: tuple[str, ...] = ()
    format: str = "auto"
    settings: Settings = Settings()
    tokenizer: str | None = None
    tokenizer_vocab: int | None = None  # trained tokenizer's size
    eot: str | None = None
    max_chars: int | None = None  # the tokenizer trains on at most this many characters
    folder: str | None = None
    workers: int = 0
    components: tuple[Component, ...] = ()

    def parts(self) -> tuple[Component, ...]:
        return self.components or (Component(self.files),)

    @property
    def weights(self) -> tuple[float, ...] | None:
        return tuple(c.weight for c in self.components) if len(self.components) > 1 else None


def default_folder(req: DataRequest, cache: Path) -> Path:
    """Named by what was asked (paths and settings), so a later run finds it before hashing contents; a
    mixture's weights are not part of it (they change what is drawn, not what is prepared)."""
    groups = [sorted(str(Path(f).expanduser().absolute()) for f in c.files) for c in req.parts()]
    key = json.dumps([groups[0] if len(groups) == 1 else groups, req.format, req.tokenizer, req.tokenizer_vocab,
                      req.eot, req.max_chars, req.settings.__dict__], sort_keys=True)
    return cache / f"data-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def resolve_request(req: DataRequest) -> list[Source]:
    """Every component's sources, in order; a file in two components is refused."""
    out: list[Source] = []
    owner: dict[str, int] = {}
    for g, comp in enumerate(req.parts()):
        for src in resolve_sources(comp.files, req.format, g):
            if src.path in owner:
                raise TrainscaleError(f"data file {src.path} is in two mixture sources ({owner[src.path] + 1} and "
                                      f"{g + 1}); name each file once and weight the sources")
            owner[src.path] = g
            out.append(src)
    return out


def _tokenizer_of(req: DataRequest, sources: list[Source], model_vocab: int):
    """(tokenizer or None to train one, its vocabulary size, the end-of-text token, its key for the hash)."""
    if req.format == "chat" and req.tokenizer is None:
        raise TrainscaleError("[data] format = \"chat\" needs the model's tokenizer folder with its chat template: "
                              "set [data] tokenizer = \"FOLDER\", or [model] init")
    if req.tokenizer is not None:
        tok = load_tokenizer(req.tokenizer)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if vocab > model_vocab:
            raise TrainscaleError(f"tokenizer {req.tokenizer} has {vocab:,} tokens, more than the model's vocab_size "
                                  f"{model_vocab:,}")
        eot = eot_of(tok, req.tokenizer, req.eot)
        key = hashlib.sha256(tok.to_str().encode()).hexdigest() + f"|{eot}"
        if req.format == "chat":  # the template and its special tokens change the tokens too
            from trainscale.runtime.data.chat import chat_folder_of, load_chat_tokenizer, template_key

            key += "|chat:" + template_key(load_chat_tokenizer(chat_folder_of(req.tokenizer)))
        return tok, vocab, eot, key
    tokens = next((s for s in sources if s.format in TOKEN_FORMATS), None)
    if tokens is not None:
        raise TrainscaleError(f"data file {tokens.path} holds token ids already; name the tokenizer that made them "
                              "with [data] tokenizer = \"...\"")
    vocab = req.tokenizer_vocab or model_vocab
    if vocab > model_vocab:
        raise TrainscaleError(f"data.tokenizer_vocab {vocab:,} exceeds the model's vocab_size {model_vocab:,}")
    eot = req.eot or "<|endoftext|>"
    return None, vocab, eot, f"bpe-bytelevel|{vocab}|{eot}|{req.max_chars}"


def prepare(req: DataRequest, model_vocab: int, cache: Path, progress: Progress | None = None,
            log: Callable[[str], None] = lambda _m: None) -> ShardCorpus:
    """Tokenise ``req``'s corpus into shards (or find them done): -> the opened folder."""
    folder = Path(req.folder).expanduser() if req.folder else default_folder(req, cache)
    sources = resolve_request(req)
    files = [f for c in req.parts() for f in c.files]
    if not sources or all(s.size == 0 for s in sources):
        raise TrainscaleError(f"the corpus is empty: {', '.join(files)} hold no text")
    for g in range(len(req.parts())):
        if not any(s.group == g and s.size for s in sources):
            raise TrainscaleError(f"mixture source {g + 1} ({', '.join(req.parts()[g].files)}) holds no text")
    old = _check_folder(folder)
    tok, vocab, eot, tok_key = _tokenizer_of(req, sources, model_vocab)
    s = req.settings
    hashes = _source_hashes(sources, old, progress)
    digest = _content_hash(sources, hashes, _settings_key(s, tok_key))
    if old is not None and old.get("hash") == digest:
        log(f"{folder}: already prepared from these inputs (content hash {digest[:12]})")
        return ShardCorpus(folder, req.weights)

    work = folder.with_name(f".{folder.name}.partial-{digest[:16]}")
    for stale in folder.parent.glob(f".{folder.name}.partial-*") if folder.parent.exists() else ():
        if stale != work and _only_ours(stale, WORK_FILES):  # an interrupted run on inputs changed since: of no use
            shutil.rmtree(stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _build(req, sources, hashes, digest, folder, work, tok, vocab, eot, progress, log)
    except TrainscaleError:
        shutil.rmtree(work, ignore_errors=True)  # bad input: nothing half-written stays behind
        raise


def _build(req: DataRequest, sources: list[Source], hashes: list[str], digest: str, folder: Path, work: Path,
           tok, vocab: int, eot: str, progress: Progress | None, log: Callable[[str], None]) -> ShardCorpus:
    s = req.settings
    units = plan_units(sources, s.unit_bytes, s.documents, tok.token_to_id(eot) if tok is not None else None)
    if not units:
        _no_train(req, 0)
    tok_path = work / "tokenizer.json"
    if tok is None and not tok_path.exists():
        if progress:
            progress("training the tokenizer", 0, 1)
        seen = {"train": 0, "val": 0}
        tok = train_bpe(_train_texts(sources, units, s, req.max_chars, seen), vocab, eot)
        if progress:
            progress("training the tokenizer", 1, 1)
        if not seen["train"]:
            _no_train(req, seen["val"])
        log(f"trained a byte-level BPE of {tok.get_vocab_size():,} tokens")
    if tok is not None:
        atomic_write_text(tok_path, tok.to_str())
    tok = load_tokenizer(tok_path)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eot_id = tok.token_to_id(eot)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    chat = None
    if req.format == "chat":
        from trainscale.runtime.data.chat import chat_folder_of

        chat = str(chat_folder_of(req.tokenizer).absolute())

    done = {u.index for u in units if (work / f"unit-{u.index:05d}.json").exists()}
    todo = [u for u in units if u.index not in done]
    if done:
        log(f"resuming: {len(done)} of {len(units)} shards already written")
    unit_size = {u.index: u.size for u in units}
    total = sum(unit_size.values())
    progress_done = sum(unit_size[i] for i in done)
    workers = min(req.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                  else os.cpu_count() or 1), len(todo))
    if progress:
        progress("tokenizing", progress_done, total)
    if workers <= 1:
        for u in todo:
            tokenize_unit(str(work), sources, u, s, str(tok_path), eot_id, dtype, vocab_size, chat)
            progress_done += unit_size[u.index]
            if progress:
                progress("tokenizing", progress_done, total)
    else:
        atomic_write_text(work / "jobs.json", json.dumps({
            "sources": [src.__dict__ for src in sources], "todo": [u.__dict__ for u in todo],
            "settings": s.__dict__, "tokenizer": str(tok_path), "eot_id": eot_id, "dtype": dtype,
            "vocab": vocab_size, "chat": chat}))

        shown = [len(done)]

        def tick(finished: set[int]) -> None:
            if progress and len(finished) != shown[0]:
                shown[0] = len(finished)
                progress("tokenizing", sum(unit_size[i] for i in finished), total)

        _run_workers(work, workers, {u.index for u in units}, tick)
    return _finish(req, sources, hashes, units, digest, folder, work, vocab_size, eot, eot_id, dtype)


def _run_workers(work: Path, n: int, units: set[int], tick: Callable[[set[int]], None]) -> None:
    """``n`` worker processes (``python -m trainscale.runtime.data.shards``: plain interpreters that import only
    numpy and tokenizers, not the caller's modules), each taking every n-th unit of jobs.json; progress is
    read from the unit markers they write. A worker's bad-input sentence becomes this process's error."""
    import subprocess
    import sys
    import time

    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    src_root = str(Path(__file__).resolve().parents[2])  # the folder holding the trainscale package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    logs = [open(work / f"worker-{w}.log", "w+") for w in range(n)]  # noqa: SIM115 (closed below)
    procs = [subprocess.Popen([sys.executable, "-m", "trainscale.runtime.data.shards", str(work), str(w), str(n)],
                              env=env, stdout=subprocess.DEVNULL, stderr=logs[w]) for w in range(n)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            tick({i for i in units if (work / f"unit-{i:05d}.json").exists()})
            bad = next((w for w, c in enumerate(codes) if c not in (None, 0)), None)
            if bad is not None:
                logs[bad].seek(0)
                lines = [x for x in logs[bad].read().splitlines() if x.strip()]
                if codes[bad] == 2 and lines:
                    raise TrainscaleError(lines[-1])
                raise RuntimeError(f"prepare-data worker {bad} failed (exit {codes[bad]}): "
                                   + "\n".join(lines[-20:]))
            if all(c == 0 for c in codes):
                return
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _worker_main(argv: list[str]) -> int:
    """A worker process: ``python -m trainscale.runtime.data.shards WORK INDEX COUNT``."""
    import sys

    work, w, n = argv[0], int(argv[1]), int(argv[2])
    job = read_json_object(Path(work) / "jobs.json", "prepare-data job list", limit=MAX_INDEX_BYTES)
    sources = [Source(**x) for x in job["sources"]]
    settings = Settings(**job["settings"])
    try:
        for i, u in enumerate(Unit.from_json(x) for x in job["todo"]):
            if i % n == w:
                tokenize_unit(work, sources, u, settings, job["tokenizer"], job["eot_id"], job["dtype"], job["vocab"],
                              job.get("chat"))
    except TrainscaleError as e:
        print(e, file=sys.stderr)
        return 2
    return 0

def _no_train(req: DataRequest, held_out_docs: int) -> None:
    if held_out_docs:
        raise TrainscaleError(f"all {held_out_docs} document(s) went to the held-out split; give more documents "
                              "or a smaller data.held_out")
    raise TrainscaleError(f"the corpus is empty: {', '.join(f for c in req.parts() for f in c.files)} hold no text")


def _train_texts(sources: list[Source], units: list[Unit], s: Settings, max_chars: int | None,
                 seen: dict[str, int]) -> Iterator[str]:
    """The train split's documents, in order, up to ``max_chars`` characters: what the BPE learns from.
    ``seen`` counts the documents met per split."""
    left = max_chars if max_chars is not None else float("inf")
    for u in units:
        docs = unit_documents(sources, u, s)
        ends = docs.ends or [True] * len(docs.texts)
        for text, held, end in zip(docs.texts, docs.held, ends, strict=True):
            if held:
                seen["val"] += int(end)
                continue
            seen["train"] += int(end)
            yield text[: int(min(left, len(text)))]
            left -= len(text)
            if left <= 0:
                return


def _splits(work: Path, metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Each split's shards (with their mixture component), token and document counts, and where its documents
    end: the units' document ends joined into ``{split}-docs.npy``."""
    splits: dict[str, Any] = {}
    for split in ("train", "val"):
        shards, ends, offset = [], [], 0
        for m in metas:
            if not m[f"{split}_tokens"]:
                continue
            shards.append({"file": f"{split}-{m['unit']:05d}.npy", "tokens": m[f"{split}_tokens"],
                           "documents": m[f"{split}_docs"], "group": m["group"]})
            if (work / f"{split}-{m['unit']:05d}.flags.npy").exists():
                shards[-1]["flags_file"] = f"{split}-{m['unit']:05d}.flags.npy"
            ends.append(_npy(work / f"{split}-{m['unit']:05d}.ends.npy") + offset)
            offset += m[f"{split}_tokens"]
        _save_array(work / f"{split}-docs.npy", np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64))
        splits[split] = {"tokens": offset, "documents": sum(m[f"{split}_docs"] for m in metas), "shards": shards,
                         "documents_file": f"{split}-docs.npy"}
    return splits


def _unigram(work: Path, shards: list[dict[str, Any]], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for sh in shards:
        arr = read_npy(work / sh["file"]).array()
        for i in range(0, len(arr), 1 << 24):
            counts += np.bincount(arr[i: i + (1 << 24)], minlength=vocab_size)[:vocab_size]
        del arr  # its map (and file descriptor) closes now, not at the end
    return counts


def _finish(req: DataRequest, sources: list[Source], hashes: list[str], units: list[Unit], digest: str,
            folder: Path, work: Path, vocab_size: int, eot: str, eot_id: int, dtype: str) -> ShardCorpus:
    metas = [read_json_object(work / f"unit-{u.index:05d}.json", "prepare-data unit marker") for u in units]
    splits = _splits(work, metas)
    if splits["train"]["tokens"] == 0:
        _no_train(req, splits["val"]["documents"])
    if splits["val"]["tokens"] == 0:
        raise TrainscaleError(f"no document of the {splits['train']['documents']} went to the held-out split; "
                              "give more documents or a larger data.held_out")
    for g, comp in enumerate(req.parts()):
        if not any(sh["group"] == g for sh in splits["train"]["shards"]):
            raise TrainscaleError(f"mixture source {g + 1} ({', '.join(comp.files)}) has no training document; "
                                  "give it more documents or a smaller data.held_out")
    _save_array(work / "unigram.npy", _unigram(work, splits["train"]["shards"], vocab_size))
    index = {"version": FORMAT_VERSION, "hash": digest, "tokenizer": "tokenizer.json", "vocab_size": vocab_size,
             "eot": eot, "eot_id": eot_id, "dtype": dtype, "splits": splits, "unigram": "unigram.npy",
             "flags": req.format == "chat",
             "settings": {**req.settings.__dict__, "format": req.format},
             "components": [{"name": c.name, "weight": c.weight, "files": list(c.files)} for c in req.parts()],
             "sources": [{**src.__dict__, "sha256": h} for src, h in zip(sources, hashes, strict=True)]}
    for leftover in [*work.glob(".*.tmp*"), *work.glob("worker-*.log"), *work.glob("*.ends.npy"), work / "jobs.json"]:
        leftover.unlink(missing_ok=True)  # an interrupted run's half-written files, the workers' bookkeeping
    atomic_write_text(work / "index.json", json.dumps(index, indent=1))
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.rename(folder, old)
    os.rename(work, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return ShardCorpus(folder, req.weights)


if __name__ == "__main__":
    import sys

    sys.exit(_worker_main(sys.argv[1:]))
