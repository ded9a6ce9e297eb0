"""Humanising numbers at the edge: code keeps bytes, seconds and FLOPs; people read GB, days, MW.

A leaf (it imports nothing of trainscale), so every layer that prints (runtime's console line, report, commands)
humanises with the same functions."""

from __future__ import annotations

import re


def num(x: float, digits: int = 3) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1e7 or abs(x) < 1e-3:
        return f"{x:.{digits}g}".replace("e+", "e")
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def bytes_(b: float) -> str:
    """Decimal GB/TB with the binary GiB beside it, both labelled."""
    for unit, div, bunit, bdiv in (("TB", 1e12, "TiB", 2**40), ("GB", 1e9, "GiB", 2**30),
                                   ("MB", 1e6, "MiB", 2**20), ("kB", 1e3, "KiB", 2**10)):
        if abs(b) >= div:
            return f"{b / div:,.2f} {unit} ({b / bdiv:,.2f} {bunit})"
    return f"{b:,.0f} B"


def watts(w: float) -> str:
    if abs(w) >= 1e6:
        return f"{w / 1e6:,.2f} MW"
    if abs(w) >= 1e3:
        return f"{w / 1e3:,.2f} kW"
    return f"{w:,.0f} W"


def seconds(s: float) -> str:
    if s >= 86400 * 365.25:
        return f"{s / (86400 * 365.25):,.0f} years"
    if s >= 86400:
        return f"{s / 86400:,.1f} days"
    if s >= 3600:
        return f"{s / 3600:,.2f} h"
    if s >= 1:
        return f"{s:,.2f} s"
    return f"{s * 1e3:,.2f} ms"


def value(v: float, unit: str) -> str:
    """Format a value by its unit name."""
    if unit == "bytes":
        return bytes_(v)
    if unit == "W":
        return watts(v)
    if unit == "J":
        return f"{v / 3.6e9:,.0f} MWh"
    if unit == "s":
        return seconds(v)
    if unit == "fraction":
        return f"{v:.1%}"
    if unit == "bool":
        return "yes" if v else "no"
    if unit == "params":
        return f"{v:,.0f}"
    if unit in ("racks", "GPUs"):
        return f"{v:,.0f}"
    if unit == "x":
        return f"{v:,.1f}x"
    return f"{num(v)} {unit}".strip()


# ------------------------------------------------------------------ short figures for 80-column output

_SCALES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))  # short scale: B = 10^9 (tokens, parameters)


def count(x: float) -> str:
    """A count a person reads at a glance, three significant digits at most and never '0.00M':
    0.372, 4.51, 1,234, 12.3k, 4.5M, 15.6T."""
    if x == 0:
        return "0"
    a = abs(x)
    if a < 10:
        return f"{x:.3g}"
    if a < 10_000:
        return f"{x:,.0f}"
    for div, suffix in _SCALES:
        if a >= div * 0.9995:
            return f"{_sig3(x / div)}{suffix}"
    return f"{x:,.0f}"


def _sig3(x: float) -> str:
    """Three significant digits, no exponent and no trailing '.0' (12.3, 123, 4.5)."""
    a = abs(x)
    text = f"{x:,.0f}" if a >= 99.95 else f"{x:.1f}" if a >= 9.995 else f"{x:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def days(d: float) -> str:
    """Days with their unit; under one day the hours beside them (0.22 days (5.3 h))."""
    if d >= 100:
        return f"{d:,.0f} days"
    if d >= 1:
        return f"{d:.3g} days"
    return f"{d:.2g} days ({seconds(d * 86400)})"


def gb(b: float) -> str:
    """Decimal gigabytes, labelled (the planner's unit for memory per GPU)."""
    return f"{b / 1e9:,.1f} GB"


def pack(fields: list[str], width: int, indent: str = "  ", sep: str = " · ") -> list[str]:
    """Fields joined by ``sep`` into lines of at most ``width`` characters, a field never split across lines
    (one longer than a line stands alone)."""
    lines: list[str] = []
    cur = ""
    for f in fields:
        cand = f"{cur}{sep}{f}" if cur else f"{indent}{f}"
        if cur and len(cand) > width:
            lines.append(cur)
            cand = f"{indent}{f}"
        cur = cand
    if cur:
        lines.append(cur)
    return lines


def wrap(text: str, width: int, indent: str = "  ", hang: str | None = None) -> list[str]:
    """A sentence wrapped at word boundaries to ``width``, the first line indented by ``indent`` and the rest by
    ``hang`` (default: two more spaces); a word longer than the line (a layout string) is kept whole."""
    import textwrap

    return textwrap.wrap(text, width=max(width, 20), initial_indent=indent,
                         subsequent_indent=indent + "  " if hang is None else hang,
                         break_long_words=False, break_on_hyphens=False) or [indent]


def size(b: float) -> str:
    """Decimal bytes, short (3.2 MB, 41.8 GB, 1.2 TB): for a sentence where GiB beside it would be noise."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= div:
            return f"{b / div:,.1f} {unit}"
    return f"{b:,.0f} B"


def duration_text(seconds: float | None) -> str:
    """3725 -> '1h02m05s', 65 -> '1m05s', 4.2 -> '4s'; None -> '?'."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def short_source(src: str) -> str:
    """A citation for a table cell: the first clause, without long parenthetical figure lists."""
    first = src.split(";")[0]
    return re.sub(r" \([^)]{40,}\)", "", first)
