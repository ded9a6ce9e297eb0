"""The gradient bytes one rank holds between its micro-batches (tests/test_runtime_fsdp_accumulation.py): run
under torchrun, trains ``--layout`` and, before every micro-batch's forward after the first, sums the bytes of
every parameter's gradient as the rank holds it (a sharded DTensor's local shard) and of FSDP2's unsharded
accumulation buffers (``FSDPParam.unsharded_accumulated_grad``: what ``set_requires_gradient_sync(False)`` keeps).
Writes RESULT.rankN.json: {"held": [bytes, ...], "local_params": bytes of the rank's parameter shards}."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def grad_bytes(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    held = 0
    for p in model.parameters():
        if p.grad is not None:
            g = getattr(p.grad, "_local_tensor", p.grad)
            held += g.numel() * g.element_size()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else []:
                acc = fp.unsharded_accumulated_grad
                held += 0 if acc is None else acc.numel() * acc.element_size()
    return held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    import torch.distributed as dist

    import trainscale.runtime.train as T
    from trainscale.runtime.config import load_config
    from trainscale.runtime.parallel.mesh import exit_rank

    held: list[int] = []
    state = {"model": None, "calls": 0}
    forward_backward = T.Trainer._forward_backward

    def watched(self, *a, **k):
        state["model"], state["calls"] = self.parts[0][1], 0
        return forward_backward(self, *a, **k)

    loss = T.lm_loss

    def counted(logits, targets):
        if state["calls"]:  # a later micro-batch: what the earlier ones left behind
            held.append(grad_bytes(state["model"]))
        state["calls"] += 1
        return loss(logits, targets)

    T.Trainer._forward_backward, T.lm_loss = watched, counted
    cfg = load_config(args.config, {"train": {"steps": 2}, "run": {"log_every": 1}})
    T.train(cfg, args.layout, steps=2, out=None, log=lambda _m: None)
    local = sum(p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4
                for p in state["model"].parameters())
    Path(f"{args.result}.rank{dist.get_rank()}.json").write_text(json.dumps({"held": held, "local_params": local}))
    exit_rank(0)


if __name__ == "__main__":
    main()
