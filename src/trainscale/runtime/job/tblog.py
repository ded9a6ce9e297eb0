"""TensorBoard event files for a run, written by rank 0 into the run folder beside metrics.jsonl, so that
``tensorboard --logdir runs`` shows every run by its folder name.

Per step: train/loss, train/lr, train/grad_norm, perf/tokens_per_s, perf/mfu, perf/step_time_s and
memory/peak_bytes (the device's peak allocation on a GPU, the process's peak resident set on CPU); a MoE run
adds moe/aux_loss, moe/a2a_s, moe/a2a_share and moe/layer{i}/expert{e} (tokens routed per expert). At the
end: job/goodput (useful step time / wall time) and its parts, and eval/val_loss against eval/unigram_loss.
A resumed run passes ``purge_step``: TensorBoard then drops the events a crashed attempt wrote past the
step the run resumed from, as metrics.jsonl's readers do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
             "memory_bytes": "memory/peak_bytes", "moe_aux_loss": "moe/aux_loss", "a2a_s": "moe/a2a_s",
             "a2a_share": "moe/a2a_share"}
END_TAGS = {"goodput": "job/goodput", "useful_step_s": "job/useful_step_s", "wall_s": "job/wall_s",
            "checkpoint_s": "job/checkpoint_s", "restarts": "job/restarts", "eval_loss": "eval/val_loss",
            "unigram_loss": "eval/unigram_loss"}


class TensorBoardLog:
    """One SummaryWriter over the run folder (rank 0 only; other ranks make none)."""

    def __init__(self, folder: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if resume_step is None:  # a fresh run in a reused folder: the old run's curves are not this one's
            for old in Path(folder).glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=resume_step, flush_secs=10)

    def step(self, row: dict[str, Any]) -> None:
        for key, tag in STEP_TAGS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(tag, float(row[key]), int(row["step"]))
        for layer, counts in (row.get("expert_tokens") or {}).items():
            for e, n in enumerate(counts):
                self.writer.add_scalar(f"moe/layer{layer}/expert{e}", float(n), int(row["step"]))

    def summary(self, values: dict[str, Any], step: int) -> None:
        for key, tag in END_TAGS.items():
            if values.get(key) is not None:
                self.writer.add_scalar(tag, float(values[key]), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def open_tensorboard(folder: Path, resume_step: int | None, log) -> TensorBoardLog | None:
    """A TensorBoardLog, or None (said once) where the tensorboard package is missing."""
    try:
        return TensorBoardLog(folder, resume_step)
    except ImportError:
        log("tensorboard is not installed (pip install 'trainscale[runtime]'): no TensorBoard event files")
        return None
