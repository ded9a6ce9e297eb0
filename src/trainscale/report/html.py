"""One self-contained HTML page: every figure as an <img> of the PNG beside it (SVG linked), with
its caption and the numbers it shows as a table. No scripts, no external assets."""

from __future__ import annotations

import html
from pathlib import Path

from trainscale.report.plots import Plot

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
"""


def _table(rows: list[tuple[str, str]], header: tuple[str, str] = ("quantity", "value")) -> str:
    if not rows:
        return ""
    body = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>" for a, b in rows)
    return f"<table><tr><th>{header[0]}</th><th>{header[1]}</th></tr>{body}</table>"


def write_page(out: Path, title: str, intro: str, sections: list[tuple[str, list[Plot]]],
               summary: list[tuple[str, str]]) -> Path:
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<link rel='icon' href='data:,'>", f"<style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1><p>{html.escape(intro)}</p>", _table(summary)]
    for name, plots in sections:
        parts.append(f"<h2>{html.escape(name)}</h2>")
        for p in plots:
            png = next(f for f in p.files if f.endswith(".png"))
            svg = [f for f in p.files if f.endswith(".svg")]
            link = f" (<a href='{svg[0]}'>SVG</a>)" if svg else ""
            parts.append(f"<figure id='{p.key}'><img src='{png}' alt='{html.escape(p.title)}'>"
                         f"<figcaption><b>{html.escape(p.title)}</b>. {html.escape(p.caption)}{link}</figcaption>"
                         f"{_table(p.table)}</figure>")
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts), encoding="utf-8")
    return page
