"""Token ids people already have, read under a schema: Megatron's indexed datasets (``PREFIX.bin`` +
``PREFIX.idx``, the "MMIDIDX" memory-mapped format) and numpy ``.npy`` files of integer tokens.

The MMIDIDX index (Megatron-LM, megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``), little-endian:
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the .bin's tokens: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
              7 float32, 8 uint16 (``DType``)
    uint64    sequence count S
    uint64    document count D (the length of the document index: documents + 1)
    int32[S]  sizes: tokens per sequence
    int64[S]  pointers: byte offset of each sequence in the .bin
    int64[D]  document index: document i is sequences [doc[i], doc[i+1])
    int8[S]   sequence modes (multimodal datasets only; not read)
The .bin is the sequences' tokens back to back. Everything is checked before a token is read: the magic and
version, an integer dtype code, the file's length against S and D, sizes >= 0, pointers back to back (what the
writer produces), the .bin's length against the sizes, and a document index rising from 0 to S; token ids are
checked against the vocabulary as they are read. Each failure is one sentence naming the file.

A ``.npy`` is read with ``allow_pickle=False`` through its header (numpy's format: magic, version, header
dict): an integer dtype, 1-D (a token stream whose documents end with the end-of-text token) or 2-D (a
document per row), and a length that matches the file's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index length
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # codes 6, 7: floats
FLOAT_CODES = {6: "float64", 7: "float32"}
MAX_NPY_HEADER = 1 << 16  # numpy writes headers of a few hundred bytes (format 1.0 caps them at 65,535)


def megatron_paths(path: str | Path) -> tuple[Path, Path]:
    """(PREFIX.idx, PREFIX.bin) for a path naming either file."""
    p = Path(path)
    return p.with_suffix(".idx"), p.with_suffix(".bin")


@dataclass
class MegatronIndex:
    """An MMIDIDX index, checked against its .bin: the tokens' dtype and each document's token range."""

    idx: Path
    bin: Path
    dtype: np.dtype
    doc_starts: np.ndarray  # int64 [documents + 1]: token offset of each document's first token, then the total

    @property
    def documents(self) -> int:
        return len(self.doc_starts) - 1

    def tokens(self, first_doc: int, last_doc: int) -> np.ndarray:
        """The tokens of documents [first_doc, last_doc), read from the .bin (a copy)."""
        a, b = int(self.doc_starts[first_doc]), int(self.doc_starts[last_doc])
        with open(self.bin, "rb") as f:
            f.seek(a * self.dtype.itemsize)
            return np.fromfile(f, dtype=self.dtype, count=b - a)


def _refuse(idx: Path, why: str) -> TrainscaleError:
    return TrainscaleError(f"Megatron index {idx} {why}; it is not a valid .bin/.idx pair")


def read_megatron(path: str | Path) -> MegatronIndex:
    """The index of a Megatron indexed dataset (``path``: its .idx or .bin), checked as the module says."""
    idx, bin_ = megatron_paths(path)
    check_regular(idx, "Megatron index")
    check_regular(bin_, "Megatron data file")
    idx_size, bin_size = os.stat(idx).st_size, os.stat(bin_).st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise _refuse(idx, f"is {len(head)} bytes, shorter than the {HEADER.size}-byte header")
        magic, version, code, n_seq, n_doc = HEADER.unpack(head)
        if magic != MAGIC:
            raise _refuse(idx, "does not start with the MMIDIDX magic")
        if version != 1:
            raise _refuse(idx, f"has version {version}, not 1")
        if code in FLOAT_CODES:
            raise _refuse(idx, f"holds {FLOAT_CODES[code]} values (dtype code {code}), not token ids")
        if code not in DTYPES:
            raise _refuse(idx, f"has dtype code {code}, not one of {sorted(DTYPES)}")
        body = n_seq * (4 + 8) + n_doc * 8
        if idx_size - HEADER.size not in (body, body + n_seq):
            raise _refuse(idx, f"is {idx_size:,} bytes, but its header's {n_seq:,} sequences and {n_doc:,} document "
                          f"entries need {HEADER.size + body:,}")
        sizes = np.fromfile(f, dtype="<i4", count=n_seq).astype(np.int64)
        pointers = np.fromfile(f, dtype="<i8", count=n_seq)
        doc_idx = np.fromfile(f, dtype="<i8", count=n_doc)
    dtype = np.dtype(DTYPES[code])
    return MegatronIndex(idx, bin_, dtype, _doc_starts(idx, bin_, sizes, pointers, doc_idx, dtype, bin_size))


def _doc_starts(idx: Path, bin_: Path, sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray,
                dtype: np.dtype, bin_size: int) -> np.ndarray:
    """Each document's first token offset (and the total), once sizes, pointers and documents are consistent."""
    if len(sizes) and sizes.min() < 0:
        raise _refuse(idx, f"gives sequence {int(np.argmin(sizes))} a negative size")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    total_bytes = int(starts[-1]) * dtype.itemsize
    if total_bytes != bin_size:
        raise _refuse(idx, f"has sizes totalling {int(starts[-1]):,} {dtype.name} tokens ({total_bytes:,} bytes), "
                      f"but {bin_.name} holds {bin_size:,} bytes")
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        bad = int(np.argmax(pointers != starts[:-1] * dtype.itemsize))
        raise _refuse(idx, f"points sequence {bad} at byte {int(pointers[bad]):,}, not right after the one before")
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(sizes) or np.any(np.diff(doc_idx) < 0):
        raise _refuse(idx, f"has a document index that does not rise from 0 to its {len(sizes):,} sequences")
    return starts[doc_idx]


@dataclass
class NpyTokens:
    """A .npy of integer token ids: its dtype, shape and where its data starts."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    def array(self) -> np.ndarray:
        """The tokens, memory-mapped read-only (one file descriptor until the array is dropped)."""
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)


def read_npy(path: str | Path) -> NpyTokens:
    """A .npy's header, checked: integer tokens, 1-D or 2-D, C order, the data as long as the file."""
    p = check_regular(path, "token file")
    size = os.stat(p).st_size
    try:
        with open(p, "rb") as f:
            version = np.lib.format.read_magic(f)
            reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in reader:
                raise ValueError(f"numpy format version {version}")
            shape, fortran, dtype = reader[version](f, max_header_size=MAX_NPY_HEADER)
            offset = f.tell()
    except (ValueError, OSError, SyntaxError) as e:
        raise TrainscaleError(f"token file {p} is not a numpy .npy file ({str(e).splitlines()[0][:120]})") from None
    if dtype.kind not in "iu" or dtype.hasobject:
        raise TrainscaleError(f"token file {p} holds {dtype}, not integer token ids")
    if len(shape) not in (1, 2) or (fortran and len(shape) == 2):
        raise TrainscaleError(f"token file {p} has shape {shape}; give a 1-D token stream or a 2-D array of "
                              "documents in C order")
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if need != size:
        raise TrainscaleError(f"token file {p} is {size:,} bytes, but its header's {shape} {dtype} array needs "
                              f"{need:,}")
    return NpyTokens(p, dtype, tuple(int(x) for x in shape), offset)


def check_ids(tokens: np.ndarray, vocab: int, where: str) -> None:
    """Every id in ``tokens`` is in [0, vocab): else one sentence naming ``where`` and the first bad id."""
    if tokens.size == 0:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        at = int(np.argmax(tokens == bad))
        raise TrainscaleError(f"{where} holds token id {bad:,} (its token {at:,}), outside the tokenizer's "
                              f"vocabulary of {vocab:,}")
