"""Power and floor space."""

from __future__ import annotations

from math import ceil


def gpu_power_watts(n_gpus: int, tdp_watts: float, utilization: float = 1.0) -> float:
    """GPUs drawing ``utilization`` x TDP: the ceiling is n x TDP (datasheet TDP)."""
    return n_gpus * tdp_watts * utilization


def facility_power_watts(it_watts: float, pue: float) -> float:
    """PUE = facility power / IT power (The Green Grid; Uptime Institute 2024 average 1.56)."""
    return it_watts * pue


def racks_for(n_gpus: int, gpus_per_rack: int) -> int:
    return ceil(n_gpus / gpus_per_rack)


def rack_floor_m2(n_racks: int, width_m: float, depth_m: float) -> float:
    """Footprint of the racks alone (no aisles): n x width x depth (Open Rack V3: 0.6 x 1.068 m)."""
    return n_racks * width_m * depth_m


def energy_joules(watts: float, seconds: float) -> float:
    return watts * seconds


def gpu_draw_watts(tdp_watts: float, utilization: float, idle_fraction: float) -> float:
    """Per-GPU draw between idle and TDP, linear in utilization: idle + (TDP - idle) x u.

    A linear power model (Fan, Weber & Barroso 2007, "Power provisioning for a warehouse-sized
    computer", ISCA, Sec. 4); ``idle_fraction`` is idle power / TDP.
    """
    idle = idle_fraction * tdp_watts
    return idle + (tdp_watts - idle) * utilization


def it_power_watts(gpu_watts: float, overhead_fraction: float) -> float:
    """IT power = GPUs x (1 + overhead) for CPUs, memory, network and storage around them."""
    return gpu_watts * (1.0 + overhead_fraction)


def energy_cost(joules: float, price_per_kwh: float) -> float:
    return joules / 3.6e6 * price_per_kwh


def power_per_rack_watts(it_watts: float, n_racks: int) -> float:
    return it_watts / n_racks


def state_power_watts(n_gpus: int, tdp_watts: float, idle_fraction: float, overhead_fraction: float, pue: float,
                      busy: float = 1.0) -> dict[str, float]:
    """Facility power in each state of a run: GPUs computing draw ``busy`` x TDP (recomputed work
    too), GPUs waiting on a checkpoint write or a restart draw idle power; servers and the facility
    scale it (overhead, PUE). The gap between the two is the swing Meta describes ("tens of
    megawatts", Llama 3, arXiv 2407.21783 Sec. 3.3.4) when the whole job pauses at once."""
    def facility(u: float) -> float:
        gpu = gpu_power_watts(n_gpus, gpu_draw_watts(tdp_watts, u, idle_fraction))
        return facility_power_watts(it_power_watts(gpu, overhead_fraction), pue)

    return {"compute": facility(busy), "lost": facility(busy), "checkpoint": facility(0.0),
            "restart": facility(0.0)}


def power_trace(state_at, times, state_names: tuple[str, ...], watts_by_state: dict[str, float]):
    """Power at each time from a run's state timeline (``Timeline.state_at`` of the reliability
    simulation): -> numpy array of watts (0 outside the run)."""
    import numpy as np

    idx = state_at(times)
    table = np.array([watts_by_state[s] for s in state_names] + [0.0])
    return table[np.where(idx < 0, len(state_names), idx)]
