"""What every sub-command shares: the console, JSON output, short citations."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer
from rich.console import Console

from trainscale.errors import FieldError, TrainscaleError

console = Console()


def emit_json(obj: Any) -> None:
    """Machine output: one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


# ------------------------------------------------------------------ the edge: option domains and paths

def _opt(param: Any) -> str:
    """The option's name as the user typed it (--seq-len), or the argument's (CHECKPOINT)."""
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return max(opts, key=len) if opts else str(getattr(param, "name", "value")).upper()


def number(gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None):
    """A typer callback: the option is finite and within the bounds; else one sentence (TrainscaleError:
    exit code 2). Upper bounds are where a larger value cannot be meant."""
    import math


    def check(param: typer.CallbackParam, value: Any) -> Any:
        if value is None:
            return value
        name, v = _opt(param), value
        if isinstance(v, float) and not math.isfinite(v):
            raise TrainscaleError(f"{name} must be a finite number, not {v}")
        low_ok = (gt is None or v > gt) and (ge is None or v >= ge)
        high_ok = (lt is None or v < lt) and (le is None or v <= le)
        if low_ok and high_ok:
            return value
        hi = le if le is not None else lt
        if hi is not None and hi <= 1 and (gt is not None or ge is not None):  # a fraction: name the interval
            lo = gt if gt is not None else ge
            raise TrainscaleError(f"{name} must be in {'(' if gt is not None else '['}{lo:g}, {hi:g}"
                                  f"{']' if le is not None else ')'}, not {v:g}")
        if not low_ok:
            kind = "integer" if isinstance(v, int) else "number"
            if gt == 0:
                raise TrainscaleError(f"{name} must be a positive {kind}, not {v:g}")
            if ge == 0:
                raise TrainscaleError(f"{name} must be a non-negative {kind}, not {v:g}")
            raise TrainscaleError(f"{name} must be {'>' if gt is not None else '>='} {gt if gt is not None else ge:g}, "
                                  f"not {v:g}")
        raise TrainscaleError(f"{name} must be at most {hi:g}{'' if le is not None else ' (exclusive)'}, not {v:g}")

    return check


def input_file(what: str):
    """A typer callback: an existing, readable regular file (never a FIFO or device)."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        from trainscale.safeio import check_regular

        check_regular(value, what)
        return value

    return check


def output_path(folder: bool, what: str | None = None, remote: bool = False):
    """A typer callback for every option that names where a command writes (``--out``, ``--script``, ``--plot``):
    before anything is read, the path is a path (no NUL byte, not too long) and, unless ``remote`` (a path on
    another machine, e.g. a Slurm job's run folder), it can be written here as a ``folder`` (or a file): not the
    other kind, not a FIFO or device, its nearest existing parent a writable folder outside /proc and /sys
    (``safeio.check_output``). One sentence (TrainscaleError, exit 2) otherwise."""

    def check(param: typer.CallbackParam, value: Any) -> Any:
        if value is None:
            return value
        from trainscale.safeio import check_output

        name = what or _opt(param)
        text = str(value)
        if remote:
            if not text.strip() or "\0" in text or len(text) > 4000:
                raise TrainscaleError(f"{name} must be a path, not {text[:60]!r}")
            return value
        check_output(value, name, folder=folder)
        return value

    return check


def catalog_or_file(what: str):
    """A typer callback for 'a catalog name or a file': a value that names an existing path must be a
    regular file (a folder with config.json is fine too)."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        from pathlib import Path

        from trainscale.safeio import check_regular

        if "\0" in str(value) or len(str(value)) > 4096:
            raise TrainscaleError(f"{what} must be a name or a path")
        p = Path(value)
        try:
            exists = p.exists()
        except OSError:
            exists = False
        if exists:
            check_regular(p / "config.json" if p.is_dir() else p, what)
        return value

    return check


SEED = number(ge=0, lt=2**63)

_SUFFIX = {"k": 1, "m": 2, "g": 3, "b": 3, "t": 4}


def parse_count(text: str | None, what: str, base: int = 1000) -> float | None:
    """The one parser of a count on the command line (every --tokens): '16M' -> 16 x base^2, '15.6T' -> 15.6 x
    base^4, '1.56e13' and plain numbers as they are; positive and at most 1e18, else one sentence."""
    import re

    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgbt]?)\s*", str(text).lower())
    if not m:
        raise TrainscaleError(f"{what} '{str(text)[:60]}' is not a number (suffixes K, M, G/B, T are allowed)")
    value = float(m.group(1)) * base ** _SUFFIX.get(m.group(2), 0)
    if not 0 < value <= 1e18:  # also refuses 1e400 (inf) and 0
        raise TrainscaleError(f"{what} must be a positive number of at most 1e18, not '{text}'")
    return value


def counted(base: int = 1000):
    """A typer callback: ``parse_count`` of the option's text (``--tokens 2T``) -> the number."""

    def check(param: typer.CallbackParam, value: Any) -> Any:
        return parse_count(value, _opt(param), base)

    return check


def input_folder(what: str, holding: str | None = None):
    """A typer callback: an existing folder (holding the regular file ``holding``, if given)."""

    def check(value: Any) -> Any:
        if value is None:
            return value

        try:
            ok = os.path.isdir(value)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise TrainscaleError(f"{what} {str(value)[:200]} is not an existing folder")
        if holding is not None:
            from trainscale.safeio import check_regular

            check_regular(os.path.join(value, holding), f"{what}'s")
        return value

    return check


# estimate/ refuses a value by its field name (errors.FieldError); the command line names the flag. A field is
# its flag with dashes (max_v -> --max-v) unless this table says otherwise.
FLAGS = {"target_days": "--days", "gpu_hours": "--budget-gpu-hours"}


def flag(field: str) -> str:
    """The command-line flag a field's value comes from."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def user_message(e: TrainscaleError) -> str:
    """The sentence a person reads for ``e``: a field named as its flag."""
    return e.named(flag(e.field)) if isinstance(e, FieldError) else str(e)
