"""The training loop, one process per rank: ``python -m trainscale.runtime.train --config X.toml``,
normally started by torchrun (``trainscale train`` does that for you).

What happens, in order:
  1. join the process group (torchrun's env, or a one-process group); lay the Layout out as a
     DeviceMesh (runtime/parallel/mesh.py)
  2. tokenise the corpus (rank 0 first, then everyone reads the cache)
  3. build the whole model on CPU and initialise it from the seed, identically on every rank, so
     every layout starts from the same weights (models too big for that are built on the meta device
     and initialised shard by shard)
  4. cut it into pipeline stages (runtime/parallel/pipeline.py), parallelize each stage: TP+SP -> CP ->
     activation checkpointing -> FSDP (runtime/parallel/parallelize.py)
  5. per step: the global batch (dp ranks take disjoint rows, cp ranks their load-balanced chunks),
     forward + backward (through the pipeline schedule, or in ``local_batch / mb`` accumulation
     steps), gradient average over replicas, clipping by the global norm, AdamW, the LR schedule
     (runtime/schedule.py: its horizon is the run's length when it started, kept by every resume; past it
     only with --extend); the step's mean loss over the whole global batch is logged with tokens/s, FLOP/s, MFU
  6. every ``[train] eval_every`` steps, and at the end, the held-out loss of the gathered weights (rank 0
     evaluates, every rank receives the value); rank 0 writes the unsharded weights as RUN_DIR/final
     (runtime/artifact.py)

Run folder: config.toml, run.json (layout, world size, model, results, the unigram entropy of the training
tokens), metrics.jsonl (a line per step, held-out evaluation, checkpoint, attempt start and resume),
TensorBoard events and the optional sinks (runtime/job/tblog.py), profile/ ([profile] steps), tokenizer.json,
final/; its identity, lock and bookkeeping are runtime/job/runfolder.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainscale.errors import TrainscaleError
from trainscale.estimate.params import param_count
from trainscale.runtime import measure
from trainscale.runtime.config import TrainConfig, check_layout, micro_batch
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.loader import TokenLoader, eval_windows, unigram_loss
from trainscale.runtime.job import faults, runfolder
from trainscale.runtime.job.checkpoint import CheckpointManager, step_dir_name
from trainscale.runtime.job.faults import Fault, requeue_count, restart_count
from trainscale.runtime.job.slurm import SAVE_REQUEST_ENV, mark_stopped, stops_for_requeue
from trainscale.runtime.job.tblog import check_sinks, open_metric_log
from trainscale.runtime.model import IGNORE, Transformer, build_model, lm_loss, lm_loss_sum
from trainscale.runtime.parallel.context import local_positions, shard_sequence
from trainscale.runtime.parallel.mesh import ParallelMesh, build_mesh, exit_rank, init_distributed
from trainscale.runtime.parallel.parallelize import (
    allreduce_gradients,
    autocast_for,
    clip_grad_norm,
    expert_parameters,
    gradient_group,
    moe_layers,
    parallelize,
    resolve_precision,
    settle_gradient_placements,
    sum_moe_gradients_over_tp,
    uses_fsdp,
)
from trainscale.runtime.parallel.pipeline import Pipeline, split_model
from trainscale.runtime.parallel.zero1 import Zero1AdamW, adamw_groups, optimizer_module
from trainscale.runtime.schedule import Horizon, continuation, lr_at, recorded
from trainscale.specs import Layout


@dataclass
class RunResult:
    losses: list[float]
    out: Path | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: float | None = None
    unigram_loss: float | None = None
    local_params: int = 0  # parameter elements this rank holds (its shards)


def _say(msg: str) -> None:
    """Print from any rank (fault messages come from the rank that fails)."""
    print(msg, flush=True)


class Trainer:
    """Everything one rank holds: mesh, model stages, optimizer, data position.

    Issue 5 (checkpoints, faults) hooks in at ``run()``'s marked places: ``state_dict()`` (DCP) and
    ``extras()`` (per rank) are what a checkpoint must hold, and the loop starts at ``self.step``."""

    def __init__(self, cfg: TrainConfig, layout: Layout, out: Path | None = None, log: Callable[[str], None] = print,
                 resume: bool = False, faults: list[Fault] | None = None):
        self.cfg, self.layout, self.out = cfg, layout, out
        # torchrun restarted us after a failure, or Slurm requeued the job: continue
        self.resume = resume or restart_count() > 0 or requeue_count() > 0
        self.faults = faults or []
        check_layout(cfg, layout)
        check_sinks(cfg.run.sinks)
        self.device = init_distributed(cfg.checkpoint.collective_timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = log if self.rank == 0 else (lambda _m: None)
        self.run_id, self._lock = self._bind_run_folder()
        self.folder = runfolder.RunFolder(out, self.resume) if out is not None and self.rank == 0 else None
        self.mesh: ParallelMesh = build_mesh(layout)
        t = cfg.train
        torch.manual_seed(t.seed)

        # data: rank 0 tokenises (or finds the cache / the prepared shards), then everyone reads it
        if self.rank == 0:
            corpus_for(cfg, log=self.log)
        self._barrier()
        self.corpus = corpus_for(cfg)
        # packed documents kept apart (document_mask, chat data): batches carry positions, chat targets a mask
        self.documents = cfg.data.documents_apart
        if self.documents and not hasattr(self.corpus, "flags"):
            raise TrainscaleError("data.document_mask needs a prepared corpus (data.files or data.tokenizer)")
        self.loader = TokenLoader(self.corpus.tokens("train"), t.seq_len, t.global_batch, self.mesh.dp_rank,
                                  layout.dp, t.seed, **self._document_args("train"))
        self.positions = local_positions(t.seq_len, layout.cp, self.mesh.cp_rank)

        # model: whole and identical on every rank, then split and parallelized (or, from a Hugging Face
        # folder, built empty, parallelized, and each rank's shards read from the files)
        self.precision = resolve_precision(t.precision, self.device)
        self.init_elements_read = 0
        self.parts = self._build_parts()
        self.params = [p for _, part in self.parts for p in part.parameters()]
        if cfg.init is not None:
            self.log(f"initialised from {cfg.init}: rank 0 read {self.init_elements_read:,} of the "
                     f"{param_count(cfg.model):,} weights (its shards)")
        # one AdamW per stage (elementwise, so the same math as one): each stage's state dict stands alone
        self.optimizers = [self._optimizer(part) for _, part in self.parts]
        # what the gradient norm runs over: zero1's optimizer shards (each rank's reduced chunk), else the weights
        self.norm_params = [p for o in self.optimizers for p in o.shards] if layout.zero == 1 else self.params
        self.micro = micro_batch(cfg, layout)
        self.n_micro = t.global_batch // layout.dp // self.micro
        self.pipeline = Pipeline(self.parts, layout, self.mesh, self.device, self.n_micro) if layout.pp > 1 else None
        self.grad_group = gradient_group(self.mesh)
        # a MoE's layers: the balance loss's gradient carries the LM loss's 1 / micro-batches (the pipeline
        # schedule divides the accumulated gradients by it instead); with EP the experts average apart
        self.moes = [m for _, part in self.parts for m in moe_layers(part)]
        for m in self.moes:
            m.aux_scale = 1.0 if self.pipeline is not None else 1.0 / self.n_micro
        experts = {id(p) for _, part in self.parts for p in expert_parameters(part)} if layout.ep > 1 else set()
        self.expert_params = [p for p in self.params if id(p) in experts]
        self.dense_params = [p for p in self.params if id(p) not in experts]
        self.moe_params = [p for _, part in self.parts for m in moe_layers(part) for p in m.parameters()]
        self.step = 0
        # the LR schedule's length and the run's total: train.steps for a new run, a checkpoint's record on resume
        self.horizon = Horizon(t.steps, t.steps)
        self.resumed_from: int | None = None
        # called after the optimizer step, before the gradients are freed (runtime/probe/compare.py measures there)
        self.after_update: Callable[[Trainer], None] | None = None

        self.flops_per_token = measure.flops_per_token(cfg.model, t.seq_len)
        self.peak, self.peak_source = measure.job_peak_flops(self.world)
        self.autocast = autocast_for(self.precision, layout, self.device)
        self.last_eval: dict[str, Any] | None = None  # the latest held-out evaluation row
        self._unigram_counts = None
        self.profiler = measure.StepProfiler(cfg.profile.steps, cfg.profile.ranks, self.rank, out, self.device,
                                             self.log if self.rank == 0 else _say)

    # ------------------------------------------------------------------ setup

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _document_args(self, split: str) -> dict[str, Any]:
        """What the loader needs to keep documents apart: chat data's flags, or the end-of-text id."""
        if not self.documents:
            return {}
        return {"flags": self.corpus.flags(split), "eot": self.corpus.eot_id, "documents": True}

    def _checkpoint_root(self) -> Path | None:
        c = self.cfg.checkpoint
        return Path(c.dir) if c.dir else (self.out / "checkpoints" if self.out is not None else None)

    def _optimizer(self, part: Transformer) -> torch.optim.Optimizer:
        """AdamW on the stage's weights, or under zero1 on this rank's shards of them (runtime/parallel/zero1.py)."""
        t = self.cfg.train
        kw = {"lr": lr_at(0, self.cfg), "betas": t.betas, "eps": 1e-8}
        if self.layout.zero == 1:
            return Zero1AdamW(part, self.mesh, t.weight_decay, **kw)
        return torch.optim.AdamW(adamw_groups(list(part.parameters()), t.weight_decay), **kw)

    def _bind_run_folder(self) -> tuple[str | None, runfolder.RunLock | None]:
        """-> (run id, lock). Under `trainscale train` the CLI holds the lock and named the run
        (TRAINSCALE_RUN_ID): rank 0 checks the folder still belongs to it. Run directly, rank 0 locks and
        claims the folder itself. Every rank gets the same answer or the same one-sentence error."""
        import os

        root = self._checkpoint_root()
        if root is None:
            return None, None
        given = os.environ.get(runfolder.ENV_RUN_ID)
        answer: list[Any] = [given, None]
        lock = None
        if self.rank == 0:
            try:
                if given and self.out is not None:
                    runfolder.check_identity(self.out, given)
                elif not given:
                    lock = runfolder.RunLock(self.out or root).acquire()
                    answer[0] = runfolder.claim(self.out or root, root, self.cfg, self.resume)
            except TrainscaleError as e:
                answer[1] = str(e)
        if self.world > 1:
            dist.broadcast_object_list(answer, src=0)
        if answer[1] is not None:
            raise TrainscaleError(answer[1])
        return answer[0], lock

    def _build_parts(self) -> list[tuple[int, Transformer]]:
        spec, lo, seed, init = self.cfg.model, self.layout, self.cfg.train.seed, self.cfg.init
        on_meta = init is not None or (self.device.type == "cuda" and param_count(spec) * 4 > 0.25 * (
            torch.cuda.get_device_properties(self.device).total_memory))
        model = build_model(spec, "meta" if on_meta else "cpu", seed=seed)
        if not on_meta:
            model.to(self.device)
        parts = split_model(model, lo, self.mesh.pp_rank) if lo.pp > 1 else [(0, model)]
        for _, part in parts:
            parallelize(part, self.mesh, lo, self.cfg.train.seq_len, self.precision, self.cfg.train.compile)
            part.positions = part.positions.to(self.device)
            if on_meta:  # too big to hold whole on one GPU, or read from a file: allocate the shards only
                part.to_empty(device=self.device)
                if init is None:
                    part.init_weights(seed)
        if init is not None:
            from trainscale.runtime.init import load_init

            self.init_elements_read = load_init([part for _, part in parts], init, spec)
        return parts

    # ------------------------------------------------------------------ one step

    def _learned_scale(self, targets: torch.Tensor) -> float:
        """dp x cp / the global batch's learned targets (those not IGNORE), counted over every rank: a rank's
        summed loss times this, averaged over the dp x cp replicas by the gradient reduction, is the sum over
        the whole global batch / its learned targets, whatever the layout. 0 when nothing is learned."""
        count = (targets != IGNORE).sum().to(torch.float64).reshape(1).to(self.device)
        if self.world > 1:  # pp and cp are refused with documents: every rank is a dp or tp rank
            dist.all_reduce(count)
            count /= self.layout.tp  # the tp ranks of a dp rank read the same rows
        n = float(count.item())
        return self.layout.dp * self.layout.cp / n if n > 0 else 0.0

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        """-> this rank's mean loss over its tokens (zero on pipeline stages without the head). With
        ``positions`` (documents kept apart): this rank's summed loss over its learned targets x
        ``_learned_scale``."""
        if positions is not None:
            return self._forward_backward_documents(inputs, targets, positions)
        if self.pipeline is not None:
            with self.autocast:
                loss = self.pipeline.step(inputs, targets)
            return loss if loss is not None else torch.zeros((), device=self.device)
        model = self.parts[0][1]
        total = torch.zeros((), device=self.device)
        for i in range(self.n_micro):
            x, y = (t[i * self.micro:(i + 1) * self.micro] for t in (inputs, targets))
            if uses_fsdp(self.layout):
                model.set_requires_gradient_sync(i == self.n_micro - 1)  # reduce-scatter once per step
            with self.autocast:
                loss = lm_loss(model(x), y) / self.n_micro
            loss.backward()
            total += loss.detach()
        return total

    def _forward_backward_documents(self, inputs: torch.Tensor, targets: torch.Tensor,
                                    positions: torch.Tensor) -> torch.Tensor:
        scale = self._learned_scale(targets)
        model = self.parts[0][1]
        total = torch.zeros((), device=self.device)
        for i in range(self.n_micro):
            x, y, p = (t[i * self.micro:(i + 1) * self.micro] for t in (inputs, targets, positions))
            if uses_fsdp(self.layout):
                model.set_requires_gradient_sync(i == self.n_micro - 1)
            with self.autocast:
                loss = lm_loss_sum(model(x, positions=p), y) * scale
            loss.backward()
            total += loss.detach()
        return total

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg, self.horizon.schedule_steps)
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr
        inputs, targets, *positions = self.loader.next_batch()  # positions: documents kept apart
        if self.layout.cp > 1:
            inputs, targets = shard_sequence(inputs, self.positions), shard_sequence(targets, self.positions)
        for m in self.moes:
            m.stats.reset()
        loss = self._forward_backward(inputs.to(self.device), targets.to(self.device),
                                      positions[0].to(self.device) if positions else None)
        lo = self.layout
        if self.moes and lo.tp > 1 and lo.sp:
            sum_moe_gradients_over_tp(self.moe_params, self.mesh)
        if self.grad_group is not None:
            allreduce_gradients(self.dense_params, self.grad_group)
            if self.expert_params:  # summed over the ranks holding the same experts, divided by all dp x cp
                allreduce_gradients(self.expert_params, self.mesh.group("expert_dp"), divide=lo.dp * lo.cp)
        settle_gradient_placements(self.params)  # each rank keeps only its shard of every gradient
        if self.pipeline is not None:  # a tied embedding: the first and last stages' gradients summed
            self.pipeline.tied.sum_gradients()
        for opt in self.optimizers:
            if isinstance(opt, Zero1AdamW):  # reduce-scatter: each rank's chunk of the averaged gradients
                opt.reduce_gradients()
        grad_norm = clip_grad_norm(self.norm_params, self.cfg.train.grad_clip, self.mesh)
        for opt in self.optimizers:
            opt.step()
        if self.after_update is not None:
            self.after_update(self)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        # the global batch's mean loss: every dp and cp rank of the last stage holds the mean of its share
        loss = loss.detach().float().reshape(1)
        if self.world > 1:
            dist.all_reduce(loss)
            loss /= self.layout.dp * self.layout.cp * self.layout.tp
        value = float(loss.item())
        dt = time.perf_counter() - t0
        tokens = self.cfg.train.global_batch * self.cfg.train.seq_len
        tps = tokens / dt
        self.step += 1
        row = {"step": self.step, "loss": value, "tokens_per_s": tps, "flops_per_s": tps * self.flops_per_token,
               "mfu": measure.mfu(tps, self.flops_per_token, self.peak),
               "flop_convention": measure.FLOP_CONVENTION_NAME, "lr": lr, "grad_norm": grad_norm,
               "step_time_s": dt, "memory_bytes": measure.peak_memory_bytes(self.device)}
        if self.cfg.model.is_moe:
            row.update(self._moe_metrics(dt))
        return row

    def _moe_metrics(self, step_time: float) -> dict[str, Any]:
        """The step's routing and all-to-all numbers, the same on every rank (collectives over the world):
        ``expert_tokens`` {layer: [tokens routed to each expert, whole global batch]} (a token counts once
        per expert it is sent to, so a layer's counts add up to k x tokens); ``moe_aux_loss`` the balance
        loss summed over the MoE layers (mean over micro-batches); ``a2a_s`` the slowest rank's seconds in
        the expert-parallel all-to-alls (forward, backward and any recompute), ``a2a_share`` that over the
        step time, ``a2a_bytes`` the bytes the busiest rank sent. Under a pipeline, step 1 also counts the
        schedule's shape-inference forward pass."""
        spec, lo = self.cfg.model, self.layout
        counts = torch.zeros(spec.n_layers, spec.n_experts, dtype=torch.float64)
        aux = torch.zeros(1, dtype=torch.float64)
        a2a = torch.tensor([0.0, 0.0], dtype=torch.float64)
        for _, part in self.parts:
            for name, block in part.layers.items():
                m = getattr(block, "moe", None)
                if m is None:
                    continue
                if m.stats.tokens is not None:
                    counts[int(name)] += m.stats.tokens.double().cpu()
                aux += m.stats.aux
                a2a[0] += m.stats.a2a_seconds
                a2a[1] += m.stats.a2a_bytes
        copies = lo.tp // (lo.tp if lo.sp else 1)  # without SP the tp ranks route the same tokens
        n_micro = self.n_micro
        if self.world > 1:
            dist.all_reduce(counts)
            dist.all_reduce(aux)
            dist.all_reduce(a2a, op=dist.ReduceOp.MAX)
        counts /= copies
        moe_ids = [i for i in range(spec.n_layers) if spec.is_moe_layer(i)]
        return {"expert_tokens": {str(i): [int(round(c)) for c in counts[i].tolist()] for i in moe_ids},
                "moe_aux_loss": float(aux) / (lo.dp * lo.cp * lo.tp / (lo.tp // copies)) / n_micro,
                "a2a_s": float(a2a[0]), "a2a_share": float(a2a[0]) / step_time if step_time > 0 else 0.0,
                "a2a_bytes": int(a2a[1])}

    # ------------------------------------------------------------------ the loop

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state by parameter name (sharded tensors stay sharded: DTensors), for
        torch.distributed.checkpoint; the names do not depend on the layout, so a checkpoint saved under
        one layout loads under another. Plain values (step, data position) are in ``extras()``."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for (_, part), opt in zip(self.parts, self.optimizers, strict=True):
            model.update(get_model_state_dict(part, options=opts))
            optim.update(get_optimizer_state_dict(optimizer_module(part, opt), opt, options=opts))
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``'s structure (as DCP filled it in place) back into the stages."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for (_, part), opt in zip(self.parts, self.optimizers, strict=True):
            set_model_state_dict(part, state["model"], options=opts)
            set_optimizer_state_dict(optimizer_module(part, opt), opt, state["optim"], options=opts)

    def extras(self) -> dict[str, Any]:
        """This rank's plain state: the step, the data position, the RNG and the schedule's horizon and the run's
        total (the LR follows from the step and the horizon)."""
        return {"step": self.step, "loader": self.loader.state_dict(), "rng": torch.get_rng_state(),
                **self.horizon.extras()}

    def load_extras(self, extras: dict[str, Any]) -> None:
        self.step = int(extras["step"])
        self.loader.load_state_dict(extras["loader"])
        if "rng" in extras:
            torch.set_rng_state(extras["rng"])

    def _checkpoints(self) -> CheckpointManager | None:
        c = self.cfg.checkpoint
        if self.out is None and c.dir is None:
            return None
        if not (c.every_steps or c.every_seconds or self.resume):
            return None
        return CheckpointManager(self._checkpoint_root(), keep=c.keep, async_save=c.async_save,
                                 before_commit=faults.before_commit(self.faults, self.rank, _say), run_id=self.run_id)

    def _resume(self, mgr: CheckpointManager, steps: int | None, extend: bool) -> int | None:
        """Load the newest good checkpoint, keep its schedule (runtime/schedule.py) -> the step to stop at (None:
        no checkpoint, the run starts). A refusal (the run got there already, going past its total without
        ``extend``) comes before anything is written in the run folder."""
        state = self.state_dict()
        found = mgr.load(state, log=self.log)
        if found is None:
            self.log("no complete checkpoint to resume from: starting at step 0")
            for opt in self.optimizers:  # state_dict() ran a zero-gradient step to make the optimizer's state
                opt.state.clear()  # (torch DCP's _init_optim_state): a fresh start must not keep its step count
            return None
        step, extras = found
        where = mgr.root.parent if self.out else mgr.root
        self.horizon, stop = continuation(self.cfg.train, step, recorded(extras, self.cfg.train.steps, str(where)),
                                          steps, extend, str(where))
        self.load_state_dict(state)
        self.load_extras(extras)
        self.resumed_from = step
        h = self.horizon
        past = f", then at its final learning rate to step {h.total}" if h.total > h.schedule_steps else ""
        self.log(f"resumed from step {step} (the checkpoint at step {step}, {mgr.root / step_dir_name(step)}; "
                 f"attempt {restart_count()}, requeue {requeue_count()}); steps {step + 1}..{stop} follow, the "
                 f"learning-rate schedule laid out for {h.schedule_steps} steps{past}")
        return stop

    def run(self, steps: int | None = None, extend: bool = False) -> RunResult:
        """Train to ``steps`` (default: train.steps; resuming, the run's recorded total). ``extend``: a resumed
        run may go past its recorded total (runtime/schedule.py says how its learning rate continues)."""
        mgr = self._checkpoints()
        # before the run folder is touched: a refused resume leaves it as it was
        stop = self._resume(mgr, steps, extend) if mgr is not None and self.resume else None
        if stop is None:  # a new run: its schedule is laid out for train.steps
            stop = self.cfg.train.steps if steps is None else steps
            self.horizon = Horizon(self.cfg.train.steps, max(stop, self.cfg.train.steps))
        steps = stop
        if self.folder is not None:
            self.folder.start(self.cfg.to_toml(), self.corpus.tokenizer_path, self._run_info())
            if self.resumed_from is not None:  # the console follower prints this first, then only the new steps
                self.folder.log({"event": "resumed", "step": self.resumed_from, "wall": time.time(),
                                 "attempt": restart_count(), "requeue": requeue_count(),
                                 **self.horizon.extras()})
        self.log(f"training {self.cfg.model.name} ({param_count(self.cfg.model) / 1e6:.2f}M params) on "
                 f"{self.world} process(es), layout {self.layout}, {steps} steps, "
                 f"{self.cfg.train.global_batch} x {self.cfg.train.seq_len} tokens per step")
        tb = None
        if self.folder is not None:
            tb = open_metric_log(self.out, self.step if self.resume else None, self.log, self.cfg.run.sinks,
                                 self.cfg.name, self.run_id)
        start = time.perf_counter()
        last_save = start
        losses, rows, stop = [], [], False
        while self.step < steps and not stop:
            faults.at_step(self.faults, self.step + 1, self.rank, _say)
            self.profiler.before(self.step + 1)
            row = self.train_step()
            self.profiler.after(self.step, last=self.step == steps)
            row["time"] = time.perf_counter() - start
            row["wall"] = time.time()  # seconds since the epoch: restarts and requeues line up across attempts
            row["attempt"] = restart_count()
            row["requeue"] = requeue_count()
            row["eta_s"] = measure.eta_seconds([r["step_time_s"] for r in rows] + [row["step_time_s"]],
                                               steps - self.step)
            losses.append(row["loss"])
            rows.append(row)
            if self.folder is not None:
                self.folder.log(row)
            if tb is not None:
                tb.step(row)
            if self.step % self.cfg.run.log_every == 0 or self.step == steps:
                self.log(f"step {self.step:5d}/{steps}  loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                         f"{row['flops_per_s'] / 1e9:.2f} GFLOP/s  MFU {row['mfu']:.1%} "
                         f"({measure.FLOP_CONVENTION_NAME})  lr {row['lr']:.2e}  "
                         f"ETA {measure.duration_text(row['eta_s'])}")
            every = self.cfg.train.eval_every
            if every and self.step % every == 0:
                self._periodic_eval(tb)
            if mgr is not None:
                mgr.poll()
                c = self.cfg.checkpoint
                due = (c.every_steps and self.step % c.every_steps == 0) or (
                    c.every_seconds and time.perf_counter() - last_save >= c.every_seconds)
                if self._save_requested():
                    stop = stops_for_requeue(self.step, steps)  # then end this attempt: the job requeues itself
                    self.log(f"[signal] checkpoint requested (Slurm's early signal): saving at step {self.step}"
                             + (", then stopping for the requeue" if stop else ""))
                    due = True
                if due:
                    t0 = time.perf_counter()
                    mgr.save(self.step, self.state_dict(), self.extras())
                    last_save = time.perf_counter()
                    if tb is not None:
                        tb.flush()
                    if self.folder is not None:
                        self.folder.log({"event": "checkpoint", "step": self.step, "save_s": last_save - t0,
                                         "attempt": restart_count()})
        if mgr is not None:
            mgr.finish()
        if self.folder is not None:
            self.folder.close()
        result = RunResult(losses, self.out, rows, local_params=self.local_params())
        if stop and self.rank == 0:
            mark_stopped(self.step)
        if self.out is not None and not stop:
            self._finish(result, time.perf_counter() - start)
            if self.folder is not None:
                g = self.folder.goodput(self.log)
                if tb is not None:
                    tb.summary({**g, "eval_loss": result.eval_loss, "unigram_loss": result.unigram_loss}, self.step)
        elif self.last_eval is not None and self.last_eval["step"] == self.step:
            result.eval_loss, result.unigram_loss = self.last_eval["val_loss"], self.last_eval["unigram_loss"]
        if tb is not None:
            tb.close()
        if self._lock is not None:
            self._lock.release()
        return result

    def _save_requested(self) -> bool:
        """True on every rank when the batch script asked for a checkpoint (runtime/job/slurm.py touches the
        request file on the signal before the time limit): rank 0 looks, everyone agrees (one all-reduce)."""
        path = os.environ.get(SAVE_REQUEST_ENV)
        if not path:
            return False
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        if self.rank == 0 and os.path.exists(path):
            flag += 1
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------ the end

    def local_params(self) -> int:
        return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in self.params)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights, on rank 0 (None elsewhere): DTensors (TP, FSDP) are gathered within
        each stage, and with a pipeline the stages' first ranks send theirs to rank 0."""
        sd = {}
        for _, part in self.parts:
            for name, p in part.named_parameters():
                t = p.full_tensor() if isinstance(p, DTensor) else p
                sd[name] = t.detach().to("cpu", torch.float32)
        if self.layout.pp == 1:
            return sd if self.rank == 0 else None
        m = self.mesh
        if m.dp_rank == 0 and m.cp_rank == 0 and m.tp_rank == 0 and m.coord("dp_replicate") == 0:
            got = [None] * self.layout.pp if self.rank == 0 else None
            dist.gather_object(sd, got, dst=0, group=m.group("pp"))
            if self.rank == 0:
                return {k: v for part in got for k, v in part.items()}
        return None

    def _periodic_eval(self, tb) -> None:
        """``[train] eval_every``: the held-out loss of the weights after this step, computed as the final one is
        (the unsharded weights gathered to rank 0, one whole model, the first ``eval_sequences`` held-out windows),
        then broadcast, so every rank of every layout holds the same value; logged to metrics.jsonl (an
        ``eval`` row), TensorBoard and the console."""
        t0 = time.perf_counter()
        state = self.full_state_dict()  # a collective: every rank takes part
        got = list(self.evaluate(state)) if self.rank == 0 else [None, None]
        del state
        if self.world > 1:
            dist.broadcast_object_list(got, src=0)
        val, uni = got
        if val is None:
            return
        row = {"event": "eval", "step": self.step, "val_loss": float(val), "unigram_loss": float(uni),
               "eval_sequences": self.cfg.run.eval_sequences, "eval_s": time.perf_counter() - t0, "wall": time.time(),
               "attempt": restart_count(), "requeue": requeue_count()}
        self.last_eval = row
        if self.folder is not None:
            self.folder.log(row)
        if tb is not None:
            tb.eval(row)
        self.log(f"eval  {self.step:5d}  held-out loss {val:.4f} nats/token (unigram baseline {uni:.4f}) on "
                 f"{self.cfg.run.eval_sequences} sequences, {row['eval_s']:.1f} s")

    def unigram_counts(self):
        """The training tokens' counts per token id (from the prepared data; counted once)."""
        if self._unigram_counts is None:
            self._unigram_counts = self.corpus.unigram_counts()
        return self._unigram_counts

    def evaluate(self, state: dict[str, torch.Tensor] | None) -> tuple[float | None, float | None]:
        n = self.cfg.run.eval_sequences
        if not n or state is None:
            return None, None
        spec, seq = self.cfg.model, self.cfg.train.seq_len
        model = build_model(spec, "meta")
        model.load_state_dict(state, assign=True)
        model.to(self.device).eval()
        inputs, targets, *positions = eval_windows(self.corpus.tokens("val"), seq, n, **self._document_args("val"))
        total, count = 0.0, 0
        with torch.no_grad(), autocast_for(self.precision, Layout(), self.device):
            for i in range(0, len(inputs), 16):
                x, y = inputs[i:i + 16].to(self.device), targets[i:i + 16].to(self.device)
                logits = model(x, positions=positions[0][i:i + 16].to(self.device)) if positions else model(x)
                total += float(lm_loss_sum(logits, y))
                count += int((y != IGNORE).sum())
        if not count:  # chat data whose held-out windows hold no assistant words
            return None, None
        return total / count, unigram_loss(None, targets, self.corpus.vocab_size, self.unigram_counts())

    def _finish(self, result: RunResult, seconds: float) -> None:
        from trainscale.runtime.artifact import save_model_dir

        state = self.full_state_dict() if self.cfg.run.save_final else None
        if self.folder is not None:
            done = self.last_eval if self.last_eval is not None and self.last_eval["step"] == self.step else None
            if state is not None:
                save_model_dir(self.out / "final", state, self.cfg.model, self.corpus.tokenizer_path)
                self._copy_chat_files(self.out / "final")
                if done is None:
                    result.eval_loss, result.unigram_loss = self.evaluate(state)
            if done is not None:  # eval_every evaluated these weights already
                result.eval_loss, result.unigram_loss = done["val_loss"], done["unigram_loss"]
            elif result.eval_loss is not None:
                self.folder.append({"step": self.step, "val_loss": result.eval_loss,  # as report/ reads it
                                    "unigram_loss": result.unigram_loss})
                self.log(f"held-out loss {result.eval_loss:.4f} nats/token (unigram baseline "
                         f"{result.unigram_loss:.4f}) on {self.cfg.run.eval_sequences} sequences")
            rows = result.metrics[1:] or result.metrics  # the first step warms up
            tokens = self.cfg.train.global_batch * self.cfg.train.seq_len
            tps = tokens * len(rows) / max(1e-9, sum(r["step_time_s"] for r in rows))  # all tokens / all step time
            self.folder.write_run_json({
                "status": "done", "steps": self.step, "seconds": seconds,
                "final_loss": result.losses[-1] if result.losses else None,
                "eval_loss": result.eval_loss, "unigram_loss": result.unigram_loss, "tokens_per_s": tps,
                "mfu": measure.mfu(tps, self.flops_per_token, self.peak)})
            if state is not None:
                self.log(f"wrote {self.out / 'final'}")
        self._barrier()

    def _copy_chat_files(self, final: Path) -> None:
        """final/ carries the chat template of the model it started from ([model] init) or of the chat data's
        tokenizer folder, so LoRA and generation render conversations from final/ as training did."""
        from trainscale.runtime.artifact import CHAT_FILES, copy_chat_files

        d = self.cfg.data
        for folder in (self.cfg.init, d.tokenizer):
            if folder is None:
                continue
            src = Path(folder) if Path(folder).is_dir() else Path(folder).parent
            if any((src / name).is_file() for name in CHAT_FILES):
                copy_chat_files(src, final)
                return

    def _run_info(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "layout": str(self.layout), "world_size": self.world,
                "backend": dist.get_backend(), "device": self.device.type,
                "model": self.cfg.model.model_dump(by_alias=True, exclude_none=True),
                "params": param_count(self.cfg.model), "local_params_rank0": self.local_params(),
                "flops_per_token": self.flops_per_token, "flop_convention": measure.FLOP_CONVENTION,
                "unigram_entropy": measure.unigram_entropy(self.unigram_counts()),
                "peak_flops": self.peak, "peak_source": self.peak_source, "micro_batch": self.micro,
                "microbatches": self.n_micro, "config": self.cfg.model_dump(mode="json", exclude={"model"}),
                "lr_schedule": {"kind": self.cfg.train.schedule, **self.horizon.extras()}}


def train(cfg: TrainConfig, layout: Layout | str | None = None, steps: int | None = None,
          out: str | Path | None = None, log: Callable[[str], None] = print, resume: bool = False,
          inject: str | None = None, extend: bool = False) -> RunResult:
    """Train under ``layout`` in the current process group (joined or created); -> per-step losses.
    ``out=None`` writes nothing (tests); otherwise ``out`` (default: the config's run.out) is the run folder.
    ``resume``: continue from the newest good checkpoint if there is one (else start; the Slurm script always
    passes it), to ``steps`` (default: the run's recorded total) on the run's own schedule; ``extend``: past it."""
    if layout is None or isinstance(layout, str):
        layout = Layout.parse(layout or cfg.run.layout or "")
    run_dir = Path(out) if out is not None else None
    return Trainer(cfg, layout, run_dir, log, resume=resume, faults=faults.parse_faults(inject)).run(steps, extend)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainscale.runtime.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layout", default=None, help="e.g. dp2,tp2,pp2 (default: the config's run.layout)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=None, help="run folder (default: the config's run.out)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint, if any")
    ap.add_argument("--extend", action="store_true", help="with --resume: go past the run's recorded total steps")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value (runtime/config.py parse_set)")
    ap.add_argument("--inject", default=None, help="faults, e.g. crash@step=7,rank=1 (runtime/job/faults.py)")
    ap.add_argument("--fallback-layout", default=None, help="the layout to use if an elastic job re-forms with a "
                    "world size the layout's own rule cannot serve (runtime/job/elastic.py)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    args = ap.parse_args(argv)

    def body() -> None:
        over = {k: v for k, v in (("steps", args.steps), ("compile", args.compile or None)) if v}
        from trainscale.runtime.init import resolved_config

        cfg = resolved_config(args.config, {"train": over} if over else None, sets=args.set)
        out = args.out or cfg.run.out
        layout = Layout.parse(args.layout or cfg.run.layout or "")
        world = int(os.environ.get("WORLD_SIZE", layout.world_size))
        if world != layout.world_size:  # torchrun re-formed an elastic job with another number of processes
            from trainscale.runtime.job.elastic import layout_for_world

            fallback = Layout.parse(args.fallback_layout) if args.fallback_layout else None
            layout, why = layout_for_world(cfg, layout, world, fallback)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"[elastic] layout {layout}: {why}", flush=True)
        train(cfg, layout, steps=args.steps, out=out, log=lambda m: print(m, flush=True), resume=args.resume,
              inject=args.inject, extend=args.extend)

    return runfolder.worker_main(body)


if __name__ == "__main__":
    exit_rank(main())  # not sys.exit: no interpreter finalization with gloo threads alive (mesh.exit_rank)
