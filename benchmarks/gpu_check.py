"""The pieces of ``benchmarks/gpu_check.sh``: what a GPU machine really does, next to what trainscale predicts.

    gpu_check.py nccl  [--cpu-smoke]             under torchrun, one rank per GPU: bus bandwidth of
                                                 all-reduce, all-gather, reduce-scatter (NCCL-tests'
                                                 convention: algorithm bandwidth x estimate/machine.bus_factor)
    gpu_check.py model [--compile] [--cpu-smoke] one process: a ~1.1B-parameter Llama trained in bf16 by the
                                                 Trainer; tokens/s, MFU against the GPU's datasheet bf16
                                                 peak (catalog), peak memory against the prediction
                                                 ``train --compare-plan`` prints (estimate/measured/rank.py: state
                                                 bytes + saved activations at bf16)
    gpu_check.py summary --dir D                 the figures of the runs above as one Markdown table

``--cpu-smoke`` runs the same code on CPU with tiny sizes (gloo, the tiny model), to check the script itself.
Every figure is printed, and each run writes a JSON file into ``--dir`` (default runs/gpu_check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ~1.1B parameters, Llama-3.2-1B's shape with a 32k vocabulary: 16 x (10.5M attention + 50.3M MLP) + 2 x 65.5M
BIG = {"name": "llama-1.1b-check", "n_layers": 16, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192,
       "vocab_size": 32000, "max_seq_len": 2048, "rope_theta": 500000.0}
TINY = {"name": "tiny-check", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 192,
        "vocab_size": 512, "max_seq_len": 64}


# ----------------------------------------------------------------------------- collectives


def nccl(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainscale.estimate.measured.machine import bus_factor
    from trainscale.runtime.parallel.mesh import init_distributed

    dev = init_distributed()
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [1 << 20, 16 << 20] if args.cpu_smoke else [64 << 20, 256 << 20, 1 << 30]
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes in sizes:
            numel = nbytes // 2  # bf16
            big = torch.ones(numel, dtype=torch.bfloat16, device=dev)
            small = torch.ones(numel // n, dtype=torch.bfloat16, device=dev)

            def run(op: str = op, big: torch.Tensor = big, small: torch.Tensor = small) -> None:
                if op == "all_reduce":
                    dist.all_reduce(big)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(big, small)
                else:
                    dist.reduce_scatter_tensor(small, big)

            for _ in range(3):
                run()
            sync(dev)
            times = []
            for _ in range(5 if args.cpu_smoke else 20):
                dist.barrier()
                sync(dev)
                t0 = time.perf_counter()
                run()
                sync(dev)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            rows.append({"op": op, "bytes": nbytes, "ranks": n, "seconds": t, "algbw": nbytes / t,
                         "busbw": nbytes / t * bus_factor(op, n)})
    if rank == 0:
        print(f"{n} ranks, backend {dist.get_backend()}, bf16 buffers, median of timed runs")
        print("| collective | buffer | time | algorithm bandwidth | bus bandwidth |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['op']} | {r['bytes'] / 2**20:,.0f} MiB | {r['seconds'] * 1e3:.2f} ms | "
                  f"{r['algbw'] / 1e9:.1f} GB/s | {r['busbw'] / 1e9:.1f} GB/s |")
        write(args, "nccl.json", {"backend": dist.get_backend(), "rows": rows})
    dist.destroy_process_group()


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ----------------------------------------------------------------------------- one GPU, one model


def model(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainscale.estimate.measured import rank as R
    from trainscale.estimate.params import param_count
    from trainscale.runtime.config import config_from_dict
    from trainscale.runtime.measure import FLOP_CONVENTION, FLOP_CONVENTION_NAME
    from trainscale.runtime.train import Trainer
    from trainscale.specs import Layout

    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here (use --cpu-smoke to check the script on CPU)")
    smoke = args.cpu_smoke
    seq, batch = (32, 4) if smoke else (args.seq_len, args.batch)
    cfg = config_from_dict({
        "name": "gpu-check", "model": TINY if smoke else BIG,
        "train": {"steps": args.steps + args.warmup, "seq_len": seq, "global_batch": batch, "lr": 3e-4, "warmup": 2,
                  "precision": "bf16", "compile": args.compile},
        "data": {"max_chars": 200_000 if smoke else 3_000_000, "tokenizer_vocab": 512 if smoke else 8192},
        "run": {"eval_sequences": 0, "save_final": False}}, "gpu_check")
    layout = Layout.parse(args.layout)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, layout, out=None, log=lambda m: print(m, flush=True))
    setup = time.perf_counter() - t0
    dev = trainer.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    rows = []
    for i in range(args.steps + args.warmup):
        row = trainer.train_step()
        rows.append(row)
        print(f"step {i + 1}: loss {row['loss']:.3f}, {row['step_time_s'] * 1e3:,.0f} ms, "
              f"{row['tokens_per_s']:,.0f} tok/s, MFU {row['mfu']:.1%} ({FLOP_CONVENTION_NAME})", flush=True)
    timed = rows[args.warmup:]
    step = statistics.median(r["step_time_s"] for r in timed)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    tps = tokens / step
    peak_mem = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else timed[-1]["memory_bytes"]
    mb = layout.mb
    state = R.rank_state_bytes(cfg.model, layout, 0).as_dict()["total"]
    acts = sum(R.stage_saved_bytes(cfg.model, mb, seq, layout, s, e=2).total
               for s in R.local_stage_ids(layout, 0))
    predicted = state + acts
    info = {"model": cfg.model.name, "params": param_count(cfg.model), "layout": str(layout), "compile": args.compile,
            "precision": trainer.precision, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "tokens_per_step": tokens, "setup_s": setup, "first_step_s": rows[0]["step_time_s"],
            "median_step_s": step, "tokens_per_s": tps, "mfu": trainer.flops_per_token * tps / trainer.peak,
            "peak_flops": trainer.peak, "peak_source": trainer.peak_source, "flops_per_token": trainer.flops_per_token,
            "flop_convention": FLOP_CONVENTION,
            "peak_memory_bytes": peak_mem, "predicted_state_bytes": state, "predicted_activation_bytes": acts,
            "predicted_memory_bytes": predicted, "final_loss": rows[-1]["loss"]}
    print(f"{info['model']} ({info['params'] / 1e6:,.1f}M params) on {info['device']}, {info['precision']}, "
          f"compile={args.compile}: {tps:,.0f} tokens/s, step {step * 1e3:,.1f} ms (median of {len(timed)}), "
          f"first step {rows[0]['step_time_s']:.1f} s, MFU {info['mfu']:.1%} of {info['peak_source']} "
          f"(FLOPs per token: {info['flop_convention']})")
    print(f"peak memory {peak_mem / 2**30:.2f} GiB measured vs {predicted / 2**30:.2f} GiB predicted "
          f"(state {state / 2**30:.2f} + saved activations {acts / 2**30:.2f}; estimate/measured/rank.py, as train "
          f"--compare-plan): {peak_mem / predicted - 1:+.1%}")
    write(args, f"model{'-compile' if args.compile else ''}.json", info)
    dist.destroy_process_group()


def write(args: argparse.Namespace, name: str, data: dict) -> None:
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(data, indent=2))


def summary(args: argparse.Namespace) -> None:
    d = Path(args.dir)
    runs = [json.loads((d / f).read_text()) for f in ("model.json", "model-compile.json") if (d / f).exists()]
    if runs:
        print(f"\n{runs[0]['model']}, {runs[0]['params'] / 1e6:,.1f}M params, {runs[0]['device']}, "
              f"{runs[0]['precision']}, {runs[0]['tokens_per_step']:,} tokens/step")
        print("| run | first step | median step | tokens/s | MFU | peak memory | predicted | error |")
        print("|---|---|---|---|---|---|---|---|")
        for r in runs:
            print(f"| {'compiled' if r['compile'] else 'eager'} | {r['first_step_s']:.1f} s | "
                  f"{r['median_step_s'] * 1e3:,.1f} ms | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                  f"{r['peak_memory_bytes'] / 2**30:.2f} GiB | {r['predicted_memory_bytes'] / 2**30:.2f} GiB | "
                  f"{r['peak_memory_bytes'] / r['predicted_memory_bytes'] - 1:+.1%} |")
        if len(runs) == 2:
            print(f"compile: {runs[0]['median_step_s'] / runs[1]['median_step_s']:.2f}x step time, "
                  f"{runs[1]['first_step_s'] - runs[0]['first_step_s']:.1f} s compiling")
    if (d / "nccl.json").exists():
        n = json.loads((d / "nccl.json").read_text())
        best = {}
        for r in n["rows"]:
            best[r["op"]] = max(best.get(r["op"], 0.0), r["busbw"])
        print(f"bus bandwidth ({n['rows'][0]['ranks']} ranks, {n['backend']}, best size): "
              + ", ".join(f"{op} {bw / 1e9:.1f} GB/s" for op, bw in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("nccl", "model", "summary"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: check the script, not the machine")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 15; 3 with --cpu-smoke)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--layout", default="", help="default: one process, no parallelism")
    ap.add_argument("--dir", default=str(ROOT / "runs" / "gpu_check"))
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 3 if args.cpu_smoke else 15
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    {"nccl": nccl, "model": model, "summary": summary}[args.what](args)


if __name__ == "__main__":
    main()
