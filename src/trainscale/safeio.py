"""Reading user files safely: only regular files (a FIFO or a device would block or never end), of a
bounded size, decoded as text; every failure one sentence (TrainscaleError). Writing files whole or not at all
(``atomic_write_*``), the one JSON-object reader (``read_json_object``) and the one TOML writer (``toml_text``)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError

MAX_TEXT_BYTES = 64 << 20  # a config, profile or model.json is kilobytes; this is far beyond any


def check_regular(path: str | Path, what: str, follow_links: bool = True) -> Path:
    """``path`` must be an existing, readable regular file (links followed, unless ``follow_links`` is False: then
    a link is refused too, as inside a checkpoint folder, where a link could point out of it)."""
    p = Path(path)
    try:
        st = os.stat(p) if follow_links else os.lstat(p)
    except FileNotFoundError:
        raise TrainscaleError(f"{what} {p} does not exist") from None
    except OSError as e:
        raise TrainscaleError(f"{what} {p} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise TrainscaleError(f"{what} {p} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise TrainscaleError(f"{what} {p} is not a regular file (a FIFO, socket, device or link is never read)")
    if not os.access(p, os.R_OK):
        raise TrainscaleError(f"{what} {p} is not readable")
    return p


def read_bytes(path: str | Path, what: str, limit: int | None = MAX_TEXT_BYTES, follow_links: bool = True) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (None: any size); every failure one sentence."""
    p = check_regular(path, what, follow_links)
    size = p.stat().st_size
    if limit is not None and size > limit:
        raise TrainscaleError(f"{what} {p} is {size:,} bytes, larger than any such file ({limit:,})")
    try:
        return p.read_bytes()
    except OSError as e:
        raise TrainscaleError(f"{what} {p} cannot be read: {e.strerror}") from None


def read_text(path: str | Path, what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of a small regular file."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainscaleError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


MAX_JSON_BYTES = 16 << 20  # run.json, model.json, adapter.json, a plan: kilobytes


def parse_json(text: str | bytes, what: str) -> Any:
    """JSON text from a user's file -> its value; not JSON, or nested too deeply for the decoder (it recurses per
    level), is one sentence naming ``what``."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise TrainscaleError(f"{what} is not valid JSON ({e})") from None
    except RecursionError:
        raise TrainscaleError(f"{what} nests arrays or objects too deeply to be read") from None


def parse_toml(text: str, what: str) -> dict[str, Any]:
    """TOML text from a user's file -> its table; invalid or too deeply nested TOML is one sentence."""
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TrainscaleError(f"{what} is not valid TOML ({e})") from None
    except RecursionError:
        raise TrainscaleError(f"{what} nests arrays or tables too deeply to be read") from None


def read_json_object(path: str | Path, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in the small regular file ``path``; one sentence naming ``what`` if it is missing, too
    large, not UTF-8, not JSON or not an object."""
    got = parse_json(read_text(path, what, limit), f"{what} {path}")
    if not isinstance(got, dict):
        raise TrainscaleError(f"{what} {path} is not a JSON object (it holds a {type(got).__name__})")
    return got


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write ``path`` whole or not at all: ``write`` fills a temporary file in the same folder (so the rename
    never crosses file systems), its bytes are fsynced, then ``os.replace`` puts it in place (atomic on POSIX:
    rename(2)) and the folder is fsynced so the new name survives a crash. The temporary file is removed if
    anything fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder; the data itself is safe
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """``data`` into ``path``, whole or not at all (``atomic_write``)."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``text`` as UTF-8 into ``path``, whole or not at all (``atomic_write``)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """``obj`` as JSON into ``path``, whole or not at all."""
    return atomic_write_text(path, json.dumps(obj, indent=indent))


def toml_text(data: dict[str, Any], header: str = "") -> str:
    """``data`` as TOML that ``tomllib`` reads back equal: strings escaped per the TOML 1.0 spec (control
    characters, quotes, backslashes), floats in shortest round-trip form, nan/inf as TOML spells them; written
    by tomli-w. ``header``: a comment line put first. None values are left out (TOML has no null)."""
    import tomli_w

    def drop_none(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): drop_none(v) for k, v in x.items() if v is not None}
        if isinstance(x, list | tuple):
            return [drop_none(v) for v in x]
        return x

    text = tomli_w.dumps(drop_none(data))
    return (f"# {header}\n" if header else "") + text


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_output(path: str | Path, what: str, folder: bool, inputs: tuple[str | Path, ...] = (),
                 not_at: tuple[str | Path, ...] = ()) -> Path:
    """``path`` can be written as a ``folder`` (or a file): it is not a file where a folder is meant (or the
    reverse), nor a FIFO or device, its nearest existing parent is a writable folder, it is not one
    of ``inputs`` or inside one (an output never overwrites what it is made from), and it is none of ``not_at``
    (the reference the user named, e.g. a run folder whose final/ or checkpoint was read: outputs may go beside
    them inside it, never into it as a whole)."""
    p = Path(path)
    if not str(path).strip() or "\0" in str(path):
        raise TrainscaleError(f"{what} must be a path, not {str(path)!r}")
    if len(os.fsencode(str(p))) > 4000 or any(len(os.fsencode(part)) > 255 for part in p.parts):
        raise TrainscaleError(f"{what} {str(p)[:60]}... is longer than a path can be")
    resolved = p.resolve()
    for ref in not_at:
        if resolved == Path(ref).resolve():
            raise TrainscaleError(f"{what} {p} is inside its own input {ref} (the folder named to read from); "
                                  "write it somewhere else")
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
    if not os.access(probe, os.W_OK | os.X_OK) or any(_inside(probe, Path(d)) for d in ("/proc", "/sys", "/dev")):
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
