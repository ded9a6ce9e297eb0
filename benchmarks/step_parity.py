"""Pin every output of the planner's step model over a fixed, diverse set of layouts, to refactor it safely.

    PYTHONPATH=src .venv/bin/python benchmarks/step_parity.py record /tmp/step_before.npz
    ... change estimate/planner/ ...
    PYTHONPATH=src .venv/bin/python benchmarks/step_parity.py compare /tmp/step_before.npz [--rtol 0]

``record`` builds each problem below (dense Llama 3.1 8B/70B/405B, GPT-3 175B with its tied embeddings, GELU MLP
and learned positions, Mixtral 8x7B and DeepSeek-V3 with expert parallelism; H100, H800, A100 (no FP8), B200 and
GB200 NVL72; every software preset of catalog/software.toml), enumerates the planner's candidate layouts under the
permissive ``trainscale`` preset (every schedule, recompute mode and ZeRO stage), adds copies without sequence
parallelism and with hybrid sharding (hsdp2), keeps at most ``--rows`` of them (a fixed random draw), and stores
those layouts and every array ``step.evaluate`` returns for them. ``compare`` evaluates the stored layouts again
and reports every array that moved: exactly (the default) or beyond ``--rtol``.

A benchmark script, not a test: it pins the numbers of one moment, which a change to the model itself (a new
term, a catalog constant) rightly moves; record before a refactor, compare after it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from trainscale.estimate.planner import plan, step

# (model, gpu, gpus, seq, global batch tokens, cluster or None, software presets evaluated)
ALL_SOFTWARE = ("megatron-lm-2021", "megatron-core", "megatron-deepspeed", "meta-llama3", "torchtitan",
                "torchtitan-2024-04", "torchtitan-compile", "llm-foundry", "llm-foundry-triton", "metaseq",
                "trainscale", "deepseek-v3")
PROBLEMS: tuple[tuple[str, str, int, int, int, str | None, tuple[str, ...]], ...] = (
    ("llama3.1-8b", "h100-sxm", 8, 8192, 2**21, None, ALL_SOFTWARE),
    ("llama3.1-8b", "h100-sxm", 64, 8192, 2**22, None, ("trainscale", "megatron-core", "meta-llama3")),
    ("llama3.1-8b", "a100-sxm-80gb", 32, 4096, 2**21, None, ("megatron-lm-2021", "trainscale")),
    ("llama3.1-70b", "h100-sxm", 256, 8192, 2**23, None, ("trainscale", "megatron-core", "torchtitan",
                                                         "megatron-deepspeed")),
    ("llama3.1-70b", "b200", 512, 32768, 2**24, None, ("trainscale", "meta-llama3")),
    ("llama3.1-405b", "h100-sxm", 16384, 8192, 2**24, "meta-h100", ("meta-llama3", "trainscale")),
    ("llama3.1-405b", "h100-sxm", 2048, 131072, 2**24, None, ("trainscale", "megatron-core")),
    ("gpt3-175b", "a100-sxm-80gb", 1024, 2048, 3_145_728, None, ("megatron-lm-2021", "metaseq")),
    ("mixtral-8x7b", "h100-sxm", 64, 4096, 2**22, None, ("trainscale", "megatron-core", "deepseek-v3")),
    ("mixtral-8x7b", "gb200", 72, 8192, 2**22, "gb200-nvl72", ("trainscale", "torchtitan")),
    ("deepseek-v3", "h800", 2048, 4096, 15_728_640, "deepseek-h800", ("deepseek-v3", "megatron-core",
                                                                     "trainscale")),
    ("deepseek-v3", "h100-sxm", 256, 4096, 2**22, None, ("trainscale", "deepseek-v3")),
)


def layouts(p: plan.Problem, rows: int, seed: int) -> dict[str, np.ndarray]:
    """The planner's candidates, plus copies without sequence parallelism and with hsdp2, at most ``rows``."""
    cfg, _ = p.enumerate()
    nosp = {**cfg, "sp": np.zeros_like(cfg["sp"])}
    ok = (cfg["zero"] >= 1) & ((cfg["dp"] // cfg["ep"]) % 2 == 0)
    hsdp = {k: a[ok] for k, a in cfg.items()}
    hsdp["hsdp"] = np.full_like(hsdp["hsdp"], 2)
    out = {k: np.concatenate([cfg[k], nosp[k], hsdp[k]]) for k in cfg}
    n = out["tp"].size
    if n > rows:
        pick = np.sort(np.random.default_rng(seed).choice(n, rows, replace=False))
        out = {k: a[pick] for k, a in out.items()}
    return out


def problem(i: int, software: str) -> plan.Problem:
    model, gpu, gpus, seq, batch, cluster, _ = PROBLEMS[i]
    return plan.problem(model=model, gpu=gpu, gpus=gpus, seq=seq, global_batch_tokens=batch, cluster=cluster,
                        software=software)


def evaluate(p: plan.Problem, cfg: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return step.evaluate(p.model, p.gpu, p.topo, p.eff, p.seq, p.global_seqs, cfg, p.software)


def cases() -> list[tuple[str, int, str]]:
    return [(f"{i}/{sw}", i, sw) for i, pr in enumerate(PROBLEMS) for sw in pr[6]]


def record(path: str, rows: int) -> None:
    store: dict[str, Any] = {}
    n_rows = 0
    for i in range(len(PROBLEMS)):
        cfg = layouts(problem(i, "trainscale"), rows, seed=i)
        for k, a in cfg.items():
            store[f"cfg:{i}:{k}"] = a
        n_rows += cfg["tp"].size * len(PROBLEMS[i][6])
    for name, i, sw in cases():
        cfg = {k.split(":")[2]: a for k, a in store.items() if k.startswith(f"cfg:{i}:")}
        for k, a in evaluate(problem(i, sw), cfg).items():
            store[f"out:{name}:{k}"] = np.asarray(a)
    np.savez_compressed(path, **store)
    print(f"recorded {len(cases())} (problem, software) cases, {n_rows:,} layouts evaluated, "
          f"{sum(1 for k in store if k.startswith('out:')):,} arrays -> {path}")


def compare(path: str, rtol: float) -> int:
    old = np.load(path)
    bad, arrays, worst = [], 0, 0.0
    for name, i, sw in cases():
        cfg = {k.split(":")[2]: old[k] for k in old.files if k.startswith(f"cfg:{i}:")}
        new = {k: np.asarray(a) for k, a in evaluate(problem(i, sw), cfg).items()}
        keys_old = {k.split(":", 2)[2] for k in old.files if k.startswith(f"out:{name}:")}
        if keys_old != set(new):
            bad.append(f"{name}: outputs differ: lost {sorted(keys_old - set(new))}, new {sorted(set(new) - keys_old)}")
        for k in sorted(keys_old & set(new)):
            a, b = old[f"out:{name}:{k}"], new[k]
            arrays += 1
            if a.shape != b.shape or a.dtype.kind != b.dtype.kind:
                bad.append(f"{name} {k}: shape/dtype {a.shape} {a.dtype} -> {b.shape} {b.dtype}")
                continue
            if a.dtype.kind in "biu":
                if not np.array_equal(a, b):
                    bad.append(f"{name} {k}: {int((a != b).sum())} entries differ")
                continue
            rel = np.abs(a - b) / np.maximum(np.abs(a), np.finfo(float).tiny)
            rel = np.where(a == b, 0.0, rel)  # equal infinities
            worst = max(worst, float(rel.max(initial=0.0)))
            if (rel > rtol).any():
                bad.append(f"{name} {k}: {int((rel > rtol).sum())} entries differ, worst relative {rel.max():.3g}")
    print(f"compared {arrays:,} arrays over {len(cases())} cases; worst relative difference {worst:.3g}")
    for line in bad:
        print("  MOVED", line)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("record", "compare"))
    ap.add_argument("path")
    ap.add_argument("--rows", type=int, default=6000, help="layouts per problem at most")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of compare (0: exact)")
    a = ap.parse_args()
    if a.action == "record":
        record(a.path, a.rows)
    else:
        sys.exit(compare(a.path, a.rtol))


if __name__ == "__main__":
    main()
