"""RUN/metrics.jsonl, read: the one reader of a run's metric rows (the console follower, goodput, the report).

A row is one JSON object a line. The writer appends whole lines; a kill can cut the last one short, so a reader
takes only complete, parseable lines and says where it stopped, and a follower calls again from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import check_regular

METRICS = "metrics.jsonl"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


def read_rows(path: str | Path, offset: int = 0, strict: bool = False) -> tuple[list[dict[str, Any]], int]:
    """-> (the rows of the complete lines from byte ``offset``, the byte offset after the last complete line).

    A missing file is no rows (``offset`` back); a file shorter than ``offset`` was started anew (a fresh run
    truncated an old run's file) and is read from its start. A line that is not a JSON object is skipped, or with
    ``strict`` refused in one sentence unless it is the last line (the one a kill cuts short)."""
    path = Path(path)
    if not path.exists():
        return [], offset
    check_regular(path, "metrics file")
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < offset:
            offset = 0
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    lines = chunk[:end].splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif strict and (i < len(lines) - 1 or end < len(chunk)):
            raise TrainscaleError(f"{path} has a line that is not a JSON object (line {i + 1} from byte {offset})")
    return rows, offset + end


def run_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of a run folder's metrics.jsonl (one sentence if the folder has none)."""
    path = metrics_path(run_dir)
    if not path.exists():
        raise TrainscaleError(f"{run_dir} has no {METRICS}; is it a trainscale run folder?")
    return read_rows(path, strict=True)[0]
