"""Checkpoint save rate against the disk's own (issue 30: >= 70 % of dd's rate for the same bytes).

One process (a one-rank gloo group), a model-shaped state of fp32 tensors (``--mb`` MB: a few large matrices and
many small vectors, as a transformer's are), saved to the same disk in alternating order, ``--repeats`` times:

  dd             dd if=/dev/zero bs=4M conv=fsync: the disk's sequential write rate, flushed
  torch.save     the same tensors in one file (pickle-based; written here only to compare), then fsync
  dcp            torch.distributed.checkpoint.save alone (FileSystemWriter as CheckpointManager configures it)
  trainscale     CheckpointManager.save + commit: DCP, the extras, the sha256 manifest, the atomic rename

Each figure is MB/s of the state's bytes (dd: of the same byte count); the ratios are taken per repeat, side by
side, and their median printed. The page cache is dropped between runs where the kernel lets us
(/proc/sys/vm/drop_caches, needs root); otherwise every writer sees the same cache.

    .venv/bin/python benchmarks/bench_checkpoint_save.py [--mb 512] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def state(mb: int) -> dict[str, torch.Tensor]:
    """~mb MB of fp32: 8 equal matrices (90 %) and 400 vectors (10 %), each filled (no sparse pages)."""
    g = torch.Generator().manual_seed(0)
    n = mb * 2**20 // 4
    big, small = int(n * 0.9) // 8, int(n * 0.1) // 400
    out = {f"layers.{i}.w": torch.randn(big, generator=g) for i in range(8)}
    out.update({f"layers.{i}.norm": torch.randn(small, generator=g) for i in range(400)})
    return out


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def run_dd(folder: Path, size: int) -> float:
    out = folder / "dd.bin"
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=4M", f"count={-(-size // (4 << 20))}", "conv=fsync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t
    out.unlink()
    return dt


def run_torch_save(folder: Path, sd: dict[str, torch.Tensor]) -> float:
    out = folder / "state.pt"
    t = time.perf_counter()
    with open(out, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    out.unlink()
    return dt


def run_dcp(folder: Path, sd: dict[str, torch.Tensor]) -> float:
    from trainscale.runtime.job.checkpoint import dcp_writer

    out = folder / "dcp"
    t = time.perf_counter()
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=dcp_writer(out))
    dt = time.perf_counter() - t
    shutil.rmtree(out)
    return dt


def run_trainscale(folder: Path, sd: dict[str, torch.Tensor], step: int) -> float:
    from trainscale.runtime.job.checkpoint import CheckpointManager

    root = folder / "ckpt"
    mgr = CheckpointManager(root, keep=1)
    t = time.perf_counter()
    mgr.save(step, sd, {"step": step})
    mgr.finish()
    dt = time.perf_counter() - t
    shutil.rmtree(root)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure (default: the temp folder)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sd = state(args.mb)
    size = nbytes(sd)
    times: dict[str, list[float]] = {k: [] for k in ("dd", "torch.save", "dcp", "trainscale")}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        for r in range(args.repeats):
            order = list(times) if r % 2 == 0 else list(reversed(times))
            for name in order:
                drop_caches()
                times[name].append({"dd": lambda: run_dd(folder, size),
                                    "torch.save": lambda: run_torch_save(folder, sd),
                                    "dcp": lambda: run_dcp(folder, sd),
                                    "trainscale": lambda r=r: run_trainscale(folder, sd, r + 1)}[name]())
    print(f"state: {size / 1e6:.0f} MB fp32 in {len(sd)} tensors; {args.repeats} repeats, alternating order")
    for name, ts in times.items():
        each = ", ".join(f"{t:.2f}" for t in ts)
        print(f"  {name:11s} {size / statistics.median(ts) / 1e6:8.0f} MB/s   (median of {each} s)")
    for name in ("torch.save", "dcp", "trainscale"):
        ratio = statistics.median(d / t for d, t in zip(times["dd"], times[name], strict=True))
        print(f"  {name} / dd rate: {ratio:.0%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
