"""Reading user files safely: only regular files (a FIFO or a device would block or never end), of a
bounded size, decoded as text; every failure one sentence (TrainscaleError)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainscale.errors import TrainscaleError

MAX_TEXT_BYTES = 64 << 20  # a config, profile or model.json is kilobytes; this is far beyond any


def check_regular(path: str | Path, what: str) -> Path:
    """``path`` must be an existing, readable regular file (links followed)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise TrainscaleError(f"{what} {p} does not exist") from None
    except OSError as e:
        raise TrainscaleError(f"{what} {p} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise TrainscaleError(f"{what} {p} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise TrainscaleError(f"{what} {p} is not a regular file (a FIFO, socket or device is never read)")
    if not os.access(p, os.R_OK):
        raise TrainscaleError(f"{what} {p} is not readable")
    return p


def read_text(path: str | Path, what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of a small regular file."""
    p = check_regular(path, what)
    if p.stat().st_size > limit:
        raise TrainscaleError(f"{what} {p} is {p.stat().st_size:,} bytes, larger than any such file ({limit:,})")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainscaleError(f"{what} {p} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise TrainscaleError(f"{what} {p} cannot be read: {e.strerror}") from None


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_output(path: str | Path, what: str, folder: bool, inputs: tuple[str | Path, ...] = ()) -> Path:
    """``path`` can be written as a ``folder`` (or a file): it is not a file where a folder is meant (or the
    reverse), nor a FIFO or device, its nearest existing parent is a writable folder, and it is not one
    of ``inputs`` or inside one (an output never overwrites what it is made from)."""
    p = Path(path)
    if not str(path).strip() or "\0" in str(path):
        raise TrainscaleError(f"{what} must be a path, not {str(path)!r}")
    if len(os.fsencode(str(p))) > 4000 or any(len(os.fsencode(part)) > 255 for part in p.parts):
        raise TrainscaleError(f"{what} {str(p)[:60]}... is longer than a path can be")
    resolved = p.resolve()
    for src in inputs:
        s = Path(src).resolve()
        if _inside(resolved, s) or (not folder and resolved == s):
            raise TrainscaleError(f"{what} {p} is inside its own input {src}; write it somewhere else")
    try:
        present = p.exists() or p.is_symlink()
    except OSError as e:
        raise TrainscaleError(f"{what} {p} cannot be used: {e.strerror}") from None
    if present:
        try:
            mode = os.stat(p).st_mode
        except OSError as e:
            raise TrainscaleError(f"{what} {p} cannot be used: {e.strerror}") from None
        if folder and not stat.S_ISDIR(mode):
            raise TrainscaleError(f"{what} {p} exists and is not a folder")
        if not folder and not stat.S_ISREG(mode):
            raise TrainscaleError(f"{what} {p} exists and is not a regular file")
        target = p if folder else p.parent
    else:
        target = p.parent
    probe = target.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise TrainscaleError(f"{what} {p} cannot be created: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK) or str(probe).startswith(("/proc", "/sys")):
        raise TrainscaleError(f"{what} {p} cannot be written: {probe} is not writable")
    return p


MODEL_FOLDER_FILES = ("model.json", "model.safetensors", "quantized.safetensors", "adapter.json",
                      "adapter.safetensors", "tokenizer.json", "config.json")


def check_folder_files(folder: str | Path, names: tuple[str, ...] = MODEL_FOLDER_FILES) -> None:
    """Every one of ``names`` that is present in ``folder`` is a regular file: a FIFO or a device named
    model.json would block the reader, a folder named so would fail deep inside it."""
    for name in names:
        p = Path(folder) / name
        if os.path.lexists(p):
            check_regular(p, "model folder file")
