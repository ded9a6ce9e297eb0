"""The package's import graph: no circle, between modules or between folders, and no import that points up the
layers (DESIGN.md, "Layout"), the package's and, inside ``runtime/``, the runtime's own.

Every ``import``/``from ... import`` of a trainscale module is counted, those inside functions too: a
function-local import hides a circle from Python, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lower layers first; a module may import its own layer and the ones before it, never a later one.
LAYERS = [
    ("trainscale.errors", "trainscale.safeio", "trainscale.units"),
    ("trainscale.specs", "trainscale.hf", "trainscale.rules", "trainscale.placement"),
    ("trainscale.estimate",),
    ("trainscale.runtime",),
    ("trainscale.infer",),
    ("trainscale.report",),
    ("trainscale.commands", "trainscale.cli", "trainscale.__main__"),
]
# Inside estimate/, the bricks come before the two step-time models, which do not import each other's insides.
ESTIMATE = [("trainscale.estimate",), ("trainscale.estimate.planner", "trainscale.estimate.measured")]
# Inside runtime/, lowest first: the config is data (it reads no weights, opens no model folder), the
# weights are read by loaders above it (weights < hf_init, artifact < init), and the trainer sits on all of it.
RUNTIME = [
    ("trainscale.runtime.collectives",),  # the group's device: imports no runtime/
    ("trainscale.runtime.moe", "trainscale.runtime.schedule", "trainscale.runtime.weights"),  # only collectives
    # the transformer (its MoE layer from moe); the preference losses on its log-probs
    ("trainscale.runtime.model", "trainscale.runtime.preference"),
    ("trainscale.runtime.data",),  # the corpus pipeline (the loader knows the model's ignore index)
    ("trainscale.runtime.config", "trainscale.runtime.measure"),  # the TOML as data; hardware, FLOPs
    # on a built model: mesh, TP/CP/EP/FSDP, pipeline, zero1; the weight loaders (a model folder's format, HF folders)
    ("trainscale.runtime.parallel", "trainscale.runtime.artifact", "trainscale.runtime.hf_init"),
    ("trainscale.runtime.job",),  # the run folder, checkpoints, launch
    # the model folder a run or a checkpoint names (reads job's checkpoints); the held-out loss
    ("trainscale.runtime.find_model", "trainscale.runtime.evaluator"),
    ("trainscale.runtime.init",),  # [model] init resolved and loaded
    ("trainscale.runtime.train",),  # the trainer
    ("trainscale.runtime.probe",),  # probes that run the trainer
]


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


def folders(edges: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph with each module collapsed to its name's first ``depth`` parts: at depth 3 a folder such as
    ``trainscale.runtime.job`` is one node (all its modules together) beside ``trainscale.runtime.config``."""
    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        a = ".".join(m.split(".")[:depth])
        out.setdefault(a, set()).update(b for t in targets if (b := ".".join(t.split(".")[:depth])) != a)
    for targets in list(out.values()):
        for b in targets:
            out.setdefault(b, set())
    return out


def test_no_import_circle():
    assert cycles(graph()) == []


def test_no_import_circle_between_folders():
    """A circle through a folder (``config -> artifact -> job/ -> config``) is one even when no two modules
    import each other: each depth of folders is checked with its modules collapsed into it."""
    edges = graph()
    deepest = max(m.count(".") for m in edges) + 1
    assert {d: cycles(folders(edges, d)) for d in range(2, deepest + 1)} == {d: [] for d in range(2, deepest + 1)}


def test_the_folder_collapse_sees_a_circle_through_a_folder():
    edges = {"t.r.config": {"t.r.artifact"}, "t.r.artifact": {"t.r.job.checkpoint"}, "t.r.job.checkpoint": set(),
             "t.r.job.elastic": {"t.r.config"}}
    assert cycles(edges) == []
    assert cycles(folders(edges, 3)) == [["t.r.artifact", "t.r.config", "t.r.job"]]


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
    assert [m for m in modules() if m.startswith("trainscale.runtime.") and layer(m, RUNTIME) is None] == []


def test_no_import_points_up_inside_runtime():
    """The runtime's own layers (``RUNTIME``): config imports no loader of weights, no job or trainer module;
    nothing below the trainer imports it."""
    upward = []
    for m, targets in graph().items():
        for t in targets:
            if m.startswith("trainscale.runtime.") and t.startswith("trainscale.runtime."):
                lm, lt = layer(m, RUNTIME), layer(t, RUNTIME)
                if lm is not None and lt is not None and lt > lm:
                    upward.append(f"{m} -> {t}")
    assert upward == []


def test_config_reads_no_weights():
    """runtime/config.py parses the TOML as data: it imports neither the model-folder reader nor the Hugging
    Face loader (runtime/init.py resolves ``[model] init``), nor safetensors or torch."""
    tree = ast.parse((SRC / "trainscale" / "runtime" / "config.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "safetensors")}
    assert graph()["trainscale.runtime.config"] <= {"trainscale.rules", "trainscale.errors", "trainscale.specs",
                                                    "trainscale.safeio", "trainscale.runtime.data.shards",
                                                    "trainscale.runtime.data.sources"}


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
