"""What every sub-command shares: the console, JSON output, short citations."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from rich.console import Console

from trainscale.errors import TrainscaleError

console = Console()


def short_source(src: str) -> str:
    """A citation for a table cell: the first clause, without long parenthetical figure lists."""
    first = src.split(";")[0]
    return re.sub(r" \([^)]{40,}\)", "", first)


def emit_json(obj: Any) -> None:
    """Machine output: one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


# ------------------------------------------------------------------ the edge: option domains and paths

def number(gt: float | None = None, ge: float | None = None, lt: float | None = None, le: float | None = None):
    """A typer callback: the option (or each of a list's values) is finite and within the bounds; else
    one sentence, exit code 2. Upper bounds are where a larger value cannot be meant."""
    import math

    import typer

    def check(value: Any) -> Any:
        if value is None:
            return value
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise typer.BadParameter(f"must be a finite number, not {v}")
            for bound, ok, word in ((gt, lambda b, v=v: v > b, ">"), (ge, lambda b, v=v: v >= b, ">="),
                                    (lt, lambda b, v=v: v < b, "<"), (le, lambda b, v=v: v <= b, "<=")):
                if bound is not None and not ok(bound):
                    raise typer.BadParameter(f"must be {word} {bound:g}, not {v:g}")
        return value

    return check


def input_file(what: str):
    """A typer callback: an existing, readable regular file (never a FIFO or device)."""
    import typer

    def check(value: Any) -> Any:
        if value is None:
            return value
        from trainscale.safeio import check_regular

        try:
            check_regular(value, what)
        except TrainscaleError as e:
            raise typer.BadParameter(str(e)) from None
        return value

    return check


def catalog_or_file(what: str):
    """A typer callback for 'a catalog name or a file': a value that names an existing path must be a
    regular file (a folder with config.json is fine too)."""
    import typer

    def check(value: Any) -> Any:
        if value is None:
            return value
        from pathlib import Path

        from trainscale.safeio import check_regular

        if "\0" in str(value) or len(str(value)) > 4096:
            raise typer.BadParameter(f"{what} must be a name or a path")
        p = Path(value)
        try:
            exists = p.exists()
        except OSError:
            exists = False
        if exists:
            try:
                check_regular(p / "config.json" if p.is_dir() else p, what)
            except TrainscaleError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return check


SEED = number(ge=0, lt=2**63)


MAX_PROCESSES = 100_000_000  # more GPUs than any cluster has or will soon


def parse_layout(text: str) -> Any:
    """``Layout.parse`` with a bound: a layout asking for more processes than any cluster is refused."""
    from trainscale.specs import Layout

    lay = Layout.parse(text)
    degrees = (lay.tp, lay.cp, lay.pp, lay.dp, lay.mb, lay.v, lay.hsdp)
    if max(degrees) > MAX_PROCESSES or lay.world_size > MAX_PROCESSES:
        raise TrainscaleError(f"layout '{text}' asks for {lay.world_size:.3g} processes; at most "
                              f"{MAX_PROCESSES:,} are supported")
    return lay


def input_folder(what: str, holding: str | None = None):
    """A typer callback: an existing folder (holding the regular file ``holding``, if given)."""
    import typer

    def check(value: Any) -> Any:
        if value is None:
            return value
        import os

        try:
            ok = os.path.isdir(value)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise typer.BadParameter(f"{what} {str(value)[:200]} is not an existing folder")
        if holding is not None:
            from trainscale.safeio import check_regular

            try:
                check_regular(os.path.join(value, holding), f"{what}'s")
            except TrainscaleError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return check
