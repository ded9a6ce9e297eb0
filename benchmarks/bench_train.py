"""Framework overhead of the training runtime, and the MFU it reaches on this CPU.

For each config (tiny, small): single-process tokens/s of ``trainscale``'s Trainer (mesh, loader,
layout machinery, global-norm clipping, loss averaging, metrics) against a plain hand-written PyTorch
loop over the same model, the same batches and the same optimizer (AdamW + clip_grad_norm_). The two
run alternately, step by step, in one process, so machine noise hits both alike; the ratio is of the
median step times after warm-up. MFU = tokens/s x (6N + 6LHQT: runtime/measure.py) / the CPU's measured matmul peak.

    .venv/bin/python benchmarks/bench_train.py [--steps 30] [--configs tiny,small,medium] [--json out.json]
    .venv/bin/python benchmarks/bench_train.py --profile small   # where the Trainer's extra time goes

``--profile`` runs a few steps of each under torch.profiler and lists the operators whose self CPU time
differs most between the two (the Trainer's overhead, op by op).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from trainscale.runtime import measure
from trainscale.runtime.config import load_config
from trainscale.runtime.model import build_model, lm_loss
from trainscale.runtime.train import Trainer, lr_at
from trainscale.specs import Layout

ROOT = Path(__file__).resolve().parents[1]


def plain_loop(cfg, loader):
    """The same model and recipe, written the way one would by hand."""
    model = build_model(cfg.model, "cpu", seed=cfg.train.seed)
    t = cfg.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=t.betas, eps=1e-8)
    step = 0

    def run() -> float:
        nonlocal step
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = loader.next_batch()
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        step += 1
        return time.perf_counter() - t0

    return run


def paired_loops(name: str, steps: int):
    """The config ``name``, a Trainer on it and the plain loop on the same data: like with like."""
    from trainscale.runtime.data.loader import TokenLoader

    cfg = load_config(ROOT / "configs" / f"{name}.toml", {"train": {"steps": steps}})
    # the whole batch in one micro-batch, as the plain loop runs it (a layout without mbN means mb1: gradient
    # accumulation over single sequences, a different computation with smaller matmuls)
    trainer = Trainer(cfg, Layout(mb=cfg.train.global_batch), out=None, log=lambda _m: None)
    loader = TokenLoader(trainer.corpus.tokens("train"), cfg.train.seq_len, cfg.train.global_batch, seed=cfg.train.seed)
    return cfg, trainer, plain_loop(cfg, loader)


def bench(name: str, steps: int, warmup: int = 3) -> dict:
    cfg, trainer, plain = paired_loops(name, steps + warmup)
    ours, hand = [], []
    for i in range(steps + warmup):
        if i % 2:  # alternate which loop goes first, so neither always follows the other's cache state
            b = plain()
            a = trainer.train_step()["step_time_s"]
        else:
            a = trainer.train_step()["step_time_s"]
            b = plain()
        if i >= warmup:
            ours.append(a)
            hand.append(b)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    t_ours, t_hand = statistics.median(ours), statistics.median(hand)
    # the ratio of each step pair (taken seconds apart) cancels load that drifts over minutes, which the
    # ratio of the two medians does not; its quartiles say how far one pair can be trusted
    pair = sorted(x / y for x, y in zip(ours, hand, strict=True))
    q1, q3 = statistics.quantiles(pair, n=4)[0], statistics.quantiles(pair, n=4)[2]
    fpt = measure.flops_per_token(cfg.model, cfg.train.seq_len)
    return {"config": name, "params": sum(p.numel() for p in trainer.params), "tokens_per_step": tokens,
            "trainscale_tokens_per_s": tokens / t_ours, "plain_tokens_per_s": tokens / t_hand,
            "overhead_ratio": t_ours / t_hand, "paired_ratio": statistics.median(pair), "paired_q1": q1,
            "paired_q3": q3, "flops_per_token": fpt,
            "trainscale_mfu": measure.mfu(tokens / t_ours, fpt, trainer.peak),
            "plain_mfu": measure.mfu(tokens / t_hand, fpt, trainer.peak), "steps": steps}


def profile(name: str, steps: int = 5) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _, trainer, plain = paired_loops(name, 2 * steps + 2)
    for _ in range(2):
        trainer.train_step()
        plain()
    totals = []
    for fn in (trainer.train_step, plain):
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        totals.append({e.key: e.self_cpu_time_total / steps for e in prof.key_averages()})
    ours, hand = totals
    keys = sorted(set(ours) | set(hand), key=lambda k: abs(ours.get(k, 0) - hand.get(k, 0)), reverse=True)
    print(f"{name}: self CPU time per step, trainscale {sum(ours.values()) / 1e3:,.1f} ms vs plain "
          f"{sum(hand.values()) / 1e3:,.1f} ms; largest differences:")
    print("| operator | trainscale ms/step | plain ms/step | difference |")
    print("|---|---|---|---|")
    for k in keys[:12]:
        a, b = ours.get(k, 0) / 1e3, hand.get(k, 0) / 1e3
        print(f"| {k} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--configs", default="tiny,small,medium")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="CONFIG", help="profile the Trainer against the plain loop")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile)
        return
    peak = measure.cpu_peak_flops(remeasure=True)  # the highest this machine has measured, now included
    os.environ["TRAINSCALE_CPU_PEAK"] = repr(peak)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {load:.1f} at the start; CPU fp32 matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s")
    print("| config | params | tokens/step | trainscale tok/s | plain loop tok/s | step time trainscale / plain "
          "| paired ratio, median [quartiles] | trainscale MFU | plain MFU |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in args.configs.split(","):  # each row as soon as it is measured
        r = bench(name, args.steps)
        rows.append(r)
        print(f"| {r['config']} | {r['params'] / 1e6:.2f}M | {r['tokens_per_step']:,} | "
              f"{r['trainscale_tokens_per_s']:,.0f} | {r['plain_tokens_per_s']:,.0f} | {r['overhead_ratio']:.3f} | "
              f"{r['paired_ratio']:.3f} [{r['paired_q1']:.3f}, {r['paired_q3']:.3f}] | "
              f"{r['trainscale_mfu']:.1%} | {r['plain_mfu']:.1%} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_flops": peak, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
