"""Run several layouts one after another in one torchrun job (one process start for many runs);
rank 0 writes {layout: {losses, local_params, seconds}} as JSON; a
layout written ``gpt:LAYOUT`` runs the GPT-style variant of the config's model. Used by test_runtime_parity.py."""

from __future__ import annotations

import argparse
import json
import time

import torch.distributed as dist

from trainscale.runtime.config import load_config
from trainscale.runtime.parallel.mesh import exit_rank
from trainscale.runtime.train import train

# The GPT family: LayerNorm with bias, GELU MLP, learned positions, biases everywhere.
GPT = {"name": "tiny-gpt", "mlp": "gelu", "norm": "layernorm", "positions": "learned", "bias": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layouts", required=True, help="';'-separated layout strings")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    cfg = load_config(args.config, {"train": {"steps": args.steps}})
    gpt = load_config(args.config, {"train": {"steps": args.steps}, "model": GPT})
    out: dict[str, object] = {}
    for item in args.layouts.split(";"):
        t0 = time.perf_counter()
        config, layout = (gpt, item[4:]) if item.startswith("gpt:") else (cfg, item)
        res = train(config, layout, log=lambda _m: None)
        out[item] = {"losses": res.losses, "seconds": time.perf_counter() - t0, "local_params": res.local_params}
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # the job is done; no finalization with many layouts' gloo groups alive (mesh.exit_rank)
