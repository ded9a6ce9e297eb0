"""One torchrun job that trains configs/tiny.toml for a few steps under several layouts in sequence, each into its
own run folder OUT/<item> with save_final on and a checkpoint at the last step (tests/test_infer_from_checkpoint.py
compares the model resharded from that checkpoint with final/). An item is a layout, or ``moe:LAYOUT`` for
configs/moe-tiny.toml (expert parallelism needs experts)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from trainscale.runtime.config import load_config
from trainscale.runtime.parallel.mesh import exit_rank, init_distributed
from trainscale.runtime.train import train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--moe-config", default="configs/moe-tiny.toml")
    ap.add_argument("--layouts", required=True, help="';'-separated layout strings")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed()
    for item in args.layouts.split(";"):
        config, layout = (args.moe_config, item[4:]) if item.startswith("moe:") else (args.config, item)
        cfg = load_config(config, {"train": {"steps": args.steps}, "run": {"save_final": True,
                                                                               "eval_sequences": 0},
                                        "checkpoint": {"every_steps": args.steps}})
        train(cfg, layout, out=Path(args.out) / item, log=lambda _m: None)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # no interpreter finalization with gloo groups alive (runtime/parallel/mesh.exit_rank)
