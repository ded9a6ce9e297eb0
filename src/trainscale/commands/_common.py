"""What every sub-command shares: the console, JSON output, short citations."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from rich.console import Console

console = Console()


def short_source(src: str) -> str:
    """A citation for a table cell: the first clause, without long parenthetical figure lists."""
    first = src.split(";")[0]
    return re.sub(r" \([^)]{40,}\)", "", first)


def emit_json(obj: Any) -> None:
    """Machine output: one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
