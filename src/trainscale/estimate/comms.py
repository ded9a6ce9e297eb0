"""Communication: the topology a layout lands on, and what each collective costs on it.

Ranks are laid out [TP, CP, PP, DP] from inner to outer (Llama 3, arXiv 2407.21783 Sec. 3.3.2):
a group of size n whose members are ``stride`` ranks apart spans ``extent`` = n x stride
consecutive ranks. A group that fits in one scale-up domain (NVLink) runs at its bandwidth; one
that leaves it runs on the scale-out NICs its members drive on each server (one per member there), and one
that leaves a pod may share the oversubscribed uplinks. Every function takes scalars or numpy
arrays (the planner's search).

Bandwidths are per GPU and per direction; collectives are bandwidth-optimal rings
(Patarasuk & Yuan 2009; NCCL-tests PERFORMANCE.md "bus bandwidth"), so time = factor x bytes /
bus bandwidth + steps x latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trainscale.specs import ClusterSpec, GPUSpec


@dataclass(frozen=True)
class Topology:
    """The wires, per GPU and per direction, as the step-time model sees them."""

    name: str
    gpus_per_server: int
    scale_up_domain: int
    scale_up_bandwidth: float  # bytes/s per GPU per direction (NVLink)
    scale_up_latency_s: float
    network_bandwidth: float  # bytes/s per GPU per direction (scale-out NIC)
    network_latency_s: float
    scale_up_efficiency: float = 1.0  # achieved bus bandwidth / link bandwidth
    network_efficiency: float = 1.0
    pod_gpus: int = 0  # 0: one flat network with full bisection bandwidth
    oversubscription: float = 1.0
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def topology(cluster: ClusterSpec, gpu: GPUSpec, scale_up_efficiency: float, network_efficiency: float,
             scale_up_latency_s: float, pod_gpus: int = 0, oversubscription: float = 1.0,
             source: str = "") -> Topology:
    """A cluster's topology. Vendors quote NVLink counting both directions: per direction = half
    (NVIDIA H100 datasheet: 900 GB/s total = 18 links x 25 GB/s x 2 directions)."""
    return Topology(name=cluster.name, gpus_per_server=cluster.gpus_per_server,
                    scale_up_domain=cluster.scale_up_domain, scale_up_bandwidth=gpu.scale_up_bandwidth / 2,
                    scale_up_latency_s=scale_up_latency_s, network_bandwidth=cluster.network_bandwidth,
                    network_latency_s=cluster.network_latency_s, scale_up_efficiency=scale_up_efficiency,
                    network_efficiency=network_efficiency, pod_gpus=pod_gpus, oversubscription=oversubscription,
                    source=source or cluster.source)


def in_scale_up(topo: Topology, extent: Any) -> Any:
    """A group stays on NVLink when the ranks it spans fit one scale-up domain."""
    return np.asarray(extent) <= topo.scale_up_domain


def pod_share(topo: Topology, n: Any, extent: Any) -> Any:
    """Fraction of the link rate a ring keeps when it spans several pods of an oversubscribed fabric.

    A topology-aware ring crosses each pod boundary once, so a pod carries one uplink flow per group
    while its uplinks carry pod_gpus / oversubscription GPUs' worth: the ring keeps
    min(1, members per pod / oversubscription) (Llama 3 Sec. 3.3.1 topology; NCCL rings follow it).
    """
    n, extent = np.asarray(n, dtype=float), np.asarray(extent, dtype=float)
    if not topo.pod_gpus or topo.oversubscription <= 1:
        return np.ones_like(extent)
    pods = np.ceil(extent / topo.pod_gpus)
    members = n / np.maximum(pods, 1)
    return np.where(pods > 1, np.minimum(1.0, members / topo.oversubscription), 1.0)


def nics_per_server(topo: Topology, n: Any, extent: Any) -> Any:
    """Scale-out NICs a collective of n ranks spanning ``extent`` ranks drives on each server at once: its members
    per server, k = n x gpus_per_server / extent (1 to gpus_per_server). NCCL builds one ring (or tree) per channel
    and leaves each server through the NIC nearest the channel's GPU, so the members of a server share the data
    crossing servers over k NICs while their own copies move on NVLink: a server ingests each byte once, not once
    per GPU (nccl-tests all_reduce_perf on 2 x 8 H100 with 8 x 200 Gb/s NICs per server reaches 339 GB/s bus
    bandwidth, far above one NIC's 25 GB/s: github.com/lessizzmore/create-a3mega-ztan-fork ztan-NCCL-test-result)."""
    n, extent = np.asarray(n, dtype=float), np.asarray(extent, dtype=float)
    k = n * topo.gpus_per_server / np.maximum(extent, 1)
    return np.clip(np.floor(k), 1, min(topo.gpus_per_server, topo.scale_up_domain))


def link(topo: Topology, n: Any, extent: Any, collective: bool = True) -> tuple[Any, Any]:
    """(bus bandwidth bytes/s, latency s per step) of a group of n ranks spanning ``extent`` ranks. A collective
    that leaves the scale-up domain runs on the NICs its members drive together (``nics_per_server``), never
    faster than their NVLink; a point-to-point send (``collective=False``) on one GPU's NIC."""
    inside = in_scale_up(topo, extent)
    nics = nics_per_server(topo, n, extent) if collective else 1.0
    up = topo.scale_up_bandwidth * topo.scale_up_efficiency
    bw = np.where(inside, up, np.minimum(up, nics * topo.network_bandwidth * topo.network_efficiency
                                         * pod_share(topo, n, extent)))
    lat = np.where(inside, topo.scale_up_latency_s, topo.network_latency_s)
    return bw, lat


def all_reduce_time(nbytes: Any, n: Any, bw: Any, latency: Any) -> Any:
    """Ring all-reduce: 2(n-1)/n · bytes / busbw + 2(n-1) latency steps (Patarasuk & Yuan 2009; NCCL-tests)."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency, 0.0)


def all_gather_time(nbytes: Any, n: Any, bw: Any, latency: Any) -> Any:
    """Ring all-gather of a ``nbytes`` result: (n-1)/n · bytes / busbw + (n-1) latency steps (NCCL-tests)."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, (n - 1) / n * nbytes / bw + (n - 1) * latency, 0.0)


def reduce_scatter_time(nbytes: Any, n: Any, bw: Any, latency: Any) -> Any:
    """Ring reduce-scatter of a ``nbytes`` input: (n-1)/n · bytes / busbw + (n-1) latency (NCCL-tests)."""
    return all_gather_time(nbytes, n, bw, latency)


def p2p_time(nbytes: Any, bw: Any, latency: Any) -> Any:
    """Point to point (pipeline activations): bytes / bandwidth + one latency."""
    return np.asarray(nbytes) / bw + latency


def all_to_all_time(nbytes: Any, n: Any, n_local: Any, topo: Topology, remote_copies: Any = None) -> Any:
    """An all-to-all of ``nbytes`` per rank over n ranks, ``n_local`` of them inside this rank's scale-up domain
    (Megatron-Core's token dispatcher, NCCL all_to_all / DeepEP): (n-1)/n of the bytes leave the rank, the share
    bound for the other n_local - 1 domain members on NVLink and the rest, (n - n_local)/n, on this GPU's own NIC
    (each GPU sends its own off-node traffic: an all-to-all cannot pool a server's NICs the way a ring does).
    ``remote_copies``, when given, is the off-node share of ``nbytes`` instead (node-limited routing sends one
    copy per target node and forwards it on NVLink: DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.2). Both links run at
    once: the slower sets the time, plus one network (or NVLink) latency. Scalars or numpy arrays."""
    n, n_local = np.asarray(n, dtype=float), np.asarray(n_local, dtype=float)
    up = topo.scale_up_bandwidth * topo.scale_up_efficiency
    net = topo.network_bandwidth * topo.network_efficiency
    off = (n - n_local) / np.maximum(n, 1) if remote_copies is None else np.asarray(remote_copies, dtype=float)
    t_up = nbytes * (n - 1) / np.maximum(n, 1) / up
    t_net = nbytes * off / net
    lat = np.where(n > n_local, topo.network_latency_s, topo.scale_up_latency_s)
    return np.where(n > 1, np.maximum(t_up, t_net) + lat, 0.0)
