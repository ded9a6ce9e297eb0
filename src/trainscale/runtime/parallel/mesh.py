"""Processes, backend, and the device mesh a Layout lays out over them.

The world of ``dp * pp * cp * tp`` processes is one 6-D DeviceMesh whose dims, order and sizes come
from ``trainscale.placement`` (``MESH_DIMS``, ``mesh_sizes``; the planner prices collectives on the same
order), outermost first

    (dp_replicate, dp_shard, pp, ep, cp, tp)

so tensor parallelism, which talks every layer, is innermost: on a GPU server its ranks are
neighbours on NVLink; data parallelism is outermost (Llama 3's [TP, CP, PP, DP], arXiv 2407.21783
Sec. 3.3.2); a MoE's expert-parallel ranks (``ep``, a factor of dp) sit between PP and CP. The
flattened dims are derived from it (``placement.FLAT_DIMS``, each kept in ``ParallelMesh.flat``):

    dp           = dp_replicate x dp_shard x ep       which slice of the global batch this rank reads
    dp_shard_cp  = dp_shard x ep x cp                 the group FSDP shards dense weights over
    dp_cp        = dp_replicate x dp_shard x ep x cp  the group dense gradients are averaged over
    expert_shard = dp_shard x cp                      the group FSDP shards one rank's experts over
    expert_dp    = dp_replicate x dp_shard x cp       the group expert gradients are averaged over

With ep = 1 the two expert groups are the dense ones (the same DeviceMesh objects, no new process groups).
FSDP's mesh is 1-D (dp_shard_cp, or expert_shard for the experts), 2-D with dp_replicate in front under HSDP.

Backend: NCCL on GPUs, gloo on CPU, chosen automatically.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainscale.errors import TrainscaleError
from trainscale.placement import FLAT_DIMS, MESH_DIMS, mesh_shape, mesh_sizes
from trainscale.specs import Layout


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    """NCCL where there are GPUs, gloo on CPU."""
    return "nccl" if device_type() == "cuda" else "gloo"


def exit_rank(code: int) -> NoReturn:
    """End a rank's process now with ``code``, after flushing stdout and stderr, without Python's
    finalization. By then the job's files are closed and the default group destroyed, but the process
    groups a DeviceMesh made are still referenced (torch's mesh caches keep them) and are torn down during
    finalization with their gloo threads; a C++ thread that needs the GIL then is ended by the interpreter
    (pthread_exit through a noexcept frame: "terminate called without an active exception", SIGABRT),
    which torchrun reports as a failed rank after the job succeeded. Seen in CI on jobs that trained
    several layouts in one process (more groups left at exit), never reproduced in isolation."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(code)


def free_port() -> int:
    """A TCP port on localhost nobody listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with keys namespaced by the restart attempt: after a restart, the ranks
    must not find the crashed attempt's addresses (a stale key makes gloo connect to a dead port)."""
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(not use_agent and rank == 0), timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"trainscale/attempt{attempt}", store)


def init_distributed(timeout_s: float | None = None) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...), or make a
    one-process group when run directly, so one code path serves both. -> this rank's device."""
    if device_type() == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            # a collective that waits longer than the timeout fails, so a hung rank fails the job
            # (and torchrun restarts it) instead of stalling it forever
            timeout = datetime.timedelta(seconds=timeout_s or 1800)
            dist.init_process_group(backend(), store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            dist.init_process_group(backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dev


@dataclass
class ParallelMesh:
    """The world mesh plus this rank's coordinate on every dimension."""

    layout: Layout
    world: DeviceMesh
    flat: dict[str, DeviceMesh] = field(default_factory=dict)  # the flattened dims, kept (not re-sliced)

    @property
    def sizes(self) -> dict[str, int]:
        return mesh_sizes(self.layout)

    def __getitem__(self, dim: str) -> DeviceMesh:
        return self.flat[dim] if dim in self.flat else self.world[dim]

    def coord(self, dim: str) -> int:
        return self[dim].get_local_rank()

    def group(self, dim: str) -> dist.ProcessGroup:
        return self[dim].get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh: 1-D (dp_shard_cp), or 2-D (dp_replicate, dp_shard_cp) for HSDP."""
        if self.layout.dp_replicate > 1:
            return DeviceMesh._concatenate([self.world["dp_replicate"], self.flat["dp_shard_cp"]])
        return self.flat["dp_shard_cp"]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh for a MoE layer's routed experts (each rank's E/ep of them): the ranks holding the same
        experts, 1-D (expert_shard = dp_shard x cp), or 2-D (dp_replicate, expert_shard) for HSDP."""
        if self.layout.dp_replicate > 1:
            return DeviceMesh._concatenate([self.world["dp_replicate"], self.flat["expert_shard"]])
        return self.flat["expert_shard"]

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def cp_rank(self) -> int:
        return self.coord("cp")

    @property
    def tp_rank(self) -> int:
        return self.coord("tp")


def build_mesh(layout: Layout) -> ParallelMesh:
    """Lay ``layout`` over the running world (whose size must equal layout.world_size)."""
    world = dist.get_world_size()
    if world != layout.world_size:
        raise TrainscaleError(f"layout {layout} needs {layout.world_size} processes, but {world} are running")
    p = ParallelMesh(layout, init_device_mesh(device_type(), mesh_shape(layout), mesh_dim_names=MESH_DIMS))
    # without expert parallelism the expert groups are the dense ones (ep = 1): the same DeviceMesh objects, not
    # new process groups (every group is more gloo connections and threads per rank, per layout)
    same = {"expert_shard": "dp_shard_cp", "expert_dp": "dp_cp"} if layout.ep == 1 else {}
    for name, dims in FLAT_DIMS.items():
        if name not in same:
            p.flat[name] = p.world[dims]._flatten(name)
    for name, dense in same.items():
        p.flat[name] = p.flat[dense]
    return p
