"""Checkpoints that survive crashes: torch.distributed.checkpoint (DCP) underneath, an atomic commit
on top.

    ROOT/.tmp-step-00000007/   being written (DCP shards + per-rank extras); never read
    ROOT/step-00000007/        committed: renamed from .tmp only after every rank finished and
                               rank 0 wrote manifest.json with the size and digest of every file

Each rank digests the files it wrote itself (its DCP shard file and extras: xxHash's XXH3-128, an integrity check
at memory speed where re-reading for sha256 cost a quarter of the save; manifests of earlier versions carry sha256
and still verify) into a small ``digest-rankNNNNN.json``; rank 0 folds them into the manifest and digests only
its own files and DCP's ``.metadata``, so no rank re-reads the whole checkpoint.

``latest`` is the newest step folder whose manifest verifies; a corrupt or truncated one is
reported and skipped for the previous good one. The manifest names the run that wrote it
(``run_id``): a checkpoint of another run is never loaded.

Reading a checkpoint never runs code, whoever made the folder (checkpoints are files people copy
and share): the per-rank extras are JSON (the RNG state as base64 bytes), DCP's pickled
``.metadata`` goes through an unpickler that knows only DCP's own metadata classes, torch sizes and
dtypes, the files it points to must lie in the folder, and DCP's non-tensor values are read with
``torch.load(weights_only=True)``. Anything else is refused in one sentence.

A kill at any moment leaves either the old set of committed checkpoints or the old set plus the new
one, never a damaged one. DCP stores each tensor by its fully-qualified name and global shape, so a
checkpoint saved under one layout (zero0-3, TP, PP) loads under another (resharding):
``torch.distributed.checkpoint.state_dict`` maps model and optimizer state to and from those names (zero1's
optimizer state has FSDP2's names, shapes and placements: runtime/parallel/zero1.py).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.runtime.collectives import reduce_host
from trainscale.safeio import read_bytes

MANIFEST = "manifest.json"
METADATA = ".metadata"
MAX_JSON_BYTES = 64 << 20  # a manifest or extras file larger than this is not one we wrote


def _fail_sentence(e: BaseException) -> str:
    """The one sentence that caused ``e``: DCP's CheckpointException (a BaseException holding each
    rank's failure) is reduced to its first rank's exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_fail_sentence(inner)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f" ({e.filename})" if e.filename else "")
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _disk_error(e: BaseException) -> OSError | None:
    """The storage failure (full disk, permissions) behind a failed save, which a restart would repeat;
    None for a peer that died mid-save (a communication error: the job fails and restarts). DCP
    gathers every rank's exception; a full disk shows on some ranks as torch.save's own RuntimeError,
    so one rank's OSError is enough."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for _, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, BaseException) and (found := _disk_error(inner)) is not None:
                return found
        return None
    if isinstance(e, OSError) and not isinstance(e, ConnectionError):
        return e
    return None


def _full_disk(root: Path, e: BaseException) -> OSError | None:
    """A full filesystem that torch reported only as its zip writer's own RuntimeError ("unexpected pos",
    "PytorchStreamWriter failed writing file"): when a write failed and the checkpoint filesystem has less
    than 1 MiB left, the disk is full (ENOSPC), whatever the message said."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    if free >= 1 << 20:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{free:,} bytes free in {root}")


class CheckpointSaveError(JobFailed):
    """A save failed (disk full, permissions): the job fails (exit 1); the last committed checkpoint stays."""


# ------------------------------------------------------------------ safe formats

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
      ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
      ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle, with only DCP's own metadata classes (and torch sizes/dtypes) allowed."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which DCP's metadata never does")


def read_metadata(folder: Path) -> Any:
    """DCP's ``Metadata`` of a checkpoint folder, read without running code; the files it points to
    must be plain names in the folder. A TrainscaleError (one sentence) otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / METADATA
    data = _read_regular(path, "checkpoint metadata")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001  (any malformed pickle is the same refusal)
        raise TrainscaleError(f"checkpoint {folder} is refused: its {METADATA} is not DCP metadata ({e})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise TrainscaleError(f"checkpoint {folder} is refused: its {METADATA} is not DCP metadata")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise TrainscaleError(f"checkpoint {folder} is refused: its {METADATA} has no storage table")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not _plain_name(rel):
            raise TrainscaleError(f"checkpoint {folder} is refused: its {METADATA} points outside the folder "
                                  f"({rel!r})")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0) or getattr(info, "transform_descriptors", None):
            raise TrainscaleError(f"checkpoint {folder} is refused: its {METADATA} has a malformed entry for {rel}")
    return md


def _plain_name(name: Any) -> bool:
    """A file name with no folder part: it cannot point outside the folder it is listed in."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def _read_regular(path: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file (never a FIFO, device or link out of the folder), bounded in size."""
    return read_bytes(path, what, limit, follow_links=False)


def _encode(obj: Any) -> Any:
    """Extras to JSON: uint8 tensors (RNG states) as base64 bytes; everything else must already be JSON."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype != torch.uint8 or obj.ndim != 1:
            raise TypeError("checkpoint extras hold only JSON values and 1-D uint8 tensors (RNG states)")
        return {"__uint8__": base64.b64encode(bytes(obj.tolist())).decode()}
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__uint8__"} and isinstance(obj["__uint8__"], str):
            raw = base64.b64decode(obj["__uint8__"], validate=True)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def write_extras(path: Path, extras: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(_encode(extras), f)
        f.flush()
        os.fsync(f.fileno())


def read_extras(path: Path) -> dict[str, Any]:
    """This rank's extras (JSON); refused in one sentence if malformed."""
    data = _read_regular(path, "checkpoint extras", MAX_JSON_BYTES)
    try:
        got = _decode(json.loads(data))
    except (ValueError, TypeError) as e:
        raise TrainscaleError(f"checkpoint extras {path} are not valid JSON ({e})") from None
    if not isinstance(got, dict) or not isinstance(got.get("step"), int) or got["step"] < 0:
        raise TrainscaleError(f"checkpoint extras {path} lack a step count")
    return got


def _safe_reader(folder: Path):
    """DCP's FileSystemReader, with ``.metadata`` read by the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = read_metadata(folder)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(str(folder))


def _safe_planner():
    """DCP's default load planner, with non-tensor values read by ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


DIGEST = "xxh3_128"  # the manifest's key for a file's digest (older manifests: "sha256")
DIGEST_FILE = "digest-rank{rank:05d}.json"  # a rank's digests of the files it wrote, folded into the manifest


def _hash_file(path: Path, h: Any) -> str:
    """The hex digest of a file's bytes, read in 4 MiB chunks, with the hash object ``h``."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _xxh3(path: Path) -> str:
    import xxhash

    return _hash_file(path, xxhash.xxh3_128())


def _digest_matches(path: Path, meta: dict[str, Any]) -> bool:
    if DIGEST in meta:
        return _xxh3(path) == meta[DIGEST]
    return _hash_file(path, hashlib.sha256()) == meta["sha256"]  # a manifest of an earlier version


def _own_files(tmp: Path, rank: int) -> list[Path]:
    """The files ``rank`` wrote into a checkpoint being saved: DCP's ``__RANK_N.distcp`` and its extras."""
    return sorted(p for p in tmp.iterdir() if p.is_file() and (
        p.name.startswith(f"__{rank}_") or p.name == f"extras-rank{rank:05d}.json"))


def digest_own_files(tmp: Path, rank: int) -> None:
    """This rank's digests of the files it wrote (after its write finished), for rank 0's manifest."""
    got = {p.name: {"bytes": p.stat().st_size, DIGEST: _xxh3(p)} for p in _own_files(tmp, rank)}
    path = tmp / DIGEST_FILE.format(rank=rank)
    with open(path, "w") as f:
        json.dump(got, f)


def dcp_writer(folder: Path) -> Any:
    """DCP's file writer for one save into ``folder``."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(str(folder))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for shape: file names confined to the folder."""
    try:
        manifest = json.loads(_read_regular(folder / MANIFEST, "checkpoint manifest", MAX_JSON_BYTES))
    except ValueError:
        raise TrainscaleError("manifest unreadable") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int):
        raise TrainscaleError("manifest unreadable")
    for name, meta in files.items():
        if not _plain_name(name):
            raise TrainscaleError(f"manifest names {name!r}, outside its folder")
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and meta["bytes"] >= 0
                and (isinstance(meta.get(DIGEST), str) or isinstance(meta.get("sha256"), str))):
            raise TrainscaleError(f"manifest entry for {name} is malformed")
    for needed in (METADATA,):
        if needed not in files:
            raise TrainscaleError(f"manifest does not list {needed}")
    return manifest


def verify(folder: Path, full: bool = True, run_id: str | None = None) -> str | None:
    """None if the checkpoint folder is complete and intact (and, given ``run_id``, that run's), else
    the reason it is not. Only regular files in the folder are read."""
    if folder.is_symlink() or not folder.is_dir():
        return "not a folder"
    if not (folder / MANIFEST).exists():
        return "no manifest"
    try:
        manifest = read_manifest(folder)
    except TrainscaleError as e:
        return str(e)
    if run_id is not None and manifest.get("run_id") != run_id:
        return f"written by another run ({manifest.get('run_id') or 'unnamed'}, not {run_id})"
    for name, meta in manifest["files"].items():
        p = folder / name
        try:
            st = os.lstat(p)
        except OSError:
            return f"{name} missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file"
        if st.st_size != meta["bytes"]:
            return f"{name} truncated ({st.st_size} of {meta['bytes']} bytes)"
        if full and not _digest_matches(p, meta):
            return f"{name} checksum mismatch"
    return None


def _discard(folder: Path) -> None:
    """Remove a committed checkpoint so that a kill at any moment leaves it whole or gone: first renamed out of
    the ``step-*`` names (atomic), then deleted; a ``.trash-*`` a kill left behind is deleted at the next start."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    try:
        os.rename(folder, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def committed_steps(root: Path) -> list[int]:
    out = []
    for p in root.glob("step-*"):
        try:
            out.append(int(p.name.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(out)


def latest_good(root: str | Path, log: Callable[[str], None] = print,
                run_id: str | None = None) -> tuple[int, Path] | None:
    """Newest committed checkpoint that verifies (and, given ``run_id``, that this run wrote),
    announcing each one skipped and why."""
    root = Path(root)
    for step in reversed(committed_steps(root)):
        folder = root / step_dir_name(step)
        why = verify(folder, run_id=run_id)
        if why is None:
            return step, folder
        if why.startswith("written by another run"):
            log(f"checkpoint {folder} was {why}: skipped")
        else:
            log(f"checkpoint {folder} is damaged ({why}); falling back to the previous one")
    return None


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (a rank whose write failed still reaches this
    collective, so the others fail with it instead of waiting at a barrier)."""
    return bool(reduce_host([1 if ok else 0], op=dist.ReduceOp.MIN)[0])


class CheckpointManager:
    """Save every N steps (or M seconds), optionally asynchronously; keep the last K. ``run_id``
    (written into each manifest) binds the checkpoints to their run: another run's are never loaded."""

    def __init__(self, root: str | Path, keep: int = 3, async_save: bool = False,
                 before_commit: Callable[[int], None] | None = None, run_id: str | None = None) -> None:
        self.root = Path(root)
        self.keep = keep
        self.run_id = run_id
        self.async_save = async_save and dist.is_initialized()
        self.before_commit = before_commit  # fault-injection hook: runs on rank 0 just before the commit
        self.pending: tuple[int, Path, Any] | None = None
        self.save_seconds = 0.0  # time the training loop was blocked by saving
        self.saves = 0
        self._group = dist.new_group(backend="gloo") if self.async_save else None
        error = None
        if _rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                # a save that a crash interrupted, or a removal it cut short
                for stale in [*self.root.glob(".tmp-step-*"), *self.root.glob(".trash-*")]:
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError as e:
                error = f"checkpoint folder {self.root} cannot be written: {_fail_sentence(e)}"
        if not _all_ok(error is None):
            raise CheckpointSaveError(error or f"checkpoint folder {self.root} cannot be written on rank 0")

    # ------------------------------------------------------------------ save

    def _failed(self, step: int, why: str | None) -> CheckpointSaveError:
        prev = committed_steps(self.root) if self.root.is_dir() else []
        kept = f"the last committed checkpoint ({step_dir_name(prev[-1])}) is intact" if prev else \
            "no checkpoint was committed before"
        return CheckpointSaveError(f"saving the step-{step} checkpoint in {self.root} failed "
                                   f"({why or 'on another rank'}); {kept}")

    def save(self, step: int, state: dict[str, Any], extras: dict[str, Any]) -> None:
        """Write ``state`` (DCP: sharded tensors by name) and this rank's ``extras`` (RNG, loader
        position, ...: JSON) for ``step``; commit when complete. A failed write (disk full) fails on
        every rank with one sentence, and leaves the committed checkpoints as they were."""
        t0 = time.perf_counter()
        self.finish()  # at most one save in flight
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        why = None
        try:
            if _rank() == 0:
                tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = _fail_sentence(e)
        if not _all_ok(why is None):
            raise self._failed(step, why)
        try:
            write_extras(tmp / f"extras-rank{_rank():05d}.json", extras)
        except (OSError, TypeError, ValueError) as e:
            why = _fail_sentence(e)
        if not _all_ok(why is None):
            raise self._failed(step, why)
        try:
            if self.async_save:
                fut = dcp.async_save(state, storage_writer=dcp_writer(tmp), process_group=self._group)
                self.pending = (step, tmp, fut)
            else:
                dcp.save(state, storage_writer=dcp_writer(tmp))
                self.pending = (step, tmp, None)
        except (Exception, dcp.api.CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if (disk := _disk_error(e) or _full_disk(self.root, e)) is not None:
                raise self._failed(step, _fail_sentence(disk)) from None
            raise  # a peer died: the job fails and restarts
        if not self.async_save:
            self.finish()
        self.save_seconds += time.perf_counter() - t0
        self.saves += 1

    def poll(self) -> None:
        """Commit an asynchronous save once every rank has finished writing: one small all-reduce read back on the
        host (SaveCadence calls it on the steps that read back anyway, not every step)."""
        if self.pending is None or self.pending[2] is None:
            return
        if reduce_host([1 if self.pending[2].done() else 0], op=dist.ReduceOp.MIN)[0]:
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight, then commit it (rank 0 writes the manifest and renames)."""
        if self.pending is None:
            return
        step, tmp, fut = self.pending
        self.pending = None
        why = None
        if fut is not None:
            try:
                fut.result()
            except (Exception, dcp.api.CheckpointException) as e:
                if (disk := _disk_error(e) or _full_disk(self.root, e)) is None:
                    raise
                why = _fail_sentence(disk)
        if why is None:  # every rank digests what it wrote, in parallel (rank 0 only folds them in)
            try:
                digest_own_files(tmp, _rank())
            except OSError as e:
                why = _fail_sentence(e)
        if not _all_ok(why is None):
            raise self._failed(step, why)
        if _rank() == 0:
            if self.before_commit is not None:
                self.before_commit(step)
            try:
                self._commit(step, tmp)
            except OSError as e:
                why = _fail_sentence(e)
        if not _all_ok(why is None):
            raise self._failed(step, why)

    def _commit(self, step: int, tmp: Path) -> None:
        files: dict[str, dict[str, Any]] = {}
        for r in range(_world()):  # each rank's digests of its own files (digest_own_files), sizes checked again
            path = tmp / DIGEST_FILE.format(rank=r)
            got = json.loads(_read_regular(path, "checkpoint digests", MAX_JSON_BYTES))
            for name, meta in got.items():
                if _plain_name(name) and (tmp / name).stat().st_size == meta["bytes"]:
                    files[name] = meta
            path.unlink()
        for p in sorted(tmp.iterdir()):  # DCP's .metadata (rank 0 wrote it), anything a rank did not digest
            if p.is_file() and p.name not in files:
                files[p.name] = {"bytes": p.stat().st_size, DIGEST: _xxh3(p)}
        files = dict(sorted(files.items()))
        manifest = {"step": step, "world_size": _world(), "time": time.time(), "run_id": self.run_id,
                    "files": files}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.root / step_dir_name(step)
        if final.exists():  # re-saving a step after a restart: the new one replaces it
            _discard(final)
        os.rename(tmp, final)  # atomic on POSIX: the checkpoint appears whole or not at all
        self._retain()

    def _retain(self) -> None:
        steps = committed_steps(self.root)
        for old in steps[: max(0, len(steps) - self.keep)]:
            _discard(self.root / step_dir_name(old))

    # ------------------------------------------------------------------ load

    def load(self, state: dict[str, Any], log: Callable[[str], None] = print) -> tuple[int, dict[str, Any]] | None:
        """Load the newest good checkpoint of this run into ``state`` in place; -> (step, this rank's
        extras). Nothing read runs code: a crafted folder is refused with one sentence."""
        found = latest_good(self.root, log=log if _rank() == 0 else (lambda _m: None), run_id=self.run_id)
        # every rank must agree on the folder (rank 0 decides)
        obj = [found]
        if dist.is_initialized():
            dist.broadcast_object_list(obj, src=0)
        found = obj[0]
        if found is None:
            return None
        step, folder = found
        why = None
        try:
            read_metadata(folder)  # every rank, before DCP touches it
            mine = folder / f"extras-rank{_rank():05d}.json"
            extras = read_extras(mine if mine.exists() else folder / "extras-rank00000.json")
        except TrainscaleError as e:
            why = str(e)
        if not _all_ok(why is None):
            raise TrainscaleError(why or f"checkpoint {folder} is refused on another rank")
        try:
            dcp.load(state, storage_reader=_safe_reader(folder), planner=_safe_planner())
        except (Exception, dcp.api.CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise TrainscaleError(f"checkpoint {folder} cannot be loaded into this model: "
                                  f"{_fail_sentence(e)}") from None
        return step, extras


# ------------------------------------------------------------------ one model out of any layout


class SaveCadence:
    """When a training step saves, and the save: every ``every_steps`` steps, every ``every_seconds`` since the
    last save (or the loop's start, ``start_clock``), and whenever the batch scheduler's early signal asks
    (runtime/job/slurm.py: a save, then under a requeueing script the attempt stops), which is looked at every
    ``signal_every`` steps and at the last one (reading it back is a host sync), as is whether an asynchronous save
    in flight has finished (``manager.poll``; a new save waits for the one in flight anyway). Each save is recorded
    through ``record(step, save_s)`` (runtime/job/metrics.MetricsLog.checkpoint); ``before()`` runs first
    (MetricsLog.flush): the rows of the steps a checkpoint holds reach metrics.jsonl before the checkpoint can
    commit, so a kill between the two never leaves a resumable step without its row."""

    def __init__(self, manager: CheckpointManager, every_steps: int | None, every_seconds: float | None,
                 device: torch.device, log: Callable[[str], None], signal_every: int = 1) -> None:
        self.manager, self.every_steps, self.every_seconds = manager, every_steps, every_seconds
        self.device, self.log, self.signal_every = device, log, max(1, signal_every)
        self.last_save = time.perf_counter()

    def start_clock(self) -> None:
        self.last_save = time.perf_counter()

    def after_step(self, step: int, total: int, state: Callable[[], dict[str, Any]],
                   extras: Callable[[], dict[str, Any]], record: Callable[[int, float], None],
                   before: Callable[[], None] | None = None) -> bool:
        """Every rank, after step ``step`` of ``total``: commit a finished asynchronous save, save if due
        (``state``/``extras`` called only then) -> True when this attempt stops now for the job to requeue."""
        from trainscale.runtime.job.slurm import save_requested, stops_for_requeue

        looks = step % self.signal_every == 0 or step == total  # the steps that may read back from the device
        if looks:
            self.manager.poll()  # commits a finished asynchronous save (a collective read back: not every step)
        due = bool((self.every_steps and step % self.every_steps == 0) or (
            self.every_seconds and time.perf_counter() - self.last_save >= self.every_seconds))
        stop = False
        if looks and save_requested(self.device):
            stop = stops_for_requeue(step, total)  # then end this attempt: the job requeues itself
            self.log(f"[signal] checkpoint requested (Slurm's early signal): saving at step {step}"
                     + (", then stopping for the requeue" if stop else ""))
            due = True
        if due:
            if before is not None:
                before()
            t0 = time.perf_counter()
            self.manager.save(step, state(), extras())
            self.last_save = time.perf_counter()
            record(step, self.last_save - t0)
        return stop


def saved_tensors(folder: Path, prefix: str = "model.") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (global shape, dtype)} of the tensors a checkpoint stores under ``prefix`` (its model weights), from
    DCP's metadata alone (read by the restricted unpickler): whatever layout wrote them, DCP records each tensor
    by its fully-qualified name and global shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata(folder)
    out = {}
    for key, meta in md.state_dict_metadata.items():
        if not (isinstance(key, str) and key.startswith(prefix)):
            continue
        if not isinstance(meta, TensorStorageMetadata) or not isinstance(meta.properties.dtype, torch.dtype):
            raise TrainscaleError(f"checkpoint {folder} is refused: its entry {key[:200]!r} is not a tensor")
        out[key[len(prefix):]] = (tuple(int(n) for n in meta.size), meta.properties.dtype)
    return out


def read_full_tensors(folder: Path, wanted: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The whole (unsharded) tensors ``wanted`` ({name: (shape, dtype)}, as ``saved_tensors`` gives them) from a
    checkpoint, in this one process, on CPU: DCP reads each tensor's shards, whichever ranks wrote them, into one
    full tensor (resharding to a world of one). No process group is needed (``no_dist``); the same safety rules as
    ``CheckpointManager.load``: restricted metadata unpickler, tensors read with ``torch.load(weights_only=True)``."""
    import warnings

    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in wanted.items()}
    nested = {prefix.rstrip("."): state}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            dcp.load(nested, storage_reader=_safe_reader(folder), planner=_safe_planner(), no_dist=True)
    except (Exception, dcp.api.CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise TrainscaleError(f"checkpoint {folder} cannot be read: {_fail_sentence(e)}") from None
    return nested[prefix.rstrip(".")]
