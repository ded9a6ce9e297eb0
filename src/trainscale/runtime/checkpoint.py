"""Checkpoints that survive crashes: torch.distributed.checkpoint (DCP) underneath, an atomic commit
on top.

    ROOT/.tmp-step-00000007/   being written (DCP shards + per-rank extras); never read
    ROOT/step-00000007/        committed: renamed from .tmp only after every rank finished and
                               rank 0 wrote manifest.json with the size and sha256 of every file

``latest`` is the newest step folder whose manifest verifies; a corrupt or truncated one is
reported and skipped for the previous good one. A kill at any moment leaves either the old set of
committed checkpoints or the old set plus the new one, never a damaged one. DCP stores each tensor
by its fully-qualified name and global shape, so a checkpoint saved under one layout (FSDP, TP,
PP) loads under another (resharding): ``torch.distributed.checkpoint.state_dict`` maps model and
optimizer state to and from those names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainscale.errors import TrainscaleError

MANIFEST = "manifest.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def verify(folder: Path, full: bool = True) -> str | None:
    """None if the checkpoint folder is complete and intact, else the reason it is not."""
    mpath = folder / MANIFEST
    if not mpath.exists():
        return "no manifest"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return "manifest unreadable"
    for name, meta in files.items():
        p = folder / name
        if not p.exists():
            return f"{name} missing"
        if p.stat().st_size != meta["bytes"]:
            return f"{name} truncated ({p.stat().st_size} of {meta['bytes']} bytes)"
        if full and _sha256(p) != meta["sha256"]:
            return f"{name} checksum mismatch"
    return None


def committed_steps(root: Path) -> list[int]:
    out = []
    for p in root.glob("step-*"):
        try:
            out.append(int(p.name.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(out)


def latest_good(root: str | Path, log: Callable[[str], None] = print) -> tuple[int, Path] | None:
    """Newest committed checkpoint that verifies, announcing each one skipped and why."""
    root = Path(root)
    for step in reversed(committed_steps(root)):
        folder = root / step_dir_name(step)
        why = verify(folder)
        if why is None:
            return step, folder
        log(f"checkpoint {folder} is damaged ({why}); falling back to the previous one")
    return None


class CheckpointManager:
    """Save every N steps (or M seconds), optionally asynchronously; keep the last K."""

    def __init__(self, root: str | Path, keep: int = 3, async_save: bool = False,
                 before_commit: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.keep = keep
        self.async_save = async_save and dist.is_initialized()
        self.before_commit = before_commit  # fault-injection hook: runs on rank 0 just before the commit
        self.pending: tuple[int, Path, Any] | None = None
        self.save_seconds = 0.0  # time the training loop was blocked by saving
        self.saves = 0
        self._group = dist.new_group(backend="gloo") if self.async_save else None
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-step-*"):  # a save that a crash interrupted
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], extras: dict[str, Any]) -> None:
        """Write ``state`` (DCP: sharded tensors by name) and this rank's ``extras`` (RNG, loader
        position, ...) for ``step``; commit when complete."""
        t0 = time.perf_counter()
        self.finish()  # at most one save in flight
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if _rank() == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        _barrier()
        torch.save(extras, tmp / f"extras-rank{_rank():05d}.pt")
        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            self.pending = (step, tmp, fut)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self.pending = (step, tmp, None)
            self.finish()
        self.save_seconds += time.perf_counter() - t0
        self.saves += 1

    def poll(self) -> None:
        """Commit an asynchronous save once every rank has finished writing (cheap; call each step)."""
        if self.pending is None or self.pending[2] is None:
            return
        done = torch.tensor([1 if self.pending[2].done() else 0])
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight, then commit it (rank 0 writes the manifest and renames)."""
        if self.pending is None:
            return
        step, tmp, fut = self.pending
        self.pending = None
        if fut is not None:
            fut.result()
        _barrier()
        if _rank() == 0:
            if self.before_commit is not None:
                self.before_commit(step)
            files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = {"step": step, "world_size": _world(), "time": time.time(), "files": files}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            final = self.root / step_dir_name(step)
            if final.exists():  # re-saving a step after a restart: the new one replaces it
                shutil.rmtree(final)
            os.rename(tmp, final)  # atomic on POSIX: the checkpoint appears whole or not at all
            self._retain()
        _barrier()

    def _retain(self) -> None:
        steps = committed_steps(self.root)
        for old in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(self.root / step_dir_name(old), ignore_errors=True)

    # ------------------------------------------------------------------ load

    def load(self, state: dict[str, Any], log: Callable[[str], None] = print) -> tuple[int, dict[str, Any]] | None:
        """Load the newest good checkpoint into ``state`` in place; -> (step, this rank's extras)."""
        found = latest_good(self.root, log=log if _rank() == 0 else (lambda _m: None))
        # every rank must agree on the folder (rank 0 decides)
        obj = [found]
        if dist.is_initialized():
            dist.broadcast_object_list(obj, src=0)
        found = obj[0]
        if found is None:
            return None
        step, folder = found
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except Exception as e:  # DCP raises CheckpointException and others
            raise TrainscaleError(f"checkpoint {folder} cannot be loaded into this model: {e}") from None
        mine = folder / f"extras-rank{_rank():05d}.pt"
        extras_path = mine if mine.exists() else folder / "extras-rank00000.pt"
        extras = torch.load(extras_path, weights_only=False)
        return step, extras
