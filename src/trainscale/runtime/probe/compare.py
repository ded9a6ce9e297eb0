"""Measure what a layout really holds and does, rank by rank, for ``trainscale train --compare-plan``:
``python -m trainscale.runtime.probe.compare --config X.toml --layout L --out result.json`` under torchrun.

Each rank builds the same Trainer as a training run and reports:
  - model state: bytes of its real parameter, gradient and AdamW state tensors (local shards of
    DTensors), read after an optimizer step, before the gradients are freed
  - activations: bytes of the tensors autograd saves for backward during one micro-batch's forward
    through each of its pipeline stages (``torch.autograd.graph.saved_tensors_hooks``; each storage
    counted once, parameters excluded; on a GPU also the peak allocated above the start, which adds
    the transient buffers), then that micro-batch's backward so FSDP's state stays whole
  - FLOPs: one training step under ``torch.utils.flop_counter.FlopCounterMode`` (with the CPU
    FlashAttention kernel registered, which torch counts only on GPUs)
  - step time: the median of the timed steps after the warm-up ones
Rank 0 gathers every rank's figures and writes them as JSON; the predictions are estimate/measured/rank.py's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainscale.runtime.init import resolved_config
from trainscale.runtime.job.runfolder import worker_main
from trainscale.runtime.model import lm_loss
from trainscale.runtime.parallel.mesh import exit_rank
from trainscale.runtime.train import Trainer
from trainscale.specs import Layout


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a subclass's data (DTensor's local shard, a pending collective's result)."""
    while hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t


# ----------------------------------------------------------------------------- model state


def state_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state, from the tensors themselves."""
    params = trainer.params
    out = {"tensors": len(params), "parameters": sum(_nbytes(p) for p in params),
           "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None), "optimizer": 0}
    for opt in trainer.optimizers:
        for state in opt.state.values():
            out["optimizer"] += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out


# ----------------------------------------------------------------------------- activations


class SavedTensors:
    """Bytes of every distinct storage autograd saves while active, excluding ``module``'s parameters
    (looked up at each save: FSDP swaps its gathered weights in during the forward)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.seen: dict[int, int] = {}
        self.items: list[tuple[tuple[int, ...], str, int]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _param_storages(self) -> set[int]:
        return {_local(p).untyped_storage().data_ptr() for p in self.module.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):
            return t
        local = _dense(t)
        st = local.untyped_storage()
        key = st.data_ptr()
        if key and key not in self.seen and key not in self._param_storages():
            self.seen[key] = st.nbytes()
            self.items.append((tuple(local.shape), str(local.dtype), st.nbytes()))
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def activation_bytes(trainer: Trainer) -> list[dict[str, Any]]:
    """One micro-batch forward (+ loss on the last stage) through each local stage, saved bytes counted."""
    cfg, lo = trainer.cfg, trainer.layout
    seq_local = cfg.train.seq_len // lo.cp
    n_stages = lo.pp * lo.v
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (trainer.layout.mb, seq_local), generator=gen).to(trainer.device)
    targets = tokens.roll(-1, dims=1)
    out = []
    for stage, part in trainer.parts:
        if stage == 0:
            x = tokens
        else:  # a later stage receives hidden states: this rank's sequence shard of them under SP
            rows = seq_local // lo.tp if lo.tp > 1 and lo.sp else seq_local
            x = torch.randn(trainer.layout.mb, rows, cfg.model.d_model, generator=gen).to(trainer.device)
            x.requires_grad_(True)
        cuda = trainer.device.type == "cuda"
        if cuda:  # on a GPU also the allocator's view: peak allocated during the forward, above the start
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with SavedTensors(part) as saved, trainer.autocast:
            y = part(x)
            if stage == n_stages - 1:
                loss = lm_loss(y, targets)
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        if stage != n_stages - 1:  # a stand-in for the next stage's gradient, outside the count
            loss = _local(y).float().pow(2).mean()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        loss.backward()
        row = {"stage": stage, "bytes": saved.total, "tensors": len(saved.items)}
        if cuda:
            row["peak_allocated_bytes"] = peak
        out.append(row)
    for p in trainer.params:
        p.grad = None
    return out


# ----------------------------------------------------------------------------- FLOPs


def _cpu_flash_flops() -> dict[Any, Any]:
    """FlopCounterMode formulas for the CPU FlashAttention kernel, as torch registers the CUDA one."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q, k, v)

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, q, k, v)

    return {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}


def step_flops(trainer: Trainer) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_cpu_flash_flops())
    with counter:
        trainer.train_step()
    return float(counter.get_total_flops())


# ----------------------------------------------------------------------------- the run


def measure(trainer: Trainer, steps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """This rank's measured figures (see the module docstring)."""
    got: dict[str, Any] = {"rank": trainer.rank}
    got["activations"] = activation_bytes(trainer)

    def probe(t: Trainer) -> None:
        got.setdefault("state", state_bytes(t))

    trainer.after_update = probe
    trainer.train_step()  # the first step also creates AdamW's state
    trainer.after_update = None
    got["flops"] = step_flops(trainer)
    got["a2a"] = {"bytes": sum(m.stats.a2a_bytes for m in trainer.moes),  # that step's expert all-to-alls
                  "seconds": sum(m.stats.a2a_seconds for m in trainer.moes)}
    for _ in range(warmup):
        trainer.train_step()
    times = [trainer.train_step()["step_time_s"] for _ in range(steps)]
    got["step_times"] = times
    got["step_time_s"] = statistics.median(times)
    return got


def run(config: str | Path, layout: str, steps: int = 3, warmup: int = 1) -> list[dict[str, Any]] | None:
    """Measure ``layout`` in the current process group; -> every rank's figures on rank 0, else None."""
    cfg = resolved_config(config)
    trainer = Trainer(cfg, Layout.parse(layout), out=None, log=lambda _m: None)
    mine = measure(trainer, steps, warmup)
    if trainer.world == 1:
        return [mine]
    got: list[Any] = [None] * trainer.world if trainer.rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(mine, got, dst=0)
    return got if trainer.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainscale.runtime.probe.compare", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layouts", required=True, help="';'-separated layouts of the same world size, run in turn")
    ap.add_argument("--out", required=True, help="JSON file: {layout: [every rank's figures]}")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)

    def body() -> None:
        results: dict[str, Any] = {}
        for layout in args.layouts.split(";"):
            got = run(args.config, layout, args.steps, args.warmup)
            if got is not None:
                results[layout] = got
                Path(args.out).write_text(json.dumps(results, indent=1))
        if dist.get_world_size() > 1:
            dist.barrier()  # every rank done with its collectives before the group goes

    return worker_main(body)


# ----------------------------------------------------------------------------- predicted vs measured


def compare_command(config: str | Path, layouts: list[str], out: str | Path, steps: int = 3, warmup: int = 1,
                    python: str = sys.executable) -> list[str]:
    """The command that measures ``layouts`` (all of one world size) one after another in one job: torchrun
    with one process per rank, or plain Python for one process."""
    world = Layout.parse(layouts[0]).world_size
    launcher = [python] if world == 1 else [python, "-m", "torch.distributed.run", "--standalone",
                                            "--nproc-per-node", str(world)]
    return [*launcher, "-m", "trainscale.runtime.probe.compare", "--config", str(config),
            "--layouts", ";".join(layouts), "--out", str(out), "--steps", str(steps), "--warmup", str(warmup)]


def _err(pred: float, got: float) -> float:
    return (pred - got) / got if got else (0.0 if pred == got else float("inf"))


def compare(cfg: Any, layout: Layout, measured: list[dict[str, Any]], profile: dict[str, Any] | None
            ) -> dict[str, Any]:
    """Every rank's prediction (estimate/measured/rank.py) next to its measurement, and the worst differences."""
    from trainscale.estimate.measured import rank as R
    from trainscale.estimate.measured.machine import machine_from_profile

    m, t = cfg.model, cfg.train
    mb = layout.mb
    mach = machine_from_profile(profile, layout.world_size) if profile is not None else None
    ranks = []
    for got in sorted(measured, key=lambda g: g["rank"]):
        r = got["rank"]
        state = R.rank_state_bytes(m, layout, r).as_dict()
        flops = R.rank_step_flops(m, layout, r, t.seq_len, t.global_batch)
        a2a = R.rank_a2a(m, layout, r, t.seq_len, t.global_batch, mb, mach)
        acts = [{"stage": a["stage"], "measured": a["bytes"],
                 "predicted": R.stage_saved_bytes(m, mb, t.seq_len, layout, a["stage"]).total}
                for a in got["activations"]]
        row = {"rank": r, "coords": R.coords(layout, r),
               "state": {k: {"predicted": state[k], "measured": got["state"][k]}
                         for k in ("parameters", "gradients", "optimizer", "total")},
               "activations": acts,
               "flops": {"predicted": flops["flop_counter"], "measured": got["flops"], "executed": flops["total"]},
               "step_time_s": {"measured": got["step_time_s"], "samples": got["step_times"]}}
        if m.is_moe and layout.ep > 1 and "a2a" in got:
            row["a2a"] = {"bytes": {"predicted": a2a["bytes"], "measured": got["a2a"]["bytes"]},
                          "seconds": {"predicted": a2a["seconds"] if mach is not None else None,
                                      "measured": got["a2a"]["seconds"]}}
        if mach is not None:
            st = R.rank_step_time(m, layout, r, t.seq_len, t.global_batch, mach, mb)
            row["step_time_s"].update(predicted=st["total"], breakdown=st)
        ranks.append(row)
    state_exact = all(v["predicted"] == v["measured"] for r in ranks for v in r["state"].values())
    act_err = max(abs(_err(a["predicted"], a["measured"])) for r in ranks for a in r["activations"])
    flop_err = max(abs(_err(r["flops"]["predicted"], r["flops"]["measured"])) for r in ranks)
    step_meas = max(r["step_time_s"]["measured"] for r in ranks)  # a step ends when the slowest rank does
    out: dict[str, Any] = {"layout": str(layout), "world_size": layout.world_size, "micro_batch": mb,
                           "ranks": ranks, "state_exact": state_exact, "activation_max_error": act_err,
                           "flops_max_error": flop_err, "step_time_measured_s": step_meas}
    if any("a2a" in r for r in ranks):  # balanced routing predicted per rank; the ranks' sum is exact
        pred, meas = (sum(r["a2a"]["bytes"][k] for r in ranks) for k in ("predicted", "measured"))
        out.update(a2a_bytes_predicted=pred, a2a_bytes_measured=meas,
                   a2a_max_error=max(abs(_err(r["a2a"]["bytes"]["predicted"], r["a2a"]["bytes"]["measured"]))
                                     for r in ranks))
    if mach is not None:
        step_pred = max(r["step_time_s"]["predicted"] for r in ranks)
        out.update(step_time_predicted_s=step_pred, step_time_error=_err(step_pred, step_meas),
                   profile_processes=mach.measured_processes)
    return out


if __name__ == "__main__":
    exit_rank(main())  # mesh.exit_rank: no finalization with gloo threads alive
