"""A user's corpus as memory-mapped token shards: what ``trainscale prepare-data`` writes and training reads.

Inputs (``[data] files``): plain-text files, JSONL (one document per line, text in a named field) and
Parquet (a file or a folder; text in a named column), as paths, globs or folders. The work is cut into
units of about ``shard_mb`` input megabytes (at line / paragraph boundaries, or Parquet row groups);
each unit is read, tokenised and written as one shard per split by a worker process, so no process
ever holds more than a unit of text: corpora larger than memory work.

Output folder:
    index.json            what is there: shards and token counts per split, tokenizer, end-of-text id,
                          the content hash of inputs + tokenizer + settings, the inputs' size and mtime
    tokenizer.json        the tokenizer (trained on the train split, or the one loaded)
    train-00000.npy ...   uint16 (vocabulary <= 65,536) or uint32 token ids, documents packed, each
    val-00000.npy ...     followed by the end-of-text token; numpy .npy read with mmap (no pickle)
    unigram.npy           train-split token counts (the unigram baseline, without rereading the shards)

Documents go to the held-out split by a hash of their position (file, byte offset or row), never by
chance or by worker. Everything is written to a temporary name and renamed into place; units finished
before an interruption are kept in ``.NAME.partial-HASH`` and not redone; the finished folder replaces
the old one only when complete. Re-running on the same inputs (by content), tokenizer and settings is a
no-op; unchanged files (same size and mtime) are not even reread.
"""

from __future__ import annotations

import glob as globmod
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainscale.errors import TrainscaleError

FORMAT_VERSION = 1
TEXT_SUFFIXES = {".txt", ".text", ".md"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
Progress = Callable[[str, int, int], None]  # (stage, done, total)
BATCH_CHARS, BATCH_DOCS = 1 << 20, 4096  # documents go to the tokenizer's batch encode in batches this big


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Source:
    path: str
    format: str  # "text" | "jsonl" | "parquet"
    size: int
    mtime_ns: int


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def resolve_sources(files: tuple[str, ...], fmt: str = "auto") -> list[Source]:
    """Paths, globs and folders -> the input files, sorted within each entry, first mention kept."""
    found: list[Path] = []
    for entry in files:
        if any(c in entry for c in "*?["):
            hits = sorted(Path(p) for p in globmod.glob(os.path.expanduser(entry), recursive=True))
            hits = [p for p in hits if p.is_file()]
            if not hits:
                raise TrainscaleError(f"data file pattern '{entry}' matches no files")
            found += hits
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
            hits = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                          and (fmt != "auto" or p.suffix.lower() in known))
            if not hits:
                raise TrainscaleError(f"data folder {path} has no .txt, .jsonl or .parquet files")
            found += hits
        elif path.is_file():
            found.append(path)
        else:
            raise TrainscaleError(f"data file {path} does not exist")
    seen: set[Path] = set()
    out = []
    for p in found:
        rp = p.resolve()
        if rp in seen:
            continue
        seen.add(rp)
        st = rp.stat()
        out.append(Source(str(rp), _format_of(rp, fmt), st.st_size, st.st_mtime_ns))
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- units of work


@dataclass(frozen=True)
class Unit:
    """Bytes [start, end) of a text/JSONL source, or row groups [start, end) of a Parquet one."""

    index: int
    source: int
    start: int
    end: int


def _next_cut(f, pos: int, size: int, sep: bytes, scan: int = 16 << 20) -> int:
    """The first offset after ``sep`` at or after ``pos`` (a line cut if no ``sep`` within ``scan``)."""
    for pattern in (sep, b"\n") if sep != b"\n" else (sep,):
        f.seek(max(0, pos - len(pattern) + 1))
        base = f.tell()
        buf = f.read(scan)
        i = buf.find(pattern)
        if i >= 0:
            return base + i + len(pattern)
    return size


def plan_units(sources: list[Source], unit_bytes: int, documents: str) -> list[Unit]:
    units: list[Unit] = []
    for si, src in enumerate(sources):
        if src.format == "parquet":
            pf = _parquet(src.path)
            groups = [pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups)]
            start, acc = 0, 0
            for g, nbytes in enumerate(groups):
                acc += nbytes
                if acc >= unit_bytes or g == len(groups) - 1:
                    units.append(Unit(len(units), si, start, g + 1))
                    start, acc = g + 1, 0
            continue
        if src.size == 0:
            continue
        sep = b"\n\n" if src.format == "text" and documents == "paragraph" else b"\n"
        start = 0
        with open(src.path, "rb") as f:
            while start < src.size:
                end = src.size if start + unit_bytes >= src.size else _next_cut(f, start + unit_bytes, src.size, sep)
                units.append(Unit(len(units), si, start, end))
                start = end
    return units


def _parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TrainscaleError("Parquet input needs pyarrow: pip install 'trainscale[runtime]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise TrainscaleError(f"data file {path} is not a Parquet file ({str(e).splitlines()[0]})") from None


# --------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Settings:
    """Everything that changes the shards (the worker count does not)."""

    documents: str = "paragraph"  # plain text: "paragraph" (blank-line separated) or "file"
    text_field: str = "text"
    held_out: float = 0.05
    unit_bytes: int = 32 << 20

    def is_held_out(self, key: str) -> bool:
        """Whether the document named ``key`` is held out (a whole plain-text file, ``documents = "file"``)."""
        return bool(self.held_mask(key, 1)[0])

    def held_mask(self, key: str, n: int) -> np.ndarray:
        """Held out or not, for the ``n`` documents of the unit named ``key``: splitmix64 (Steele, Lea &
        Flood 2014) of the document's number, seeded by a hash of the key, below ``held_out`` x 2^64."""
        seed = np.uint64(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))
        with np.errstate(over="ignore"):
            z = seed + (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        return z < np.uint64(min(int(self.held_out * 2.0**64), 2**64 - 1))


@dataclass
class Docs:
    """One unit's documents: texts, held out or not, and whether each ends its document (None: all do;
    a plain-text file read as one document spans units, and only its last piece ends it)."""

    texts: list[str]
    held: np.ndarray
    ends: list[bool] | None = None


def _line_number(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _decode(raw: bytes, path: str, start: int) -> str:
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise TrainscaleError(f"data file {path} is binary, not text (a NUL byte at offset {start + nul})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainscaleError(f"data file {path} is not UTF-8 text (an invalid byte at offset {start + e.start})"
                              ) from None


def unit_documents(src: Source, si: int, unit: Unit, s: Settings) -> Docs:
    """The documents of one unit, with their split."""
    if src.format == "parquet":
        texts = _parquet_texts(src, unit, s)
        return Docs(texts, s.held_mask(f"{si}:{unit.start}", len(texts)))
    with open(src.path, "rb") as f:
        f.seek(unit.start)
        raw = f.read(unit.end - unit.start)
    if src.format == "jsonl":
        texts = _jsonl_texts(raw, src.path, unit.start, s.text_field)
        return Docs(texts, s.held_mask(f"{si}:{unit.start}", len(texts)))
    text = _decode(raw, src.path, unit.start).replace("\r\n", "\n")
    if s.documents == "file":
        # pieces of ~64 KB cut after a newline, so the tokenizer's batch encode can spread them over threads
        pieces = [p for p in re.findall(r"(?s).{1,65536}?(?:\n|$)", text) if p] if len(text) > 65536 else [text]
        ends = [False] * len(pieces)
        ends[-1] = unit.end >= src.size
        return Docs(pieces, np.full(len(pieces), s.is_held_out(f"{si}")), ends)
    paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t\f\v]*\n", text)]
    texts = [p for p in paragraphs if p.strip()]
    return Docs(texts, s.held_mask(f"{si}:{unit.start}", len(texts)))


def _jsonl_texts(raw: bytes, path: str, start: int, field: str) -> list[str]:
    """The ``field`` of each non-blank line: read by pyarrow's JSON reader (C++, only that field), and
    line by line with the json module only to name the line at fault."""
    try:
        import pyarrow as pa
        import pyarrow.json as pj

        table = pj.read_json(pa.BufferReader(raw), read_options=pj.ReadOptions(use_threads=False,
                                                                                block_size=max(1 << 20, len(raw) + 1)),
                             parse_options=pj.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]),
                                                           unexpected_field_behavior="ignore"))
        column = table.column(field)
        if column.null_count == 0:
            return column.to_pylist()
    except ImportError:
        try:
            lines = [ln for ln in raw.decode("utf-8").split("\n") if ln.strip()]
            objs = json.loads("[" + ",".join(lines) + "]")
            texts = [o[field] for o in objs]
            if len(objs) == len(lines) and all(type(t) is str for t in texts):
                return texts
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, IndexError):
            pass
    except Exception:  # noqa: BLE001 (pyarrow.lib.ArrowInvalid and kin): find the line below
        pass
    offset = start
    for line in raw.split(b"\n"):
        here, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue
        where = f"data file {path} line {_line_number(path, here)}"
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise TrainscaleError(f"{where} is not JSON") from None
        if not isinstance(obj, dict) or field not in obj:
            raise TrainscaleError(f"{where} has no '{field}' field")
        if not isinstance(obj[field], str):
            raise TrainscaleError(f"{where}: '{field}' is not a string")
    raise TrainscaleError(f"data file {path} has lines that are not one JSON object each")


def _parquet_texts(src: Source, unit: Unit, s: Settings) -> list[str]:
    import pyarrow as pa

    pf = _parquet(src.path)
    if s.text_field not in pf.schema_arrow.names:
        raise TrainscaleError(f"data file {src.path} has no column '{s.text_field}' "
                              f"(columns: {', '.join(pf.schema_arrow.names)})")
    field = pf.schema_arrow.field(s.text_field)
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise TrainscaleError(f"data file {src.path}: column '{s.text_field}' holds {field.type}, not text")
    column = pf.read_row_groups(list(range(unit.start, unit.end)), columns=[s.text_field]).column(0)
    if column.null_count:
        row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start)) + column.is_null().index(True).as_py()
        raise TrainscaleError(f"data file {src.path} row {row} has no '{s.text_field}' (null)")
    return column.to_pylist()


# --------------------------------------------------------------------------- tokenizers


def load_tokenizer(path: str | Path):
    """A ``tokenizer.json`` file, or a Hugging Face tokenizer folder (tokenizer.json, or a byte-level BPE's
    vocab.json + merges.txt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    p = Path(path).expanduser()
    if not p.exists():
        raise TrainscaleError(f"tokenizer {p} does not exist")
    try:
        if p.is_dir():
            if (p / "tokenizer.json").is_file():
                return Tokenizer.from_file(str(p / "tokenizer.json"))
            if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
                tok = Tokenizer(models.BPE.from_file(str(p / "vocab.json"), str(p / "merges.txt")))
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                tok.decoder = decoders.ByteLevel()
                return tok
            raise TrainscaleError(f"tokenizer folder {p} has neither tokenizer.json nor vocab.json + merges.txt")
        return Tokenizer.from_file(str(p))
    except TrainscaleError:
        raise
    except Exception as e:  # tokenizers raises its own Exception type
        raise TrainscaleError(f"tokenizer {p} cannot be read ({str(e).splitlines()[0]})") from None


def _eot_of(tok, path: str | None, eot: str | None) -> str:
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
                    val = json.loads(f.read_text()).get("eos_token")
                except (json.JSONDecodeError, OSError, AttributeError):
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


def train_bpe(texts: Iterator[str], vocab_size: int, eot: str = "<|endoftext|>"):
    """Byte-level BPE (Radford et al. 2019, GPT-2 scheme) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eot],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# --------------------------------------------------------------------------- one unit, in a worker


_TOKENIZER: tuple[str, Any] | None = None  # (path, Tokenizer): loaded once per worker process


def _tokenizer(path: str):
    global _TOKENIZER
    if _TOKENIZER is None or _TOKENIZER[0] != path:
        from tokenizers import Tokenizer

        _TOKENIZER = (path, Tokenizer.from_file(path))
    return _TOKENIZER[1]


def encode(tok, texts: list[str], ends: list[bool], eot: int, dtype) -> np.ndarray:
    """Token ids of ``texts``, each followed by ``eot`` where its document ends, as one array."""
    from itertools import chain

    encs = tok.encode_batch_fast(texts, add_special_tokens=False) if hasattr(tok, "encode_batch_fast") \
        else tok.encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encs]
    for i, end in zip(ids, ends, strict=True):
        if end:
            i.append(eot)
    n = sum(map(len, ids))
    return np.fromiter(chain.from_iterable(ids), dtype=dtype, count=n)


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _batches(texts: list[str]) -> Iterator[tuple[int, int]]:
    """[a, b) ranges of ``texts`` of about BATCH_CHARS characters or BATCH_DOCS documents."""
    a, size = 0, 0
    for i, t in enumerate(texts):
        size += len(t)
        if size >= BATCH_CHARS or i + 1 - a >= BATCH_DOCS:
            yield a, i + 1
            a, size = i + 1, 0
    if a < len(texts):
        yield a, len(texts)


def tokenize_unit(work: str, src: Source, si: int, unit: Unit, s: Settings, tokenizer: str, eot: int,
                  dtype: str) -> dict[str, int]:
    """Tokenise one unit into ``train-NNNNN.npy`` and ``val-NNNNN.npy``; ``unit-NNNNN.json`` last marks it done."""
    import gc

    tok = _tokenizer(tokenizer)
    gc.disable()  # millions of short-lived id lists: the cyclic collector would only scan them
    try:
        return _tokenize_unit(work, tok, src, si, unit, s, eot, dtype)
    finally:
        gc.enable()


def _tokenize_unit(work: str, tok, src: Source, si: int, unit: Unit, s: Settings, eot: int,
                   dtype: str) -> dict[str, int]:
    docs = unit_documents(src, si, unit, s)
    meta = {"unit": unit.index, "chars": sum(map(len, docs.texts))}
    folder = Path(work)
    for split, held in (("train", False), ("val", True)):
        keep = np.flatnonzero(docs.held == held)
        texts = docs.texts if len(keep) == len(docs.texts) else [docs.texts[i] for i in keep]
        ends = [True] * len(texts) if docs.ends is None else [docs.ends[i] for i in keep]
        pieces = [encode(tok, texts[a:b], ends[a:b], eot, dtype) for a, b in _batches(texts)]
        arr = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
        _atomic_save(folder / f"{split}-{unit.index:05d}.npy", arr)
        meta[f"{split}_tokens"], meta[f"{split}_docs"] = int(arr.size), sum(ends)
    _atomic_write(folder / f"unit-{unit.index:05d}.json", json.dumps(meta))
    return meta


# --------------------------------------------------------------------------- the prepared corpus


class TokenStream:
    """Several token arrays read as one: ``len()`` and ``[a:b]`` slices (the loader's whole interface)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, step = s.indices(len(self))
        if step != 1:
            raise IndexError("TokenStream slices take step 1")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            a0 = int(self.starts[i])
            take = min(stop, int(self.starts[i + 1])) - start
            pieces.append(self.arrays[i][start - a0: start - a0 + take])
            start += take
            i += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.arrays[0].dtype)


@dataclass(frozen=True)
class ShardCorpus:
    """A prepare-data folder, opened: same interface as data.Corpus (tokenizer_path, tokens, unigram_counts)."""

    folder: Path

    @property
    def index(self) -> dict[str, Any]:
        return json.loads((self.folder / "index.json").read_text())

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / "tokenizer.json"

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    def tokens(self, split: str) -> TokenStream:
        shards = self.index["splits"][split]["shards"]
        return TokenStream([np.load(self.folder / s["file"], mmap_mode="r") for s in shards])

    def unigram_counts(self) -> np.ndarray:
        return np.load(self.folder / "unigram.npy")


# --------------------------------------------------------------------------- prepare


def _settings_key(s: Settings, tokenizer_key: str) -> str:
    return json.dumps({"version": FORMAT_VERSION, "documents": s.documents, "text_field": s.text_field,
                       "held_out": s.held_out, "unit_bytes": s.unit_bytes, "tokenizer": tokenizer_key},
                      sort_keys=True)


def _content_hash(sources: list[Source], hashes: list[str], settings_key: str) -> str:
    h = hashlib.sha256(settings_key.encode())
    for src, digest in zip(sources, hashes, strict=True):
        h.update(f"|{src.format}:{digest}".encode())
    return h.hexdigest()


def _source_hashes(sources: list[Source], old: dict[str, Any] | None, progress: Progress | None) -> list[str]:
    """Content hashes; a file whose path, size and mtime are those the old index recorded keeps its hash."""
    known = {(s["path"], s["size"], s["mtime_ns"]): s["sha256"] for s in (old or {}).get("sources", [])}
    out, total, done = [], sum(s.size for s in sources), 0
    for src in sources:
        digest = known.get((src.path, src.size, src.mtime_ns))
        out.append(digest or _sha256(src.path))
        done += src.size
        if progress and digest is None:
            progress("hashing inputs", done, total)
    return out


@dataclass(frozen=True)
class DataRequest:
    """What to prepare: ``[data]``'s keys, resolved (runtime/config.DataSection.request() builds it)."""

    files: tuple[str, ...]
    format: str = "auto"
    settings: Settings = Settings()
    tokenizer: str | None = None
    tokenizer_vocab: int | None = None  # trained tokenizer's size
    eot: str | None = None
    max_chars: int | None = None  # the tokenizer trains on at most this many characters
    folder: str | None = None
    workers: int = 0


def default_folder(req: DataRequest, cache: Path) -> Path:
    """Named by what was asked (paths and settings), so a later run finds it before hashing contents."""
    key = json.dumps([sorted(str(Path(f).expanduser().absolute()) for f in req.files), req.format, req.tokenizer,
                      req.tokenizer_vocab, req.eot, req.max_chars, req.settings.__dict__], sort_keys=True)
    return cache / f"data-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def prepare(req: DataRequest, model_vocab: int, cache: Path, progress: Progress | None = None,
            log: Callable[[str], None] = lambda _m: None) -> ShardCorpus:
    """Tokenise ``req``'s corpus into shards (or find them done): -> the opened folder."""
    folder = Path(req.folder).expanduser() if req.folder else default_folder(req, cache)
    sources = resolve_sources(req.files, req.format)
    if not sources or all(s.size == 0 for s in sources):
        raise TrainscaleError(f"the corpus is empty: {', '.join(req.files)} hold no text")
    old = None
    if folder.exists():
        if not (folder / "index.json").is_file():
            raise TrainscaleError(f"data.prepared folder {folder} exists and is not a prepare-data folder")
        old = json.loads((folder / "index.json").read_text())

    if req.tokenizer is not None:
        tok = load_tokenizer(req.tokenizer)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if vocab > model_vocab:
            raise TrainscaleError(f"tokenizer {req.tokenizer} has {vocab:,} tokens, more than the model's vocab_size "
                                  f"{model_vocab:,}")
        eot = _eot_of(tok, req.tokenizer, req.eot)
        tok_key = hashlib.sha256(tok.to_str().encode()).hexdigest() + f"|{eot}"
    else:
        tok, vocab = None, req.tokenizer_vocab or model_vocab
        if vocab > model_vocab:
            raise TrainscaleError(f"data.tokenizer_vocab {vocab:,} exceeds the model's vocab_size {model_vocab:,}")
        eot = req.eot or "<|endoftext|>"
        tok_key = f"bpe-bytelevel|{vocab}|{eot}|{req.max_chars}"
    s = req.settings
    hashes = _source_hashes(sources, old, progress)
    digest = _content_hash(sources, hashes, _settings_key(s, tok_key))
    if old is not None and old.get("hash") == digest:
        log(f"{folder}: already prepared from these inputs (content hash {digest[:12]})")
        return ShardCorpus(folder)

    work = folder.with_name(f".{folder.name}.partial-{digest[:16]}")
    for stale in folder.parent.glob(f".{folder.name}.partial-*") if folder.parent.exists() else ():
        if stale != work:  # an interrupted run on inputs that have changed since: of no use now
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
    units = plan_units(sources, s.unit_bytes, s.documents)
    if not units:
        raise TrainscaleError(f"the corpus is empty: {', '.join(req.files)} hold no text")
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
        _atomic_write(tok_path, tok.to_str())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eot_id = tok.token_to_id(eot)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"

    done = {u.index for u in units if (work / f"unit-{u.index:05d}.json").exists()}
    todo = [u for u in units if u.index not in done]
    if done:
        log(f"resuming: {len(done)} of {len(units)} shards already written")
    unit_size = {u.index: _unit_bytes(sources, u) for u in units}
    total = sum(unit_size.values())
    progress_done = sum(unit_size[i] for i in done)
    workers = min(req.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                  else os.cpu_count() or 1), len(todo))
    if progress:
        progress("tokenizing", progress_done, total)
    if workers <= 1:
        for u in todo:
            tokenize_unit(str(work), sources[u.source], u.source, u, s, str(tok_path), eot_id, dtype)
            progress_done += unit_size[u.index]
            if progress:
                progress("tokenizing", progress_done, total)
    else:
        _atomic_write(work / "jobs.json", json.dumps({
            "sources": [src.__dict__ for src in sources], "todo": [u.__dict__ for u in todo],
            "settings": s.__dict__, "tokenizer": str(tok_path), "eot_id": eot_id, "dtype": dtype}))

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
    job = json.loads((Path(work) / "jobs.json").read_text())
    sources = [Source(**x) for x in job["sources"]]
    settings = Settings(**job["settings"])
    try:
        for i, u in enumerate(Unit(**x) for x in job["todo"]):
            if i % n == w:
                tokenize_unit(work, sources[u.source], u.source, u, settings, job["tokenizer"], job["eot_id"],
                              job["dtype"])
    except TrainscaleError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def _unit_bytes(sources: list[Source], u: Unit) -> int:
    src = sources[u.source]
    if src.format == "parquet":
        return max(1, src.size // max(1, _parquet(src.path).metadata.num_row_groups) * (u.end - u.start))
    return u.end - u.start


def _no_train(req: DataRequest, held_out_docs: int) -> None:
    if held_out_docs:
        raise TrainscaleError(f"all {held_out_docs} document(s) went to the held-out split; give more documents "
                              "or a smaller data.held_out")
    raise TrainscaleError(f"the corpus is empty: {', '.join(req.files)} hold no text")


def _train_texts(sources: list[Source], units: list[Unit], s: Settings, max_chars: int | None,
                 seen: dict[str, int]) -> Iterator[str]:
    """The train split's documents, in order, up to ``max_chars`` characters: what the BPE learns from.
    ``seen`` counts the documents met per split."""
    left = max_chars if max_chars is not None else float("inf")
    for u in units:
        docs = unit_documents(sources[u.source], u.source, u, s)
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


def _finish(req: DataRequest, sources: list[Source], hashes: list[str], units: list[Unit], digest: str,
            folder: Path, work: Path, vocab_size: int, eot: str, eot_id: int, dtype: str) -> ShardCorpus:
    metas = [json.loads((work / f"unit-{u.index:05d}.json").read_text()) for u in units]
    splits: dict[str, Any] = {}
    for split in ("train", "val"):
        shards = [{"file": f"{split}-{m['unit']:05d}.npy", "tokens": m[f"{split}_tokens"]}
                  for m in metas if m[f"{split}_tokens"]]
        splits[split] = {"tokens": sum(x["tokens"] for x in shards), "documents": sum(m[f"{split}_docs"]
                                                                                      for m in metas),
                         "shards": shards}
    if splits["train"]["tokens"] == 0:
        _no_train(req, splits["val"]["documents"])
    if splits["val"]["tokens"] == 0:
        raise TrainscaleError(f"no document of the {splits['train']['documents']} went to the held-out split; "
                              "give more documents or a larger data.held_out")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for sh in splits["train"]["shards"]:
        arr = np.load(work / sh["file"], mmap_mode="r")
        for i in range(0, len(arr), 1 << 24):
            counts += np.bincount(arr[i: i + (1 << 24)], minlength=vocab_size)[:vocab_size]
    _atomic_save(work / "unigram.npy", counts)
    index = {"version": FORMAT_VERSION, "hash": digest, "tokenizer": "tokenizer.json", "vocab_size": vocab_size,
             "eot": eot, "eot_id": eot_id, "dtype": dtype, "splits": splits, "unigram": "unigram.npy",
             "settings": {**req.settings.__dict__, "format": req.format},
             "sources": [{**src.__dict__, "sha256": h} for src, h in zip(sources, hashes, strict=True)]}
    for leftover in [*work.glob("*.tmp-*"), *work.glob("worker-*.log"), work / "jobs.json"]:
        leftover.unlink(missing_ok=True)  # an interrupted run's half-written files, the workers' bookkeeping
    _atomic_write(work / "index.json", json.dumps(index, indent=1))
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.rename(folder, old)
    os.rename(work, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return ShardCorpus(folder)


if __name__ == "__main__":
    import sys

    sys.exit(_worker_main(sys.argv[1:]))
