"""Run several layouts one after another in one torchrun job (one process start for many runs);
rank 0 writes {item: {losses, local_params, seconds}} as JSON. An item is a layout, or a layout with a prefix:

- ``gpt:LAYOUT`` runs the GPT-style variant of the config's model (test_runtime_parallel_parity.py);
- ``state:LAYOUT`` also records every rank's bytes of parameters, gradients and optimizer state, read from the
  tensors after the first optimizer step (runtime/probe/compare.state_bytes), as ``state`` [rank 0, 1, ...];
- ``save:LAYOUT`` trains the first ``--save-at`` steps (of a ``--steps`` schedule) and checkpoints there, into
  CKPT/LAYOUT (CKPT: ``ckpt`` beside the result file); ``resume:SRC>LAYOUT`` resumes a copy of CKPT/SRC under
  LAYOUT and trains to ``--steps``: its losses are those of the steps after the checkpoint
  (test_runtime_parallel_zero1.py)."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from trainscale.runtime.config import load_config
from trainscale.runtime.parallel.mesh import exit_rank, init_distributed
from trainscale.runtime.train import RunResult, Trainer, train
from trainscale.specs import Layout

# The GPT family: LayerNorm with bias, GELU MLP, learned positions, biases everywhere.
GPT = {"name": "tiny-gpt", "mlp": "gelu", "norm": "layernorm", "positions": "learned", "bias": True}


def _with_state(cfg, layout: str) -> tuple[RunResult, list]:
    """Train under ``layout``, reading every rank's state bytes after the first optimizer step."""
    from trainscale.runtime.probe.compare import state_bytes

    trainer = Trainer(cfg, Layout.parse(layout), log=lambda _m: None)
    got: dict = {}
    trainer.after_update = lambda t: got.setdefault("state", state_bytes(t))
    res = trainer.run()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, got["state"])
    return res, every


def _checkpointed(args, item: str) -> RunResult:
    kind, rest = item.split(":", 1)
    root = Path(args.result).parent / "ckpt"
    if kind == "save":
        layout, folder = rest, root / rest
    else:
        src, layout = rest.split(">")
        folder = root / rest
        if dist.get_rank() == 0:
            shutil.copytree(root / src, folder)
        dist.barrier()
    cfg = load_config(args.config, {"train": {"steps": args.steps},
                                    "checkpoint": {"every_steps": args.save_at, "dir": str(folder)}})
    if kind == "save":
        return train(cfg, layout, steps=args.save_at, log=lambda _m: None)
    return train(cfg, layout, log=lambda _m: None, resume=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layouts", required=True, help="';'-separated layout strings (see the module docstring)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save-at", type=int, default=0, help="the step save: items checkpoint at")
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    init_distributed()  # the process group the items share (a resume's copy waits for rank 0 on it)
    cfg = load_config(args.config, {"train": {"steps": args.steps}})
    gpt = load_config(args.config, {"train": {"steps": args.steps}, "model": GPT})
    out: dict[str, object] = {}
    for item in args.layouts.split(";"):
        t0 = time.perf_counter()
        extra: dict[str, object] = {}
        if item.startswith(("save:", "resume:")):
            res = _checkpointed(args, item)
        elif item.startswith("state:"):
            res, extra["state"] = _with_state(cfg, item[6:])
        else:
            config, layout = (gpt, item[4:]) if item.startswith("gpt:") else (cfg, item)
            res = train(config, layout, log=lambda _m: None)
        out[item] = {"losses": res.losses, "seconds": time.perf_counter() - t0, "local_params": res.local_params,
                     **extra}
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # the job is done; no finalization with many layouts' gloo groups alive (mesh.exit_rank)
