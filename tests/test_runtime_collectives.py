"""Every collective in runtime/ takes its tensor on the group's device: NCCL refuses host tensors where gloo (every
CPU test) accepts them, so the check reads the code. A tensor made in a function by a factory without ``device=``
(``torch.zeros/ones/empty/full/tensor/as_tensor/arange``), or brought to the host (``.cpu()``, ``.to("cpu")``), and
then handed to a ``torch.distributed`` collective in that function is a crash on the first multi-GPU run. The check
finds the two such sites the code had (``CheckpointManager.poll``, the MoE step metrics) and none today."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from trainscale.runtime.collectives import group_device, reduce_host

RUNTIME = Path(__file__).resolve().parents[1] / "src" / "trainscale" / "runtime"
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand", "randint"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv", "reduce"}


def _host_made(value: ast.expr) -> bool:
    """A tensor this expression makes on the host: a factory without device=, or .cpu() / .to('cpu')."""
    if not isinstance(value, ast.Call):
        return False
    f = value.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES:
        return not any(k.arg == "device" for k in value.keywords)
    if isinstance(f, ast.Attribute) and f.attr == "cpu":
        return True
    if isinstance(f, ast.Attribute) and f.attr == "to" and value.args:
        a = value.args[0]
        return isinstance(a, ast.Constant) and a.value == "cpu"
    return False


def host_collectives(source: str, where: str = "<source>") -> list[str]:
    """``where:line name`` for each collective handed a tensor that its function made on the host."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        host: dict[str, bool] = {}
        for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign | ast.AugAssign | ast.Call)),
                           key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        host[t.id] = _host_made(node.value)
            elif isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "dist"
                        and f.attr in COLLECTIVES):
                    for a in node.args[:2]:
                        if (isinstance(a, ast.Name) and host.get(a.id)) or _host_made(a):
                            found.append(f"{where}:{node.lineno} {f.attr}({ast.unparse(a)})")
    return found


def test_no_collective_in_runtime_takes_a_host_tensor():
    found = []
    for p in sorted(RUNTIME.rglob("*.py")):
        found += host_collectives(p.read_text(), str(p.relative_to(RUNTIME)))
    assert found == []


def test_the_check_finds_the_two_sites_it_was_written_for():
    poll = '''
def poll(self):
    done = torch.tensor([1 if self.pending[2].done() else 0])
    if dist.is_initialized():
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
'''
    moe = '''
def metrics(parts, spec):
    counts = torch.zeros(spec.n_layers, spec.n_experts, dtype=torch.float64)
    a2a = torch.tensor([0.0, 0.0], dtype=torch.float64)
    ok = torch.zeros(2, device=dev)
    dist.all_reduce(counts)
    dist.all_reduce(a2a, op=dist.ReduceOp.MAX)
    dist.all_reduce(ok)
    dist.broadcast(x.cpu(), 0)
'''
    assert host_collectives(poll) == ["<source>:5 all_reduce(done)"]
    assert host_collectives(moe) == ["<source>:6 all_reduce(counts)", "<source>:7 all_reduce(a2a)",
                                     "<source>:9 broadcast(x.cpu())"]


def test_reduce_host_without_a_group_is_the_values():
    assert group_device() == torch.device("cpu")
    assert reduce_host([1.5, 2]).tolist() == [1.5, 2.0]
