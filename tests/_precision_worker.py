"""Train one config under several (precision, layout) pairs in one torchrun job (tests/test_runtime_precision.py).

An item is ``PRECISION:LAYOUT`` (e.g. ``bf16:fsdp2``). Rank 0 writes, per item, the losses, the dtype of
the logits the forward pass produces, and for FSDP layouts the bytes every all-gather and reduce-scatter of
the first step moved through this rank, counted in FSDP2's own communication hooks
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``) from the real buffers."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from trainscale.runtime.config import load_config
from trainscale.runtime.parallel.mesh import exit_rank
from trainscale.runtime.train import Trainer
from trainscale.specs import Layout


class Counts:
    def __init__(self) -> None:
        self.bytes = {"all_gather": 0, "reduce_scatter": 0}
        self.dtypes: dict[str, set[str]] = {"all_gather": set(), "reduce_scatter": set()}

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.dtypes[kind].add(str(t.dtype))


class CountingAllGather(DefaultAllGather):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counts.add("all_gather", output_tensor)  # the gathered (unsharded) parameters
        return super().__call__(output_tensor, input_tensor, group, async_op)


class CountingReduceScatter(DefaultReduceScatter):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counts.add("reduce_scatter", input_tensor)  # the unsharded gradients
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--items", required=True, help="';'-separated PRECISION:LAYOUT")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    out: dict[str, object] = {}
    for item in args.items.split(";"):
        precision, layout = item.split(":", 1)
        cfg = load_config(args.config, {"train": {"steps": args.steps, "precision": precision}})
        trainer = Trainer(cfg, Layout.parse(layout), out=None, log=lambda _m: None)
        counts = Counts()
        for _, part in trainer.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_all_gather(CountingAllGather(counts))
                    m.set_custom_reduce_scatter(CountingReduceScatter(counts))
        losses = trainer.run(1).losses
        first = {k: v for k, v in counts.bytes.items()}
        if trainer.layout.pp == 1:
            with torch.no_grad(), trainer.autocast:
                x = torch.zeros(1, cfg.train.seq_len // trainer.layout.cp, dtype=torch.long)
                logits_dtype = str(trainer.parts[0][1](x).dtype)
        else:
            logits_dtype = None
        losses += trainer.run(args.steps).losses
        out[item] = {"losses": losses, "bytes": first, "dtypes": {k: sorted(v) for k, v in counts.dtypes.items()},
                     "logits_dtype": logits_dtype, "precision": trainer.precision}
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # the job is done; no finalization with many layouts' gloo groups alive (mesh.exit_rank)
