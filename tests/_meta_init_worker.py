"""Build the model of a config under several layouts in one torchrun job, each on the meta device
(TRAINSCALE_META_INIT=1: ``Trainer._build_parts`` allocates this rank's shards only and initialises them), and
compare the gathered weights with the whole model built on the CPU by one process (tests/test_runtime_meta_init.py).

An item is a layout, ``tied:LAYOUT`` (the config's model with tied embeddings) or ``moe:LAYOUT`` (configs/moe-tiny.toml
beside the config: routed experts, EP's DTensors). Rank 0 writes, per item: whether
the meta path was taken, the names the two hold apart, the names whose tensors differ and the largest difference."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from trainscale.runtime.config import load_config
from trainscale.runtime.model import build_model
from trainscale.runtime.parallel.mesh import exit_rank
from trainscale.runtime.train import Trainer
from trainscale.specs import Layout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layouts", required=True, help="';'-separated items (see the module docstring)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    os.environ["TRAINSCALE_META_INIT"] = "1"
    out: dict[str, object] = {}
    for item in args.layouts.split(";"):
        kind, _, layout = item.rpartition(":")
        over = {"train": {"seed": args.seed}, **({"model": {"tied_embeddings": True}} if kind == "tied" else {})}
        cfg = load_config(Path(args.config).with_name("moe-tiny.toml") if kind == "moe" else args.config, over)
        trainer = Trainer(cfg, Layout.parse(layout), out=None, log=lambda _m: None)
        on_meta = trainer._on_meta()
        state = trainer.full_state_dict()
        if dist.get_rank() == 0:
            ref = dict(build_model(cfg.model, "cpu", seed=args.seed).named_parameters())
            common = set(state) & set(ref)
            out[item] = {
                "meta": on_meta,
                "apart": sorted(set(state) ^ set(ref)),
                "differ": sorted(n for n in common if not state[n].equal(ref[n].detach())),
                "max_diff": max((state[n] - ref[n].detach()).abs().max().item() for n in common)}
            with open(args.result, "w") as f:
                json.dump(out, f, indent=1)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # no finalization with many layouts' gloo groups alive (mesh.exit_rank)
