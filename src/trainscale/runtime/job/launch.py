"""Starting a training job: the torchrun command for this machine (or a multi-node rendezvous, fixed or
elastic) and the layout to use when asked to plan one (the Slurm batch script is runtime/job/slurm.py).

Imports no torch at module level: ``trainscale train --help`` and ``launch --slurm`` stay fast.

A single-machine job runs torchrun through ``python -m trainscale.runtime.job.launch``: the same
torchrun, with its rendezvous stores listening on 127.0.0.1 only (torchrun's own bind every
interface), and the agent dying with the CLI that started it (and the ranks with the agent).
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import TrainConfig
from trainscale.specs import Layout


def parse_nnodes(nnodes: int | str) -> tuple[int, int]:
    """``N`` or torchrun's elastic range ``MIN:MAX`` -> (min, max)."""
    text = str(nnodes).strip()
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise TrainscaleError(f"--nnodes must be N or MIN:MAX (an elastic range), not {text!r}") from None
    if not 0 < a <= b <= 100_000:
        raise TrainscaleError(f"--nnodes {text}: need 1 <= MIN <= MAX <= 100000")
    return a, b


def torchrun_command(config: str | Path, layout: str, out: str | Path, world: int, steps: int | None = None,
                     nnodes: int | str = 1, rdzv_endpoint: str | None = None, rdzv_id: str = "trainscale",
                     python: str = sys.executable, max_restarts: int = 0, inject: str | None = None,
                     resume: bool = False, fallback_layout: str | None = None, compile: bool = False,
                     rdzv_timeout: int | None = None) -> list[str]:
    """``python -m torch.distributed.run ... -m trainscale.runtime.train ...``: standalone on one machine,
    c10d rendezvous at ``rdzv_endpoint`` across ``nnodes`` machines (run the same command on each).
    ``nnodes = "MIN:MAX"`` makes the job elastic: it goes on with as few as MIN machines after one is lost
    (each re-formed job re-plans its layout for the processes left, runtime/job/elastic.py)."""
    lo, hi = parse_nnodes(nnodes)
    if world % hi:
        raise TrainscaleError(f"the layout's {world} processes do not split evenly over {hi} nodes")
    if hi == 1 and rdzv_endpoint is None:
        cmd = [python, "-m", "trainscale.runtime.job.launch", "--standalone", "--local-addr", "127.0.0.1"]
    else:
        if rdzv_endpoint is None:
            raise TrainscaleError("a multi-node run needs --rdzv-endpoint HOST:PORT (the first node's address)")
        check_endpoint(rdzv_endpoint)
        cmd = [python, "-m", "torch.distributed.run", "--nnodes", f"{lo}:{hi}" if lo != hi else str(hi),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
        if rdzv_timeout is not None:  # how long the first rendezvous waits for every machine (torch: 600 s)
            cmd += ["--rdzv-conf", f"join_timeout={int(rdzv_timeout)}"]
    cmd += ["--nproc-per-node", str(world // hi), "--max-restarts", str(max_restarts),
            "-m", "trainscale.runtime.train", "--config", str(config), "--layout", layout, "--out", str(out)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if inject:
        cmd += ["--inject", inject]
    if resume:
        cmd += ["--resume"]
    if fallback_layout:
        cmd += ["--fallback-layout", fallback_layout]
    if compile:
        cmd += ["--compile"]
    return cmd


_HOST = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                   r"[A-Za-z0-9])?)*$")


def check_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (a host name, an IPv4 address or a bracketed IPv6 one; port 1-65535) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        raise TrainscaleError(f"--rdzv-endpoint must be HOST:PORT with a port from 1 to 65535, not {text!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise TrainscaleError(f"--rdzv-endpoint {text!r} has an invalid IPv6 address") from None
    elif host.replace(".", "").isdigit():  # all digits and dots: an IPv4 address, or nothing
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise TrainscaleError(f"--rdzv-endpoint {text!r} has an invalid IPv4 address") from None
    elif not _HOST.match(host):
        raise TrainscaleError(f"--rdzv-endpoint {text!r} does not start with a host name or address")
    return host, int(port)


def plan_layout(cfg: TrainConfig) -> tuple[str, str]:
    """-> (layout string, why) for this machine.

    GPUs: the planner (``estimate.planner.plan``) searches the layouts this runtime trains (``rules.RUNNABLE``)
    for the model on this many GPUs of this kind, and the fastest one that fits is taken. CPU: one process,
    because every process of a CPU job shares the same cores, so splitting the model adds communication without
    adding compute."""
    import torch

    if not torch.cuda.is_available():
        return "", ("no GPU here: one process (on a CPU all processes share the same cores, so any split only adds "
                    "communication)")
    from trainscale.estimate.planner.plan import layout_at, problem
    from trainscale.runtime.measure import gpu_peak_flops

    n = torch.cuda.device_count()
    _, gpu = gpu_peak_flops()
    if gpu.startswith("unknown"):
        gpu = "h100-sxm"
    t = cfg.train
    result = problem(model=cfg.model, gpu=gpu, gpus=n, seq=t.seq_len, global_batch_tokens=t.global_batch * t.seq_len,
                     runnable=True).search()
    b = result.best()
    if b is None:
        raise TrainscaleError(result.nothing_fits())
    tps = float(result.res["tokens_per_s"][b])
    return (str(layout_at(result.cfg, b)),
            f"planner's fastest fitting layout this runtime trains on {n} x {gpu}: {tps:,.0f} tokens/s predicted")


@dataclass(frozen=True)
class BatchScript:
    """``trainscale launch --slurm``'s result: the sbatch script (written to ``path``, unless None: for stdout) and
    what it runs."""

    text: str
    path: Path | None
    layout: Layout
    job: Any  # runtime/job/slurm.SlurmJob
    log_dir: str


def batch_script(config: Path, cfg: Any, *, layout: str | None, sets: list[str], steps: int | None,
                 out: Path | None, script: Path | None, **job: Any) -> BatchScript:
    """The Slurm batch script of a training job (runtime/job/slurm.py), written to ``script`` when given (then
    checked with ``bash -n``). ``cfg``: the config file ``config`` as read with ``steps`` and ``sets``
    (runtime/init.resolved_config); with ``sets`` the job reads the overridden config, written beside the script
    (the cluster sees it there). ``job``: SlurmJob's remaining fields (nodes, procs_per_node, ...)."""
    from trainscale.runtime.config import check_layout
    from trainscale.runtime.job.slurm import SlurmJob, check_script, sbatch_script
    from trainscale.safeio import check_output

    lay = Layout.parse(layout if layout is not None else cfg.run.layout)
    check_layout(cfg, lay)
    if script is not None:
        check_output(script, "--script", folder=False, inputs=(config,))
    if sets:  # the job reads the config with the overrides, written beside the script (the cluster sees it there)
        if script is None:
            raise TrainscaleError("--set needs --script: the config with the overrides is written beside it")
        config = script.with_name(f"{script.name}.config.toml")
        check_output(config, "the overridden config", folder=False)
        try:
            config.write_text(cfg.to_toml())
        except OSError as e:
            raise TrainscaleError(f"cannot write {config}: {e.strerror or e}") from None
    job_name = re.sub(r"[^A-Za-z0-9._-]", "-", cfg.name)[:64] or "trainscale"  # Slurm's name syntax, one line
    log_dir = str(script.parent.resolve()) if script is not None else "."
    sj = SlurmJob(config=str(Path(config).resolve()), layout=str(lay), out=str(out or cfg.run.out), steps=steps,
                  job_name=job_name, log_dir=log_dir, workdir=os.getcwd(), **job)
    text = sbatch_script(sj)
    if script is not None:
        try:
            script.write_text(text)
            script.chmod(0o755)
        except OSError as e:
            raise TrainscaleError(f"cannot write the script {script}: {e.strerror or e}") from None
        check_script(script)  # bash -n on the file as written: a failure is a bug (exit 1)
    return BatchScript(text=text, path=script, layout=lay, job=sj, log_dir=log_dir)


def _local_store_class():
    """torch's TCPStore, but a server binds 127.0.0.1 only (torchrun's stores bind every interface)."""
    import socket

    import torch.distributed as dist

    base = dist.TCPStore

    class LocalTCPStore(base):  # type: ignore[misc, valid-type]
        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     *args, **kwargs) -> None:
            if is_master and kwargs.get("master_listen_fd") is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", int(port)))
                sock.listen(128)
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor now
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    return LocalTCPStore


def local_torchrun(argv: list[str]) -> int:
    """torchrun for a single-machine job: stores on 127.0.0.1, gloo on the loopback interface, and the
    agent ends when the process that started it does (its ranks then end with it)."""
    import signal

    from trainscale.runtime.job.runfolder import ENV_PARENT, die_with_parent

    die_with_parent(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    os.environ[ENV_PARENT] = str(os.getpid())  # the ranks check they still have this agent
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.TCPStore = _local_store_class()
    from torch.distributed.run import main

    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(local_torchrun(sys.argv[1:]))
