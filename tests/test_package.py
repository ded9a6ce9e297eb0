"""The package's import graph: no circle, and no import that points up the layers (DESIGN.md, "Layout").

Every ``import``/``from ... import`` of a trainscale module is counted, those inside functions too: a
function-local import hides a circle from Python, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lower layers first; a module may import its own layer and the ones before it, never a later one.
LAYERS = [
    ("trainscale.errors", "trainscale.safeio"),
    ("trainscale.specs", "trainscale.hf", "trainscale.rules", "trainscale.placement"),
    ("trainscale.estimate",),
    ("trainscale.runtime",),
    ("trainscale.infer",),
    ("trainscale.report",),
    ("trainscale.commands", "trainscale.cli", "trainscale.__main__"),
]
# Inside estimate/, the bricks come before the two step-time models, which do not import each other's insides.
ESTIMATE = [("trainscale.estimate",), ("trainscale.estimate.planner", "trainscale.estimate.measured")]


def modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainscale"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges[m].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name.startswith("trainscale"))
    return {m: {t for t in ts if t in mods and t != m} for m, ts in edges.items()}


def layer(name: str, layers: list[tuple[str, ...]]) -> int | None:
    best = None
    for i, prefixes in enumerate(layers):
        for pre in prefixes:
            if name == pre or name.startswith(pre + "."):
                if best is None or len(pre) > best[1]:
                    best = (i, len(pre))
    return None if best is None else best[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_points_up():
    upward = []
    for m, targets in graph().items():
        for t in targets:
            lm, lt = layer(m, LAYERS), layer(t, LAYERS)
            if lm is not None and lt is not None and lt > lm:
                upward.append(f"{m} -> {t}")
            if m.startswith("trainscale.estimate") and t.startswith("trainscale.estimate"):
                em, et = layer(m, ESTIMATE), layer(t, ESTIMATE)
                if et > em or (em == et == 1 and m.split(".")[2] != t.split(".")[2]):
                    upward.append(f"{m} -> {t}")
    assert upward == []


def test_every_module_is_placed_in_a_layer():
    assert [m for m in modules() if m != "trainscale" and layer(m, LAYERS) is None] == []


def test_no_function_in_estimate_over_80_lines():
    """The planner and the rank model stay readable: each function one screen (issue 19: ``evaluate`` was 405)."""
    long = []
    for p in (SRC / "trainscale" / "estimate").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert long == []


def test_version_is_the_packages():
    """`trainscale --version` prints the version pyproject.toml declares (one source of truth for both)."""
    import subprocess
    import sys
    import tomllib

    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    import trainscale

    assert trainscale.__version__ == declared
    out = subprocess.run([sys.executable, "-m", "trainscale", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"trainscale {declared}", out
