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
     evaluates, every rank receives the value: runtime/evaluator.py); rank 0 writes the unsharded weights as
     RUN_DIR/final (runtime/artifact.py)

The loop (``Trainer.run``) only orders these: the metrics log (runtime/job/metrics.py), the checkpoint cadence
(runtime/job/checkpoint.SaveCadence) and the evaluator each decide when they act.

Run folder: config.toml, run.json (layout, world size, model, results, the unigram entropy of the training
tokens), metrics.jsonl (a line per step, held-out evaluation, checkpoint, attempt start and resume),
TensorBoard events and the optional sinks (runtime/job/tblog.py), profile/ ([profile] steps), tokenizer.json,
final/; its identity, lock and bookkeeping are runtime/job/runfolder.py's.

On the GPU, a step that does not log never waits for the device: the loss, the gradient norm (clipping is done on
the device) and the MoE numbers stay there until the next logging step reads them in one transfer
(runtime/job/metrics.py), the step time comes from CUDA events (runtime/measure.StepClock), the batch is copied
from pinned memory without blocking, and the Slurm save request (an all-reduce read back) is looked at every
min(log_every, ``SIGNAL_EVERY``) steps only. The exceptions, named: MoE layers read their routing counts (the
split sizes of the expert matmuls and all-to-alls are host integers), an asynchronous checkpoint in flight is
polled each step. AdamW is torch's fused kernel when every weight is on CUDA, its foreach kernels elsewhere.
Python's cyclic garbage collector is off in the loop and collects its young generations every ``GC_EVERY`` steps
(a full, unscheduled collection stalls every rank at a different step).
"""

from __future__ import annotations

import argparse
import gc
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
from trainscale.runtime import moe as moe_metrics
from trainscale.runtime.config import TrainConfig, check_layout
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.loader import TokenLoader
from trainscale.runtime.evaluator import Evaluator, document_args
from trainscale.runtime.job import faults, ranks, runfolder
from trainscale.runtime.job.checkpoint import CheckpointManager, SaveCadence, step_dir_name
from trainscale.runtime.job.faults import Fault, requeue_count, restart_count
from trainscale.runtime.job.metrics import Deferred, MetricsLog
from trainscale.runtime.job.slurm import mark_stopped
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

# Python's garbage collector during the loop: off, and a young-generation collection (gc.collect(1)) every this many
# steps, on every rank at the same step. torchtitan does the same, every 50 steps by default
# (torchtitan/tools/utils.py GarbageCollection, job config training.gc_freq = 50).
GC_EVERY = 50
# Under a batch script that asks for a checkpoint before its time limit (runtime/job/slurm.save_requested, one
# all-reduce read back): the request is looked at every min(log_every, this) steps (every rank at the same steps)
# and at the last step, so at most this many steps late; on the logging steps only when log_every <= this.
SIGNAL_EVERY = 5
MAX_PREDICTED_RANKS = 256  # the per-rank step-time prediction (stragglers) is made for worlds up to this size


@dataclass
class RunResult:
    losses: list[float]
    out: Path | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: float | None = None
    unigram_loss: float | None = None
    local_params: int = 0  # parameter elements this rank holds (its shards)


@dataclass
class Gradients:
    """The parameter lists a step's gradient handling treats apart, and the group whose replicas all-reduce their
    gradients (runtime/parallel/parallelize.gradient_group; None under zero1 and FSDP, which reduce their own,
    or with one replica)."""

    group: Any
    dense: list[torch.Tensor]
    experts: list[torch.Tensor]  # EP: routed experts, averaged over the ranks holding the same experts
    moe: list[torch.Tensor]  # every MoE layer's weights (summed over tp under SP)
    norm: list[torch.Tensor]  # what the clipping norm runs over


def _say(msg: str) -> None:
    """Print from any rank (fault messages come from the rank that fails)."""
    print(msg, flush=True)


class Trainer:
    """One rank of a training job: its mesh, data position, model stages with their optimizers, and the step
    that trains them (``train_step``). ``run`` is the loop; the parts around a step keep their own cadence: the
    metrics log (runtime/job/metrics.MetricsLog: metrics.jsonl, TensorBoard, the console and its ETA), the
    checkpoint saves (runtime/job/checkpoint.SaveCadence) and the held-out loss (runtime/evaluator.Evaluator).
    A checkpoint holds ``state_dict()`` (model and optimizer, sharded, for DCP) and ``extras()`` (this rank's
    plain state); a resumed loop starts at ``self.step``."""

    def __init__(self, cfg: TrainConfig, layout: Layout, out: Path | None = None, log: Callable[[str], None] = print,
                 resume: bool = False, faults: list[Fault] | None = None):
        self.cfg, self.layout, self.out = cfg, layout, out
        # torchrun restarted us after a failure, or Slurm requeued the job: continue
        self.resume = resume or restart_count() > 0 or requeue_count() > 0
        self.faults = faults or []
        check_layout(cfg, layout)
        check_sinks(cfg.run.sinks)
        if out is not None:  # read when a NCCL group is made: the flight recorder's dumps land in RUN/stacks
            for key, value in ranks.nccl_recorder_env(out).items():
                os.environ.setdefault(key, value)
        self.device = init_distributed(cfg.checkpoint.collective_timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = log if self.rank == 0 else (lambda _m: None)
        self.run_id, self._lock = self._bind_run_folder()
        self.folder = runfolder.RunFolder(out, self.resume) if out is not None and self.rank == 0 else None
        self.mesh: ParallelMesh = build_mesh(layout)
        torch.manual_seed(cfg.train.seed)
        self._data()
        self._model()
        self.step = 0
        # the LR schedule's length and the run's total: train.steps for a new run, a checkpoint's record on resume
        self.horizon = Horizon(cfg.train.steps, cfg.train.steps)
        self.resumed_from: int | None = None
        # called after the optimizer step, before the gradients are freed (runtime/probe/compare.py measures there)
        self.after_update: Callable[[Trainer], None] | None = None
        self.flops_per_token = measure.flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak, self.peak_source = measure.job_peak_flops(self.world)
        self.clock = measure.StepClock(self.device)
        self.evaluator = Evaluator(cfg, self.corpus, self.device, self.precision, self.log)
        self.profiler = measure.StepProfiler(cfg.profile.steps, cfg.profile.ranks, self.rank, out, self.device,
                                             self.log if self.rank == 0 else _say)
        self.metrics: MetricsLog | None = None  # run() opens one per attempt, and its checkpoint cadence
        self.beats: ranks.RankBeats | None = None  # with a run folder: own times, stragglers, hung steps' stacks
        self.watch: ranks.HangWatch | None = None
        self.iteration: Any = None  # the clock's mark at the start of the loop iteration
        self.saver: SaveCadence | None = None

    # ------------------------------------------------------------------ setup

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _data(self) -> None:
        """The corpus (rank 0 tokenises, or finds the cache / the prepared shards, then everyone reads it), this
        rank's loader and its sequence positions under CP. Packed documents kept apart (``document_mask``, chat
        data): batches carry positions, chat targets a mask."""
        cfg, t = self.cfg, self.cfg.train
        if self.rank == 0:
            corpus_for(cfg, log=self.log)
        self._barrier()
        self.corpus = corpus_for(cfg)
        if cfg.data.documents_apart and not hasattr(self.corpus, "flags"):
            raise TrainscaleError("data.document_mask needs a prepared corpus (data.files or data.tokenizer)")
        self.loader = TokenLoader(self.corpus.tokens("train"), t.seq_len, t.global_batch, self.mesh.dp_rank,
                                  self.layout.dp, t.seed, **document_args(self.corpus, "train",
                                                                          cfg.data.documents_apart))
        self.positions = local_positions(t.seq_len, self.layout.cp, self.mesh.cp_rank)

    def _model(self) -> None:
        """The model, whole and identical on every rank, then split and parallelized (or, from a Hugging Face
        folder, built empty, parallelized, and each rank's shards read from the files); its optimizers, and the
        parameter groups the gradient step treats apart."""
        cfg, layout = self.cfg, self.layout
        self.precision = resolve_precision(cfg.train.precision, self.device)
        self.compiled = compiled_blocks(cfg.train.compile, self.device)
        self.autocast = autocast_for(self.precision, layout, self.device)
        self.init_elements_read = 0
        self.parts = self._build_parts()
        self.params = [p for _, part in self.parts for p in part.parameters()]
        if cfg.init is not None:
            self.log(f"initialised from {cfg.init}: rank 0 read {self.init_elements_read:,} of the "
                     f"{param_count(cfg.model):,} weights (its shards)")
        # one AdamW per stage (elementwise, so the same math as one): each stage's state dict stands alone
        self.optimizers = [self._optimizer(part) for _, part in self.parts]
        self.n_micro = cfg.train.global_batch // layout.dp // layout.mb
        self.pipeline = Pipeline(self.parts, layout, self.mesh, self.device, self.n_micro) if layout.pp > 1 else None
        # a MoE's layers: the balance loss's gradient carries the LM loss's 1 / micro-batches (the pipeline
        # schedule divides the accumulated gradients by it instead); with EP the experts average apart
        self.moes = [m for _, part in self.parts for m in moe_layers(part)]
        for m in self.moes:
            m.aux_scale = 1.0 if self.pipeline is not None else 1.0 / self.n_micro
        experts = {id(p) for _, part in self.parts for p in expert_parameters(part)} if layout.ep > 1 else set()
        self.grads = Gradients(
            group=gradient_group(self.mesh),
            dense=[p for p in self.params if id(p) not in experts],
            experts=[p for p in self.params if id(p) in experts],
            moe=[p for m in self.moes for p in m.parameters()],
            # what the norm runs over: zero1's optimizer shards (each rank's reduced chunk), else the weights
            norm=[p for o in self.optimizers for p in o.shards] if layout.zero == 1 else self.params)

    def _optimizer(self, part: Transformer) -> torch.optim.Optimizer:
        """AdamW on the stage's weights, or under zero1 on this rank's shards of them (runtime/parallel/zero1.py):
        torch's fused kernel when every weight is a CUDA tensor (DTensors by their local shards' device), its
        foreach (multi-tensor) kernels elsewhere. The same math elementwise: on CPU foreach gives the bits the
        one-tensor loop gave."""
        t = self.cfg.train
        kw: dict[str, Any] = {"lr": lr_at(0, self.cfg), "betas": t.betas, "eps": 1e-8}
        if all(p.device.type == "cuda" for p in part.parameters()):
            kw["fused"] = True
        else:
            kw["foreach"] = True
        if self.layout.zero == 1:
            return Zero1AdamW(part, self.mesh, t.weight_decay, **kw)
        return torch.optim.AdamW(adamw_groups(list(part.parameters()), t.weight_decay), **kw)

    def _bind_run_folder(self) -> tuple[str | None, runfolder.RunLock | None]:
        """-> (run id, lock). Under `trainscale train` the CLI holds the lock and named the run
        (TRAINSCALE_RUN_ID): rank 0 checks the folder still belongs to it. Run directly, rank 0 locks and
        claims the folder itself. Every rank gets the same answer or the same one-sentence error."""
        root = runfolder.checkpoint_root(self.out, self.cfg.checkpoint.dir)
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
        """The model's stages this rank runs, parallelized. Built whole on the CPU and moved, or (``_on_meta``) on
        the meta device, parallelized, and each rank's shards allocated and filled: from ``[model] init``'s
        files, or by ``Transformer.init_weights``, which gives every element the value the whole CPU build gives."""
        spec, lo, seed, init = self.cfg.model, self.layout, self.cfg.train.seed, self.cfg.init
        on_meta = self._on_meta()
        model = build_model(spec, "meta" if on_meta else "cpu", seed=seed)
        if not on_meta:
            model.to(self.device)
        parts = split_model(model, lo, self.mesh.pp_rank) if lo.pp > 1 else [(0, model)]
        for _, part in parts:
            parallelize(part, self.mesh, lo, self.cfg.train.seq_len, self.precision, self.compiled)
            part.positions = part.positions.to(self.device)
            if on_meta:  # too big to hold whole on one GPU, or read from a file: allocate the shards only
                part.to_empty(device=self.device)
                if init is None:
                    part.init_weights(seed)
        if init is not None:
            from trainscale.runtime.init import load_init

            self.init_elements_read = load_init([part for _, part in parts], init, spec)
        return parts

    def _on_meta(self) -> bool:
        """Whether the model is built on the meta device: read from ``[model] init``, too big for a quarter of the
        GPU whole (fp32), or asked for (TRAINSCALE_META_INIT=1: the tests run that path on the CPU)."""
        if self.cfg.init is not None or os.environ.get("TRAINSCALE_META_INIT") == "1":
            return True
        return self.device.type == "cuda" and param_count(self.cfg.model) * 4 > 0.25 * (
            torch.cuda.get_device_properties(self.device).total_memory)

    # ------------------------------------------------------------------ one step

    def _learned_scale(self, targets: torch.Tensor) -> torch.Tensor:
        """dp x cp / the global batch's learned targets (those not IGNORE), counted over every rank: a rank's
        summed loss times this, averaged over the dp x cp replicas by the gradient reduction, is the sum over
        the whole global batch / its learned targets, whatever the layout. 0 when nothing is learned. A float32
        scalar on the device (computed in float64 as the host value was, then cast as a Python scalar is)."""
        count = (targets != IGNORE).sum().to(torch.float64).reshape(1).to(self.device)
        if self.world > 1:  # pp and cp are refused with documents: every rank is a dp or tp rank
            dist.all_reduce(count)
            count /= self.layout.tp  # the tp ranks of a dp rank read the same rows
        n = count.reshape(())
        # a division, as the host's was (a Python number over a tensor would be a reciprocal times the number)
        ratio = torch.full_like(n, float(self.layout.dp * self.layout.cp)) / torch.where(n > 0, n, torch.ones_like(n))
        return torch.where(n > 0, ratio, torch.zeros_like(ratio)).to(torch.float32)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
        """-> this rank's loss of the step (zero on pipeline stages without the head): the mean over its tokens,
        or with ``positions`` (documents kept apart) its summed loss over its learned targets x
        ``_learned_scale``. Without a pipeline, in ``local_batch / mb`` accumulation steps."""
        if positions is None and self.pipeline is not None:
            with self.autocast:
                loss = self.pipeline.step(inputs, targets)
            return loss if loss is not None else torch.zeros((), device=self.device)
        scale = self._learned_scale(targets) if positions is not None else None
        model, mb = self.parts[0][1], self.layout.mb
        total = torch.zeros((), device=self.device)
        for i in range(self.n_micro):
            rows = slice(i * mb, (i + 1) * mb)
            x, y = inputs[rows], targets[rows]
            if uses_fsdp(self.layout):
                # FSDP2 reduce-scatters every micro-batch, so a rank accumulates only its shard of the gradients
                # (turning the sync off until the last one would hold the whole fp32 gradient of every unit: +4
                # bytes per parameter, 30 GiB at 8B; torchtitan accumulates the same way); HSDP's all-reduce
                # over the replicas once, at the last micro-batch
                model.set_requires_all_reduce(i == self.n_micro - 1)
            with self.autocast:
                if positions is None:
                    loss = lm_loss(model(x), y) / self.n_micro
                else:
                    loss = lm_loss_sum(model(x, positions=positions[rows]), y) * scale
            loss.backward()
            total += loss.detach()
        return total

    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the next global batch -> its metrics row (runtime/job/metrics.MetricsLog)."""
        t0 = self.clock.start()
        lr = lr_at(self.step, self.cfg, self.horizon.schedule_steps)
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr
        inputs, targets, *positions = self.loader.next_batch()  # positions: documents kept apart
        if self.layout.cp > 1:
            inputs, targets = shard_sequence(inputs, self.positions), shard_sequence(targets, self.positions)
        for m in self.moes:
            m.stats.reset()
        loss = self._forward_backward(self._upload(inputs), self._upload(targets),
                                      self._upload(positions[0]) if positions else None)
        # arrived at the gradient synchronisation (a step outside ``run``'s loop has no own time)
        own = None if self.iteration is None else self.clock.stop(self.iteration)
        lo, grads = self.layout, self.grads
        if self.moes and lo.tp > 1 and lo.sp:
            sum_moe_gradients_over_tp(grads.moe, self.mesh)
        if grads.group is not None:
            allreduce_gradients(grads.dense, grads.group)
            if grads.experts:  # summed over the ranks holding the same experts, divided by all dp x cp
                allreduce_gradients(grads.experts, self.mesh.group("expert_dp"), divide=lo.dp * lo.cp)
        settle_gradient_placements(self.params)  # each rank keeps only its shard of every gradient
        if self.pipeline is not None:  # a tied embedding: the first and last stages' gradients summed
            self.pipeline.tied.sum_gradients()
        for opt in self.optimizers:
            if isinstance(opt, Zero1AdamW):  # reduce-scatter: each rank's chunk of the averaged gradients
                opt.reduce_gradients()
        grad_norm = clip_grad_norm(grads.norm, self.cfg.train.grad_clip, self.mesh)
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
        dt = self.clock.stop(t0)  # seconds (CPU), or a function of the step's CUDA events
        self.step += 1
        # device values stay there (Deferred) until the next logging step; throughput follows from the step time
        # then (_complete_row): no host sync on this step
        row = {"step": self.step, "loss": Deferred(loss), "tokens_per_s": None, "flops_per_s": None, "mfu": None,
               "flop_convention": measure.FLOP_CONVENTION_NAME, "lr": lr, "grad_norm": Deferred(grad_norm),
               "step_time_s": dt if isinstance(dt, float) else Deferred(None, dt),
               "memory_bytes": measure.peak_memory_bytes(self.device),
               "own_s": own if own is None or isinstance(own, float) else Deferred(None, own)}
        if self.cfg.model.is_moe:
            got = moe_metrics.step_metrics(self.parts, self.cfg.model, self.layout, self.n_micro)
            row.update({k: v if v is None else Deferred(*v) for k, v in got.items()})
        return row

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host batch on the device: from pinned memory without blocking on CUDA (a pageable copy would wait
        for the GPU to catch up), as it is elsewhere."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _complete_row(self, row: dict[str, Any]) -> None:
        """A step row once its values are read back (runtime/job/metrics.MetricsLog): throughput from its time."""
        dt = row["step_time_s"]
        tps = self.cfg.train.global_batch * self.cfg.train.seq_len / dt
        row.update({"tokens_per_s": tps, "flops_per_s": tps * self.flops_per_token,
                    "mfu": measure.mfu(tps, self.flops_per_token, self.peak)})
        if "a2a_share" in row:
            row["a2a_share"] = row["a2a_s"] / dt if dt > 0 else 0.0

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
        return CheckpointManager(runfolder.checkpoint_root(self.out, c.dir), keep=c.keep, async_save=c.async_save,
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
        steps = self._start(steps, extend)
        stop = False  # the scheduler's early signal ended this attempt (the job requeues itself)
        collecting = gc.isenabled()
        gc.disable()  # collected every GC_EVERY steps instead (torchtitan's GarbageCollection)
        gc.collect(1)
        try:
            while self.step < steps and not stop:
                self.iteration = self.clock.start()  # a rank's own time runs from here (runtime/job/ranks.py)
                if self.watch is not None:
                    self.watch.arm(self.step + 1)
                faults.at_step(self.faults, self.step + 1, self.rank, _say)
                self.profiler.before(self.step + 1)
                row = self.train_step()
                self.profiler.after(self.step, last=self.step == steps)
                self.metrics.step(row)
                if self.watch is not None:
                    self.watch.disarm()
                if self.evaluator.due(self.step):
                    self.evaluator.periodic(self.step, self.full_state_dict, self.metrics)
                if self.saver is not None:
                    stop = self.saver.after_step(self.step, steps, self.state_dict, self.extras,
                                                 self.metrics.checkpoint, self.metrics.flush)
                if self.step % GC_EVERY == 0:
                    gc.collect(1)
        finally:
            if collecting:
                gc.enable()
        return self._end(stop)

    def _start(self, steps: int | None, extend: bool) -> int:
        """Before the loop: resume or start (-> the step to stop at), the run folder's files, the metrics log and
        the checkpoint cadence of this attempt."""
        mgr = self._checkpoints()
        # before the run folder is touched: a refused resume leaves it as it was
        stop = self._resume(mgr, steps, extend) if mgr is not None and self.resume else None
        if stop is None:  # a new run: its schedule is laid out for train.steps
            stop = self.cfg.train.steps if steps is None else steps
            self.horizon = Horizon(self.cfg.train.steps, max(stop, self.cfg.train.steps))
        if self.folder is not None:
            self.folder.start(self.cfg.to_toml(), self.corpus.tokenizer_path, self._run_info())
            if self.resumed_from is not None:  # the console follower prints this first, then only the new steps
                self.folder.log({"event": "resumed", "step": self.resumed_from, "wall": time.time(),
                                 "attempt": restart_count(), "requeue": requeue_count(),
                                 **self.horizon.extras()})
        self.log(f"training {self.cfg.model.name} ({param_count(self.cfg.model) / 1e6:.2f}M params) on "
                 f"{self.world} process(es), layout {self.layout}, {stop} steps, "
                 f"{self.cfg.train.global_batch} x {self.cfg.train.seq_len} tokens per step")
        tb = None
        if self.folder is not None:
            tb = open_metric_log(self.out, self.step if self.resume else None, self.log, self.cfg.run.sinks,
                                 self.cfg.name, self.run_id)
        # injected faults (tests) kill a rank between logging steps: then every step's row is read at once
        r = self.cfg.run
        if self.out is not None:
            own, step = self._predicted_seconds()
            self.beats = ranks.RankBeats(self.out, self.rank, self.world, r.straggler_margin, own, self.log)
            self.watch = ranks.HangWatch(self.out, self.rank, r.hang_factor, r.hang_floor_s, step, self.log)
        self.metrics = MetricsLog(self.folder, tb, self.log, self.cfg.run.log_every, stop,
                                  read_every=1 if self.faults else None, complete=self._complete_row,
                                  beats=self.beats)
        c = self.cfg.checkpoint
        self.saver = None if mgr is None else SaveCadence(mgr, c.every_steps, c.every_seconds, self.device, self.log,
                                                          signal_every=min(self.cfg.run.log_every, SIGNAL_EVERY))
        return stop

    def _end(self, stopped: bool) -> RunResult:
        """After the loop: the last save committed; a finished run's final weights, held-out loss, run.json and
        goodput (a stopped attempt leaves the run to its requeue); the metrics log and the folder's lock closed."""
        m = self.metrics
        m.flush()  # the rows since the last logging step
        if self.saver is not None:
            self.saver.manager.finish()
        result = RunResult(m.losses, self.out, m.rows, local_params=self.local_params())
        if stopped and self.rank == 0:
            mark_stopped(self.step)
        finished = self.out is not None and not stopped
        if finished:
            self._finish(result, m.seconds())
        elif (done := self.evaluator.at(self.step)) is not None:
            result.eval_loss, result.unigram_loss = done
        m.summary({"eval_loss": result.eval_loss, "unigram_loss": result.unigram_loss} if finished else None,
                  self.step)
        for part in (self.beats, self.watch):
            if part is not None:
                part.close()
        if self._lock is not None:
            self._lock.release()
        return result

    def _predicted_seconds(self) -> tuple[list[float] | None, float | None]:
        """(each rank's predicted own seconds per step, this rank's predicted step) on this machine's hardware
        profile (``trainscale calibrate``'s, runtime/probe/calibrate), or (None, None) without one."""
        from trainscale.estimate.measured.machine import machine_from_profile
        from trainscale.estimate.measured.rank import rank_step_time
        from trainscale.estimate.profile import read_profile
        path = measure.default_profile_path()
        if not path.is_file() or self.world > MAX_PREDICTED_RANKS:
            return None, None
        try:
            mach = machine_from_profile(read_profile(path), self.world)
            m, t, lo = self.cfg.model, self.cfg.train, self.layout
            got = [rank_step_time(m, lo, r, t.seq_len, t.global_batch, mach, lo.mb) for r in range(self.world)]
        except TrainscaleError as e:
            self.log(f"[straggler] the hardware profile {path} does not predict this run ({e}): ranks are compared "
                     f"with their peers only")
            return None, None
        return [g["compute"] for g in got], got[self.rank]["total"]

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

    def _finish(self, result: RunResult, seconds: float) -> None:
        """A finished run: the unsharded weights as RUN/final (``[run] save_final``) and their held-out loss, and
        run.json's results (rank 0 writes; every rank takes part in the gather)."""
        from trainscale.runtime.artifact import save_model_dir

        state = self.full_state_dict() if self.cfg.run.save_final else None
        if self.folder is not None:
            if state is not None:
                save_model_dir(self.out / "final", state, self.cfg.model, self.corpus.tokenizer_path)
                self._copy_chat_files(self.out / "final")
            result.eval_loss, result.unigram_loss = self.evaluator.final(self.step, state, self.metrics)
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
                "unigram_entropy": measure.unigram_entropy(self.evaluator.unigram_counts()),
                "peak_flops": self.peak, "peak_source": self.peak_source, "micro_batch": self.layout.mb,
                "microbatches": self.n_micro, "config": self.cfg.model_dump(mode="json", exclude={"model"}),
                "lr_schedule": {"kind": self.cfg.train.schedule, **self.horizon.extras()}}


def compiled_blocks(asked: bool | None, device: torch.device) -> bool:
    """``[train] compile``: as asked, else (unset) on CUDA, the fast path there (torchtitan compiles each block;
    36.7 vs 20.8 % MFU measured on one H200, benchmarks/RESULTS.md), and off on CPU, where compiling costs more
    than it saves on the small models trained here."""
    return asked if asked is not None else device.type == "cuda"


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
