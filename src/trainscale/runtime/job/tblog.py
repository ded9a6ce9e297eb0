"""TensorBoard event files for a run, written by rank 0 into the run folder beside metrics.jsonl, so that
``tensorboard --logdir runs`` shows every run by its folder name; and the optional sinks beside it
(``[run] sinks``): MLflow's file store in RUN/mlruns, W&B in offline mode in RUN/wandb.

Per step: train/loss, train/lr, train/grad_norm, perf/tokens_per_s, perf/mfu, perf/step_time_s and
memory/peak_bytes (the device's peak allocation on a GPU, the process's peak resident set on CPU); a MoE run
adds moe/aux_loss, moe/a2a_s, moe/a2a_share and moe/layer{i}/expert{e} (tokens routed per expert). Every
``[train] eval_every`` steps: eval/val_loss and eval/unigram_loss. At the end: job/goodput (useful step time /
wall time) and its parts, and the final eval/val_loss against eval/unigram_loss.

A resumed run continues after the step N its checkpoint holds: ``SummaryWriter(purge_step=N + 1)`` writes a
SessionLog START at N + 1, and TensorBoard's reader then drops every event a crashed attempt wrote at steps
>= N + 1 (they are run again), keeping steps 1..N (torch.utils.tensorboard.SummaryWriter's ``purge_step``;
tensorboard's EventAccumulator purges on a START session log). Purging at N itself lost step N's point
on every resume. MLflow and W&B keep what they were given: a resumed run's re-run steps appear twice there
(MLflow, as a metric's history) or are dropped as out of order (W&B); metrics.jsonl and TensorBoard are the
record."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError

STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
             "memory_bytes": "memory/peak_bytes", "moe_aux_loss": "moe/aux_loss", "a2a_s": "moe/a2a_s",
             "a2a_share": "moe/a2a_share"}
EVAL_TAGS = {"val_loss": "eval/val_loss", "unigram_loss": "eval/unigram_loss"}
END_TAGS = {"goodput": "job/goodput", "useful_step_s": "job/useful_step_s", "wall_s": "job/wall_s",
            "checkpoint_s": "job/checkpoint_s", "restarts": "job/restarts", "eval_loss": "eval/val_loss",
            "unigram_loss": "eval/unigram_loss"}
SINK_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


def purge_step(resume_step: int | None) -> int | None:
    """The first step a resumed attempt writes again: the checkpoint's step N was completed, N + 1 was not."""
    return None if resume_step is None else resume_step + 1


class TensorBoardLog:
    """One SummaryWriter over the run folder (rank 0 only; other ranks make none)."""

    def __init__(self, folder: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if resume_step is None:  # a fresh run in a reused folder: the old run's curves are not this one's
            for old in Path(folder).glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step(resume_step), flush_secs=10)
        self.eval_steps: set[int] = set()

    def step(self, row: dict[str, Any]) -> None:
        for key, tag in STEP_TAGS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(tag, float(row[key]), int(row["step"]))
        for layer, counts in (row.get("expert_tokens") or {}).items():
            for e, n in enumerate(counts):
                self.writer.add_scalar(f"moe/layer{layer}/expert{e}", float(n), int(row["step"]))

    def eval(self, row: dict[str, Any]) -> None:
        for key, tag in EVAL_TAGS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(tag, float(row[key]), int(row["step"]))
        self.eval_steps.add(int(row["step"]))

    def summary(self, values: dict[str, Any], step: int) -> None:
        for key, tag in END_TAGS.items():
            if tag.startswith("eval/") and step in self.eval_steps:
                continue  # eval_every already wrote this step's held-out loss
            if values.get(key) is not None:
                self.writer.add_scalar(tag, float(values[key]), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def check_sinks(sinks: tuple[str, ...]) -> None:
    """Every rank, before anything starts: a sink whose package is missing is one sentence."""
    for sink in sinks:
        if importlib.util.find_spec(SINK_PACKAGES[sink]) is None:
            raise TrainscaleError(f"[run] sinks names {sink}, but the {SINK_PACKAGES[sink]} package is not installed "
                                  f"(pip install {'mlflow-skinny' if sink == 'mlflow' else 'wandb'}, or drop it)")


class MLflowSink:
    """MLflow's file store in RUN/mlruns (``mlflow ui --backend-store-uri RUN/mlruns``); a resumed run continues
    the same MLflow run (its id kept in RUN/mlflow_run_id)."""

    def __init__(self, folder: Path, name: str, resume: bool) -> None:
        import os

        # MLflow 3 keeps the file store in maintenance mode and refuses it unless opted in; a run folder wants
        # plain files (no database server), so this process opts in
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri((Path(folder) / "mlruns").resolve().as_uri())
        id_file = Path(folder) / "mlflow_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else name)
        id_file.write_text(self.run.info.run_id)

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbSink:
    """W&B in offline mode (nothing leaves the machine; ``wandb sync RUN/wandb/offline-run-*`` uploads later); the
    run's id is trainscale's run id, so a resumed run continues it."""

    def __init__(self, folder: Path, name: str, run_id: str | None) -> None:
        import wandb

        self.run = wandb.init(mode="offline", dir=str(folder), name=name, id=run_id, resume="allow")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricLog:
    """TensorBoard (when installed) and the configured sinks, fed the same rows."""

    def __init__(self, tb: TensorBoardLog | None, sinks: list[Any]) -> None:
        self.tb, self.sinks = tb, sinks

    def step(self, row: dict[str, Any]) -> None:
        if self.tb is not None:
            self.tb.step(row)
        self._sinks({tag: row.get(key) for key, tag in STEP_TAGS.items()}, int(row["step"]))

    def eval(self, row: dict[str, Any]) -> None:
        if self.tb is not None:
            self.tb.eval(row)
        self._sinks({tag: row.get(key) for key, tag in EVAL_TAGS.items()}, int(row["step"]))

    def straggler(self, row: dict[str, Any]) -> None:
        """A rank named a straggler (runtime/job/ranks.py): its own seconds per step, under its rank's tag."""
        if self.tb is not None:
            self.tb.writer.add_scalar(f"stragglers/rank{row['rank']}_own_s", float(row["own_s"]), int(row["step"]))
        self._sinks({f"stragglers/rank{row['rank']}_own_s": row["own_s"]}, int(row["step"]))

    def summary(self, values: dict[str, Any], step: int) -> None:
        if self.tb is not None:
            self.tb.summary(values, step)
        self._sinks({tag: values.get(key) for key, tag in END_TAGS.items()}, step)

    def flush(self) -> None:
        """At each checkpoint: the events up to its step reach the disk, so a kill loses none that a resume
        will not write again (the writer otherwise flushes every 10 s)."""
        if self.tb is not None:
            self.tb.writer.flush()

    def _sinks(self, values: dict[str, Any], step: int) -> None:
        got = {k: float(v) for k, v in values.items() if v is not None}
        for s in self.sinks:
            if got:
                s.log(got, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        for s in self.sinks:
            s.close()


def open_tensorboard(folder: Path, resume_step: int | None, log) -> TensorBoardLog | None:
    """A TensorBoardLog, or None (said once) where the tensorboard package is missing."""
    try:
        return TensorBoardLog(folder, resume_step)
    except ImportError:
        log("tensorboard is not installed (pip install 'trainscale[runtime]'): no TensorBoard event files")
        return None


def open_metric_log(folder: Path, resume_step: int | None, log, sinks: tuple[str, ...] = (), name: str = "run",
                    run_id: str | None = None) -> MetricLog:
    """TensorBoard plus ``sinks`` (checked installed by ``check_sinks`` before the job started)."""
    opened: list[Any] = []
    for sink in sinks:
        opened.append(MLflowSink(folder, name, resume_step is not None) if sink == "mlflow"
                      else WandbSink(folder, name, run_id))
        log(f"metrics also go to {sink} ({'RUN/mlruns, file store' if sink == 'mlflow' else 'RUN/wandb, offline'})")
    return MetricLog(open_tensorboard(folder, resume_step, log), opened)
