"""DPO under the runtime's layouts (tests/test_preference_dist.py): a model folder loaded on every rank, laid out
by runtime/parallel (parallelize: TP, FSDP2; data-parallel gradients averaged as the trainer does), the reference
log-probs computed once by the laid-out model, then a few AdamW steps on fixed batches of pairs, each data-parallel
rank taking its share. Run alone (a one-process group) or under torchrun; rank 0 writes RESULT.json (per layout:
the losses and rewards of each step) and RESULT-LAYOUT.safetensors (the first step's gradients, whole)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from trainscale.infer.load import load_for_inference
from trainscale.infer.preference import batch_loss, reference_logps
from trainscale.runtime.data.chat import load_chat_tokenizer
from trainscale.runtime.data.preference import load_pairs
from trainscale.runtime.parallel.mesh import build_mesh, exit_rank, init_distributed
from trainscale.runtime.parallel.parallelize import (
    allreduce_gradients,
    gradient_group,
    parallelize,
    settle_gradient_placements,
)
from trainscale.runtime.preference import PreferenceSettings, summarize
from trainscale.specs import Layout

SEQ = 64
BATCH = 4  # pairs per step, over all data-parallel ranks


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run(folder: Path, data: Path, layout: Layout, steps: int) -> tuple[dict, dict]:
    mesh = build_mesh(layout)
    model, spec, _ = load_for_inference(folder)
    for p in model.parameters():
        p.requires_grad_(True)
    parallelize(model, mesh, layout, SEQ)
    model.positions = None  # rows as long as the batch's longest (cp = 1: positions 0..s-1 either way)
    multiple = layout.tp  # sequence parallelism splits the rows' length
    pairs = load_pairs(data, load_chat_tokenizer(folder), spec.vocab_size)
    s = PreferenceSettings(loss="dpo", beta=0.1)
    ref = reference_logps(model, pairs, SEQ, multiple=multiple)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    dp, r = layout.dp, mesh.dp_rank
    group = mesh.group("dp") if dp > 1 else None
    rows, grads = [], {}
    for step in range(steps):
        first = (step * BATCH) % (len(pairs) - BATCH + 1)
        share = range(first + r * BATCH // dp, first + (r + 1) * BATCH // dp)
        loss, m = batch_loss(model, s, [pairs[i] for i in share], ref[list(share)], SEQ, multiple)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if (grad_group := gradient_group(mesh)) is not None:  # replicated dp (zero0); FSDP reduces its own
            allreduce_gradients(params, grad_group)
        settle_gradient_placements(params)
        if step == 0:
            grads = {n: whole(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        got = {k: v.detach().clone() for k, v in m.items()}
        loss = loss.detach().clone()
        if group is not None:  # the global batch's mean loss, and its pairs' metrics
            dist.all_reduce(loss, group=group)
            loss /= dp
            got = {k: _gather(v, group, dp) for k, v in got.items()}
        rows.append({"loss": loss.item(), **summarize(got)})
    return {"rows": rows}, grads


def _gather(t: torch.Tensor, group, n: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--result", type=Path, required=True)
    a = ap.parse_args()
    init_distributed()
    out = {}
    for text in a.layouts.split(";"):
        res, grads = run(a.model, a.data, Layout.parse(text), a.steps)
        out[text] = res
        if dist.get_rank() == 0:
            save_file({k: v.contiguous() for k, v in grads.items()}, str(a.result.with_name(
                f"{a.result.stem}-{text.replace(',', '_')}.safetensors")))
    if dist.get_rank() == 0:
        a.result.write_text(json.dumps(out))
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main()
