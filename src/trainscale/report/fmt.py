"""Humanising numbers at the edge: code keeps bytes, seconds and FLOPs; people read GB, days, MW."""

from __future__ import annotations


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
