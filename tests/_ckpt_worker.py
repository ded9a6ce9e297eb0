"""One torchrun job that trains configs/tiny.toml for a few steps under several layouts in sequence, each into its
own run folder OUT/<item>, with save_final on and a checkpoint every ``--every`` steps (the last one at the last
step): tests/test_infer_from_checkpoint.py compares the model resharded from a checkpoint with final/. An item is

- a layout;
- ``moe:LAYOUT``: configs/moe-tiny.toml instead (expert parallelism needs experts);
- ``init:SRC>LAYOUT``: one step under LAYOUT from ``[model] init = OUT/SRC/checkpoints/step-EVERY`` at a learning
  rate of 1e-30, far below fp32's resolution at these weights, so its final/ holds the weights it read, unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from trainscale.runtime.init import resolved_config
from trainscale.runtime.parallel.mesh import exit_rank, init_distributed
from trainscale.runtime.train import train


def _config(args, item: str):
    run = {"save_final": True, "eval_sequences": 0}
    if item.startswith("init:"):
        src, layout = item[5:].split(">")
        init = Path(args.out) / src / "checkpoints" / f"step-{args.every:08d}"
        return resolved_config(args.config, {"model": {"init": str(init)}, "run": run,
                                         "train": {"steps": 1, "lr": 1e-30, "warmup": 0}}), layout
    config, layout = (args.moe_config, item[4:]) if item.startswith("moe:") else (args.config, item)
    return resolved_config(config, {"train": {"steps": args.steps}, "run": run,
                                "checkpoint": {"every_steps": args.every}}), layout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--moe-config", default="configs/moe-tiny.toml")
    ap.add_argument("--layouts", required=True, help="';'-separated items (see the module docstring)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed()
    for item in args.layouts.split(";"):
        cfg, layout = _config(args, item)
        train(cfg, layout, out=Path(args.out) / item.replace(">", "-to-"), log=lambda _m: None)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # no interpreter finalization with gloo groups alive (runtime/parallel/mesh.exit_rank)
