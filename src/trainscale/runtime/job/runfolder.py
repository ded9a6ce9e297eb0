"""A run folder, bound to its run: the bookkeeping around the training loop.

    RUN/identity.json   run id + the sha256 of the config's training-relevant part; checked on
                        --resume and by restarts, and written into every checkpoint manifest
    RUN/.lock           an advisory lock (flock) held while a job writes: a second job refuses.
                        The kernel drops it when the holder dies, so a crash leaves no stale lock
    RUN/run.json        layout, model, results (written whole: a tmp file, then rename)
    RUN/metrics.jsonl   one line per step, per checkpoint, and the goodput at the end
    RUN/job.json        the first attempt's start time (goodput's wall clock spans restarts)
    RUN/error.json      a deterministic error of an attempt (bad checkpoint, finished run, disk
                        full): the next attempt reports it instead of retrying

And the worker side of a job's life: ``worker_main`` dies with its parent (PDEATHSIG), reports
the one sentence that failed it and records deterministic errors so that torchrun's restart does
not repeat them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainscale.errors import JobFailed, TrainscaleError
from trainscale.runtime.job.metrics import metrics_path, read_rows
from trainscale.safeio import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json_object

IDENTITY = "identity.json"
LOCK = ".lock"
ERROR = "error.json"
ENV_RUN_ID = "TRAINSCALE_RUN_ID"  # set by `trainscale train`: the run the workers belong to
ENV_ERROR_FILE = "TRAINSCALE_ERROR_FILE"
ENV_PARENT = "TRAINSCALE_PARENT_PID"
ENV_LAUNCH = "TRAINSCALE_LAUNCH_ID"  # set by a single-machine `trainscale train`: one id per invocation

# config values that may change between a run and its --resume (they do not change what is trained)
_VOLATILE = {("train", "steps"), ("run", "out"), ("run", "log_every"), ("run", "eval_sequences"),
             ("run", "save_final"), ("run", "layout"), ("data", "cache"), ("checkpoint", "every_steps"),
             ("checkpoint", "every_seconds"), ("checkpoint", "keep"), ("checkpoint", "async_save"),
             ("checkpoint", "collective_timeout_s"), ("checkpoint", "dir"), ("train", "eval_every"), ("run", "sinks")}
_VOLATILE_SECTIONS = {"profile"}  # what is observed, not what is trained


def config_hash(cfg: Any) -> str:
    """sha256 of what a run trains (model, data, optimizer, seed), not of how long or where it logs."""
    data = cfg.model_dump(mode="json", by_alias=True)
    for section, key in _VOLATILE:
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    for section in _VOLATILE_SECTIONS:
        data.pop(section, None)
    train = data.get("train")
    if isinstance(train, dict):  # the schedule's fields as they matter: runs from before the choice hash unchanged
        if train.get("schedule") != "wsd":
            train.pop("decay_fraction", None)
        if train.get("schedule") == "cosine":
            train.pop("schedule", None)
    data.pop("name", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ lock


class RunLock:
    """An exclusive flock on RUN/.lock, held by one job; released when its holder exits."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TrainscaleError(f"run folder {self.folder} cannot be written: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise TrainscaleError(f"run folder {self.folder} is in use by another trainscale job (pid {holder}); "
                                      "wait for it to end or train into another folder") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def check_free(folder: Path) -> None:
        """Refuse, as ``acquire`` does, a folder another job holds -- without writing anything (a refused
        ``--resume`` must leave the folder as it was)."""
        import fcntl

        try:
            fd = os.open(Path(folder) / LOCK, os.O_RDONLY)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise TrainscaleError(f"run folder {folder} is in use by another trainscale job (pid {holder}); "
                                      "wait for it to end or train into another folder") from None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __del__(self) -> None:
        self.release()


# ------------------------------------------------------------------ identity


def checkpoint_root(run_dir: str | Path | None, configured: str | None) -> Path | None:
    """Where a run's checkpoints live: ``[checkpoint] dir`` when set, else RUN/checkpoints (None: neither)."""
    if configured:
        return Path(configured)
    return Path(run_dir) / "checkpoints" if run_dir is not None else None


def _has_checkpoints(ckpt_root: Path) -> bool:
    return ckpt_root.is_dir() and any(ckpt_root.glob("step-*"))


def _identity(folder: Path) -> dict[str, Any] | None:
    ident_path = folder / IDENTITY
    ident = read_json_object(ident_path, "run identity") if ident_path.exists() else None
    if ident is not None and not (isinstance(ident.get("run_id"), str) and isinstance(ident.get("config_sha256"),
                                                                                         str)):
        raise TrainscaleError(f"run identity {ident_path} is malformed; train into a fresh folder")
    return ident


def _same_config(folder: Path, ident: dict[str, Any], cfg: Any) -> None:
    if ident["config_sha256"] != config_hash(cfg):
        raise TrainscaleError(f"--resume: run folder {folder} belongs to run {ident['run_id']}, trained with "
                              "another config (model, data, optimizer or seed differ); resume it with its own "
                              "config.toml or train into a fresh folder")


def claim(folder: Path, ckpt_root: Path, cfg: Any, resume: bool) -> str:
    """Bind ``folder`` to a run -> its run id. A new run never adopts another run's checkpoints: it is
    refused in a folder that holds them; ``--resume`` continues the folder's run only with the same
    training config."""
    folder, ckpt_root = Path(folder), Path(ckpt_root)
    ident_path = folder / IDENTITY
    digest = config_hash(cfg)
    ident = _identity(folder)
    if resume and ident is not None:
        _same_config(folder, ident, cfg)
        return ident["run_id"]
    if _has_checkpoints(ckpt_root):
        owner = f"run {ident['run_id']}" if ident else "an earlier run"
        hint = "continue it with --resume" if ident else "move them away"
        raise TrainscaleError(f"{ckpt_root} holds the checkpoints of {owner}; {hint}, or train into a fresh folder")
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(ident_path, {"run_id": run_id, "config_sha256": digest, "created": time.time()})
    (folder / ERROR).unlink(missing_ok=True)
    return run_id


def check_resume(folder: Path, ckpt_root: Path, cfg: Any, steps: int | None, extend: bool) -> int:
    """``trainscale train --resume``, before anything is written: the folder holds a run of this config with a
    committed checkpoint (sizes checked; the trainer verifies the checksums) from which ``steps`` (None: the run's
    recorded total) can be reached on the run's own schedule (runtime/schedule.py) -> the step the run will stop
    at. Refused in one sentence otherwise; reads only, so a refused --resume leaves the folder as it was."""
    from trainscale.runtime.job.checkpoint import committed_steps, read_extras, step_dir_name, verify
    from trainscale.runtime.schedule import continuation, recorded

    folder, ckpt_root = Path(folder), Path(ckpt_root)
    RunLock.check_free(folder)
    ident = _identity(folder)
    if ident is None:
        raise TrainscaleError(f"--resume: {folder} holds no run to continue (no {IDENTITY}); train without "
                              "--resume to start one")
    _same_config(folder, ident, cfg)
    good = [s for s in (reversed(committed_steps(ckpt_root)) if ckpt_root.is_dir() else ())
            if verify(ckpt_root / step_dir_name(s), full=False, run_id=ident["run_id"]) is None]
    if not good:
        info = _run_json(folder)
        if info.get("status") == "done" and isinstance(info.get("steps"), int):
            raise TrainscaleError(f"--resume: the run in {folder} finished at step {info['steps']} and kept no "
                                  "checkpoint to continue from; to train longer, train again into a fresh folder "
                                  "with [checkpoint] every_steps set (then --resume --steps N --extend can extend it)")
        raise TrainscaleError(f"--resume: {ckpt_root} holds no complete checkpoint of run {ident['run_id']} to "
                              "continue from; train without --resume to start the run over")
    step = good[0]
    extras = read_extras(ckpt_root / step_dir_name(step) / "extras-rank00000.json")
    rec = recorded(extras, cfg.train.steps, str(folder))
    return continuation(cfg.train, step, rec, steps, extend, str(folder))[1]


def _run_json(folder: Path) -> dict[str, Any]:
    try:
        return read_json_object(folder / "run.json", "run record") if (folder / "run.json").exists() else {}
    except TrainscaleError:
        return {}


def check_identity(folder: Path, run_id: str) -> None:
    """A restarted or launched worker: the folder must still belong to ``run_id``."""
    ident = read_json_object(Path(folder) / IDENTITY, "run identity")
    if ident.get("run_id") != run_id:
        raise TrainscaleError(f"run folder {folder} now belongs to run {ident.get('run_id')}, not {run_id}; "
                              "this job stops")


# ------------------------------------------------------------------ the folder's files


class RunFolder:
    """config.toml, tokenizer.json, run.json, metrics.jsonl and job.json of one run (rank 0 writes)."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = Path(path)
        self.resume = resume
        self.metrics = None
        self.info: dict[str, Any] = {}

    def start(self, config_toml: str, tokenizer: Path, info: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path / "config.toml", config_toml)
        atomic_write_bytes(self.path / "tokenizer.json", Path(tokenizer).read_bytes())
        self.write_run_json({**info, "status": "running"})
        job = self.path / "job.json"  # the first attempt's start: wall time for goodput spans restarts
        if not self.resume or not job.exists():
            atomic_write_json(job, {"start": time.time()})
        self.metrics = open(metrics_path(self.path), "a" if self.resume else "w")  # noqa: SIM115
        self.log(start_event())

    def log(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def append(self, row: dict[str, Any]) -> None:
        """A line after the loop (held-out loss, goodput)."""
        with open(metrics_path(self.path), "a") as f:
            f.write(json.dumps(row) + "\n")

    def write_run_json(self, info: dict[str, Any]) -> None:
        self.info = {**self.info, **info}
        atomic_write_json(self.path / "run.json", self.info)

    def goodput(self, log: Callable[[str], None]) -> dict[str, Any]:
        """Useful step time / the job's wall time, restarts included, from metrics.jsonl: a step that was run
        again after a restart counts once (the earlier runs are lost work). The job's wall time is the sum over
        its launches (one CLI invocation, one Slurm job across its requeues): inside a launch, the time from a
        failure to the restarted attempt's first step is the job's (lost); between launches — a crashed or
        stopped run resumed later by hand — the machine was not the job's, so that idle time is not counted."""
        rows = read_rows(metrics_path(self.path))[0]  # a line a kill cut short is left out
        steps = [r for r in rows if "loss" in r and "step_time_s" in r]
        last: dict[int, float] = {}
        for r in steps:
            last[int(r["step"])] = float(r["step_time_s"])
        useful = sum(last.values())
        ran = sum(float(r["step_time_s"]) for r in steps)
        save = sum(float(r["save_s"]) for r in rows if r.get("event") == "checkpoint")
        wall, starts = launch_wall(rows, time.time())
        if not starts:  # a run folder from before start events: the first attempt's start (job.json)
            wall = time.time() - float(read_json_object(self.path / "job.json", "job start")["start"])
        g = {"goodput": useful / wall, "useful_step_s": useful, "wall_s": wall, "lost_steps": len(steps) - len(last),
             "lost_step_s": ran - useful, "checkpoint_s": save,
             "checkpoints": sum(r.get("event") == "checkpoint" for r in rows),
             "restarts": max(0, starts - 1), "restart_and_startup_s": max(0.0, wall - ran - save)}
        self.append(g)
        self.write_run_json(g)
        log(f"goodput {g['goodput']:.1%}: {useful:.1f} s of useful steps in {wall:.1f} s wall; "
            f"{g['restarts']} restart(s), {g['lost_steps']} step(s) recomputed, {g['checkpoints']} checkpoint(s) "
            f"taking {save:.1f} s, {g['restart_and_startup_s']:.1f} s starting and restarting")
        return g


def launch_id() -> str:
    """Which launch of the job this process belongs to: the id a single-machine CLI invocation gave itself, else
    the Slurm job (the same across its requeues), else torchrun's run id (``--rdzv-id``, which every node of a
    multi-node job shares)."""
    return (os.environ.get(ENV_LAUNCH) or os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
            or "none")


def start_event() -> dict[str, Any]:
    """The metrics row each attempt writes first: when and as which (launch, Slurm requeue, torchrun attempt)."""
    return {"event": "start", "wall": time.time(), "launch": launch_id(),
            "requeue": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}


def launch_wall(rows: list[dict[str, Any]], now: float) -> tuple[float, int]:
    """-> (the job's wall seconds, the number of attempts that started). Each launch counts from its first
    start event to its last row with a wall clock (the current launch: to ``now``)."""
    spans: dict[str, list[float]] = {}
    order: list[str] = []
    attempts = set()
    current = None
    for r in rows:
        if r.get("event") == "start" and "wall" in r:
            key = str(r.get("launch"))
            attempts.add((key, r.get("requeue", 0), r.get("attempt", 0)))
            if key not in spans:
                spans[key] = [float(r["wall"]), float(r["wall"])]
                order.append(key)
            current = key
        if current is not None and "wall" in r:
            spans[current][1] = max(spans[current][1], float(r["wall"]))
    if order:
        spans[order[-1]][1] = now
    return sum(b - a for a, b in spans.values()), len(attempts)


# ------------------------------------------------------------------ a worker's life


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (prctl PR_SET_PDEATHSIG): the
    ranks end with their torchrun agent, the agent with the CLI. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    expected = os.environ.get(ENV_PARENT)
    if expected and os.getppid() != int(expected):  # the parent died before the prctl above
        os._exit(1)


def _record_error(message: str, code: int) -> None:
    path = os.environ.get(ENV_ERROR_FILE)
    if not path:
        return
    text = json.dumps({"error": message, "exit": code, "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                       "rank": os.environ.get("RANK", "0")})
    tmp = f"{path}.{os.getpid()}.tmp"
    try:  # whole or not at all (a full disk must not leave half a record), and the first rank to fail says it
        with open(tmp, "w") as f:
            f.write(text)
        os.link(tmp, path)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def previous_error() -> dict[str, Any] | None:
    path = os.environ.get(ENV_ERROR_FILE)
    if not path or not os.path.isfile(path):
        return None
    try:
        got = read_json_object(path, "error record")
    except TrainscaleError:
        return None
    return got if isinstance(got.get("error"), str) else None


# a rank's exit code by what failed it, first match wins: the one table of every rank's ``main`` (train, probe)
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (JobFailed, 1),  # a job that started failed for good (disk full): one sentence, recorded
    (TrainscaleError, 2),  # bad input (config, layout, a refused checkpoint): one sentence, recorded
    (BaseException, 1),  # anything else (a peer died, a collective timed out): its traceback; torchrun restarts
)


def exit_code(e: BaseException) -> int:
    """``EXIT_CODES``'s code for ``e``."""
    return next(code for kind, code in EXIT_CODES if isinstance(e, kind))


def worker_main(body: Callable[[], None]) -> int:
    """Every rank's ``main`` (runtime/train.py, runtime/probe/compare.py): run ``body`` -> the exit code
    (``EXIT_CODES``). A TrainscaleError is one line on stderr and is recorded, so that a restarted attempt stops
    at once instead of repeating it; any other failure prints its traceback to the log, for torchrun to restart.
    The process group is destroyed either way."""
    import torch.distributed as dist

    die_with_parent()
    prev = previous_error()
    if prev is not None:  # a deterministic error: retrying would fail the same way
        if os.environ.get("RANK", "0") == "0":
            print(f"trainscale: error: {prev['error']}", file=sys.stderr, flush=True)
        return int(prev.get("exit", 2))
    code, message = 0, None
    try:
        body()
    except (KeyboardInterrupt, SystemExit):
        raise
    except TrainscaleError as e:
        code, message = exit_code(e), str(e)
    except BaseException as e:  # noqa: BLE001  (torch's CheckpointException is a BaseException)
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"trainscale: rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: {first}",
              file=sys.stderr, flush=True)
        code = exit_code(e)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a peer already gone)
                pass
    if message is not None:
        _record_error(message, code)
        if os.environ.get("RANK", "0") == "0" or code == 1:
            print(f"trainscale: error: {message}", file=sys.stderr, flush=True)
    return code


# ------------------------------------------------------------------ the console of a running job


def console_line(row: dict[str, Any], log_every: int, total: int) -> str | None:
    """The console's line for a metrics.jsonl row (``trainscale train`` tails the file), or None: a resume says
    so first ("resumed from step N"), a step every ``log_every`` steps with its ETA (measured step times x the
    steps left, runtime/job/metrics.Eta), a held-out evaluation whenever ``eval_every`` ran one, a rank named a
    straggler (runtime/job/ranks.py)."""
    from trainscale.units import duration_text

    if row.get("event") == "resumed":
        return f"resumed from step {int(row['step'])} (steps {int(row['step']) + 1}..{total} follow)"
    if row.get("event") == "straggler":
        from trainscale.runtime.job.ranks import straggler_line

        return straggler_line(row)
    if row.get("event") == "eval":
        return (f"eval  {int(row['step']):5d}  held-out loss {float(row['val_loss']):.4f} nats/token (unigram "
                f"baseline {float(row['unigram_loss']):.4f})")
    if "loss" not in row or "step" not in row or (int(row["step"]) % log_every and int(row["step"]) != total):
        return None
    return (f"step {int(row['step']):5d}/{total} loss {row['loss']:.4f} {row['tokens_per_s']:,.0f} tok/s "
            f"{row['flops_per_s'] / 1e9:.2f} GFLOP/s MFU {row['mfu']:.1%} ({row.get('flop_convention', '')}) "
            f"ETA {duration_text(row.get('eta_s'))}")
