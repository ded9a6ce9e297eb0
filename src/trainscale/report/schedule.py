"""Pipeline schedules as timelines, for the Gantt chart.

Each rank runs an ordered list of actions (forward / backward of a stage on a micro-batch). GPipe
and 1F1B orders are the ones torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B execute
(all forwards then all backwards; p-1-rank warm-up forwards, then one-forward-one-backward, then
cool-down). The interleaved order is taken from torch's own ScheduleInterleaved1F1B, which is the
order the runtime executes. ``timeline`` then places every action at the earliest time its rank is
free and its data dependency (previous stage's forward, next stage's backward) is done.
"""

from __future__ import annotations

Action = tuple[str, int, int]  # (kind "F"/"B", stage index, micro-batch)


def rank_orders(schedule: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    if schedule == "gpipe":
        return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)]
    if schedule == "1f1b":
        out = []
        for r in range(pp):
            warm = min(pp - 1 - r, m)
            acts: list[Action] = [("F", r, i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                if f < m:
                    acts.append(("F", r, f))
                    f += 1
                acts.append(("B", r, b))
                b += 1
            out.append(acts)
        return out
    if schedule == "interleaved":
        return _torch_interleaved(pp, m, v)
    raise ValueError(f"schedule must be gpipe, 1f1b or interleaved, not {schedule!r}")


def _torch_interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """The action order torch's ScheduleInterleaved1F1B computes (and then executes) per rank."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    if m % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) to be a multiple of pp ({pp})")
    s = object.__new__(ScheduleInterleaved1F1B)  # only the order calculation, no stages or process group
    s._n_microbatches, s.pp_group_size, s.n_local_stages = m, pp, v
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    out = []
    for r in range(pp):
        acts = []
        for a in s._calculate_single_rank_operations(r):
            if a is None:
                continue
            kind = str(a.computation_type.value)
            if kind in ("F", "B"):
                acts.append((kind, a.stage_index, a.microbatch_index))
        out.append(acts)
    return out


def timeline(orders: list[list[Action]], n_stages: int, f_cost: int = 1, b_cost: int = 2
             ) -> list[list[tuple[str, int, int, int]]]:
    """Place actions in time: -> per rank [(kind, micro-batch, start, duration)]. Backward costs
    twice a forward (4 vs 2 FLOPs per parameter per token)."""
    done: dict[Action, int] = {}
    free = [0] * len(orders)
    pos = [0] * len(orders)
    out: list[list[tuple[str, int, int, int]]] = [[] for _ in orders]
    total = sum(len(o) for o in orders)
    while sum(pos) < total:
        progressed = False
        for r, acts in enumerate(orders):
            if pos[r] == len(acts):
                continue
            kind, st, mb = acts[pos[r]]
            if kind == "F":
                dep = ("F", st - 1, mb) if st > 0 else None
            else:
                dep = ("B", st + 1, mb) if st < n_stages - 1 else ("F", st, mb)
            if dep is not None and dep not in done:
                continue
            start = max(free[r], done.get(dep, 0) if dep else 0)
            dur = f_cost if kind == "F" else b_cost
            done[(kind, st, mb)] = start + dur
            free[r] = start + dur
            out[r].append((kind, mb, start, dur))
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline order deadlocks")
    return out


def bubble_fraction(tl: list[list[tuple[str, int, int, int]]]) -> float:
    """Idle share of the makespan across ranks."""
    end = max(s + d for rank in tl for _, _, s, d in rank)
    busy = sum(d for rank in tl for *_, d in rank)
    return 1 - busy / (end * len(tl))
