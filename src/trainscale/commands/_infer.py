"""What the infer sub-commands (generate, quantize, lora, export) share: tables of measured vs predicted."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from trainscale.commands._common import console


def exact_bytes(b: float) -> str:
    return f"{int(b):,} B"


def check_table(title: str, rows: list[tuple[str, float, float]]) -> Table:
    """Rows of (what, measured bytes/count, predicted): the estimator against the real object."""
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("what")
    t.add_column("measured", justify="right")
    t.add_column("estimator", justify="right")
    t.add_column("equal")
    for what, measured, predicted in rows:
        fmt = exact_bytes if "bytes" in what else (lambda v: f"{int(v):,}")
        t.add_row(what, fmt(measured), fmt(predicted), "yes" if measured == predicted else "[red]no[/red]")
    return t


def kv_table(rows: dict[str, Any]) -> Table:
    t = Table(show_header=False, show_edge=False, pad_edge=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    for k, v in rows.items():
        t.add_row(k, v if isinstance(v, str) else f"{v:,}" if isinstance(v, int) else f"{v:.4g}")
    return t


def print_tables(*tables: Table) -> None:
    for t in tables:
        console.print(t)
