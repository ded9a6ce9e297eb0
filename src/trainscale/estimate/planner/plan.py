"""The planner: every valid 4D layout for a model on N GPUs, scored at once, best first.

A layout is valid when it keeps the rules of ``trainscale.rules.PLANNED`` (tp x cp x pp x dp = N, TP divides
the attention heads, the KV heads and the MLP width, the layers split over pp x v chunks, the sequence into
2 x cp chunks, the global batch into dp x micro-batch, ...; each rule with its sentence there), and
``RUNNABLE`` too when the search is asked for what this runtime trains (``Problem(runnable=True)``). It fits
when the first stage's memory (``step.evaluate``) is within the GPU's. Layouts are ranked by tokens/s, then by
memory headroom. The whole space is built and scored with numpy: no Python loop per layout.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainscale import rules
from trainscale.errors import FieldError, TrainscaleError
from trainscale.estimate import flops
from trainscale.estimate.comms import Topology
from trainscale.estimate.planner.candidates import INTERLEAVED, RECOMPUTE, SCHEDULE
from trainscale.estimate.planner.efficiencies import Efficiencies, cluster_topology, load_efficiencies, planner_catalog
from trainscale.estimate.planner.software import PRECISIONS, Software, load_software, resolve_precision, with_knobs
from trainscale.estimate.planner.step import evaluate, memory_capacity
from trainscale.specs import (
    MAX_DIGITS,
    ClusterSpec,
    GPUSpec,
    Layout,
    ModelSpec,
    catalog_names,
    load_cluster,
    load_gpu,
    load_model,
)

KEYS = ("tp", "cp", "pp", "dp", "mb", "v", "schedule", "recompute", "zero", "hsdp", "sp", "ep", "first", "last")
MICRO_BATCHES = (1, 2, 4, 8, 16)  # micro-batch sizes (sequences) the search tries
ZERO_STAGES = (0, 1, 2, 3)
STEP_PARTS = {"t_compute": "compute", "t_recompute": "recompute", "t_tp_comm": "tp_comm", "t_cp_comm": "cp_comm",
              "t_bubble": "pipeline_bubble", "t_pp_p2p": "pipeline_p2p", "t_dp_comm": "dp_comm",
              "t_optimizer": "optimizer"}
MEM_PARTS = {"mem_weights": "weights", "mem_gradients": "gradients", "mem_optimizer": "optimizer",
             "mem_activations": "activations", "mem_buffers": "buffers"}


def divisors(n: int) -> np.ndarray:
    d = np.arange(1, n + 1)
    return d[n % d == 0]


def pick_cluster(gpu: str | None, n_gpus: int, cluster: str | None = None) -> tuple[ClusterSpec, GPUSpec]:
    """The cluster named, else a catalog cluster built from this GPU (the smallest that holds n_gpus, else the
    largest), else the generic 8-GPU-server topology in catalog/planner.toml."""
    if cluster:
        cl = load_cluster(cluster)
        return cl, load_gpu(gpu or cl.gpu)
    g = load_gpu(gpu or "h100-sxm")
    same = [load_cluster(c) for c in catalog_names("clusters")]
    same = [c for c in same if c.gpu == g.name]
    if same:
        big = [c for c in same if c.gpus >= n_gpus]
        cl = min(big, key=lambda c: c.gpus) if big else max(same, key=lambda c: c.gpus)
        return cl, g
    gen = dict(planner_catalog()["topology"]["generic"])
    return ClusterSpec(name="generic", gpu=g.name, gpus=n_gpus, **gen), g


@dataclass
class Problem:
    """One planning question: which layout trains ``model`` fastest on ``n_gpus`` of ``gpu``."""

    model: ModelSpec
    gpu: GPUSpec
    cluster: ClusterSpec
    topo: Topology
    eff: Efficiencies
    n_gpus: int
    seq: int
    global_batch_tokens: int
    train_tokens: float | None = None
    software: Software | None = None
    fix: dict[str, Any] = field(default_factory=dict)
    forbid: tuple[str, ...] = ()
    max_v: int | None = None
    runnable: bool = False  # search only what this runtime trains (rules.RUNNABLE), not all it plans (PLANNED)
    global_seqs: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n_gpus <= 0:
            raise FieldError("gpus", f"must be positive, not {self.n_gpus}")
        if self.seq <= 0:
            raise FieldError("seq", f"must be positive, not {self.seq}")
        if self.global_batch_tokens <= 0 or self.global_batch_tokens % self.seq:
            lo = max(self.seq, self.global_batch_tokens // self.seq * self.seq)
            raise TrainscaleError(
                f"a global batch of {self.global_batch_tokens:,} tokens is not a whole number of {self.seq:,}-token "
                f"sequences; use a multiple of {self.seq:,}, e.g. {lo:,} or {lo + self.seq:,}")
        if self.train_tokens is not None and self.train_tokens <= 0:
            raise FieldError("tokens", f"must be positive, not {self.train_tokens}")
        self.global_seqs = self.global_batch_tokens // self.seq
        if self.runnable:
            rules.check_model(self.model)  # a model this runtime cannot build has no runnable layout, said as such
        self.software = load_software(self.software)
        self.fix = parse_fix(self.fix) if isinstance(self.fix, str) else dict(self.fix)
        self.forbid = parse_forbid(self.forbid) if isinstance(self.forbid, str) else tuple(self.forbid)
        ep = self.fix.get("ep")
        if ep is not None:  # a fixed EP degree the model cannot take is said as such, not as "no layout divides"
            if ep < 1:
                raise FieldError("fix", f"ep={ep}: the expert-parallel degree must be at least 1")
            # the experts rules alone, over the whole GPU count (dp is not known yet) for what would divide
            fixed = rules.Case({"ep": np.array([ep]), "dp": np.array([self.n_gpus]), "hsdp": np.array([1])},
                               model=self.model)
            why = rules.first_broken(fixed, ("experts_dense", "experts"))
            if why:
                raise TrainscaleError(f"--fix ep={ep}: {why}")

    # ------------------------------------------------------------------ validity

    @property
    def rule_names(self) -> tuple[str, ...]:
        """The rules a layout of this search keeps (``rules.RUNNABLE`` or ``rules.PLANNED``)."""
        return rules.RUNNABLE if self.runnable else rules.PLANNED

    def case(self, c: dict[str, np.ndarray]) -> rules.Case:
        """Layout arrays as the rules read them, for this model, sequence, batch and GPU count."""
        return rules.Case({k: np.asarray(c[k]) for k in rules.LAYOUT_FIELDS if k in c}, SCHEDULE, self.model,
                          self.seq, self.global_seqs, self.n_gpus)

    def constraints(self, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each rule of this search as a boolean array (True = satisfied)."""
        return rules.check(self.case(c), self.rule_names)

    def runnable_mask(self, c: dict[str, np.ndarray]) -> np.ndarray:
        """Which layouts this runtime trains (``rules.RUNNABLE``)."""
        return rules.holds(self.case(c), rules.RUNNABLE)

    def why_invalid(self, lay: Layout) -> str | None:
        """One sentence for the first rule ``lay`` breaks, with what would divide; None when valid."""
        return rules.first_broken(self.case(_cfg([lay])), self.rule_names)

    def why_not_runnable(self, lay: Layout) -> str | None:
        """The sentence of the first rule of ``rules.RUNNABLE`` ``lay`` breaks: why this runtime would not train it."""
        return rules.first_broken(self.case(_cfg([lay])), rules.RUNNABLE)

    # ------------------------------------------------------------------ the space

    def enumerate(self) -> tuple[dict[str, np.ndarray], int]:
        """Every valid layout as arrays, and how many candidates were generated before filtering."""
        m, n = self.model, self.n_gpus
        d = divisors(n)
        vs = np.union1d(divisors(m.n_layers), divisors(m.n_layers + 2))
        tp, cp, pp = (a.ravel() for a in np.meshgrid(d, d, d, indexing="ij"))
        whole = n % (tp * cp * pp) == 0  # tp x cp x pp x dp = N: only the triples that leave a whole dp
        j, v, sched = (a.ravel() for a in np.meshgrid(np.flatnonzero(whole), vs, np.arange(len(SCHEDULE)),
                                                       indexing="ij"))
        tp, cp, pp = tp[j], cp[j], pp[j]
        base = {"tp": tp, "cp": cp, "pp": pp, "dp": n // (tp * cp * pp), "v": v, "schedule": sched,
                "hsdp": np.ones_like(tp), "ep": np.ones_like(tp), "first": np.zeros_like(tp), "last": np.zeros_like(tp)}
        # the rules these fields decide now (the rest once every field is known); interleaving with v1 is 1F1B
        keep = rules.holds(self.case(base), self.rule_names, partial=True) & ((v > 1) | (sched != INTERLEAVED))
        base = {k: a[keep] for k, a in base.items()}
        if m.is_moe:
            # expert parallelism: every degree that divides the experts and the data-parallel ranks (it adds none)
            i, e = (a.ravel() for a in np.meshgrid(np.arange(base["tp"].size), divisors(m.n_experts), indexing="ij"))
            base = {k: a[i] for k, a in base.items()}
            base["ep"] = e
            base = {k: a[rules.holds(self.case(base), self.rule_names, partial=True)] for k, a in base.items()}
        # expand: micro-batch x recompute x ZeRO stage
        nb = base["tp"].size
        i, mb, rc, z = (a.ravel() for a in np.meshgrid(np.arange(nb), np.array(MICRO_BATCHES), np.arange(3),
                                                          np.array(ZERO_STAGES), indexing="ij"))
        cfg = {k: a[i] for k, a in base.items()}
        cfg.update(mb=mb, recompute=rc, zero=z, sp=np.ones(mb.shape, dtype=bool))
        # expert parallelism with zero0 replicates the experts over dp / ep; the EP group is any factor of dp
        generated = cfg["tp"].size
        ok = rules.holds(self.case(cfg), self.rule_names)
        # ZeRO over a single replica is ZeRO 0; keep one of each
        ok &= (cfg["zero"] == 0) | (cfg["cp"] * cfg["dp"] > 1)
        ok &= self.allowed(cfg)
        return {k: a[ok] for k, a in cfg.items()}, int(generated)

    def allowed(self, cfg: dict[str, np.ndarray]) -> np.ndarray:
        """What the software supports (its ZeRO stages, schedules, CP, virtual stages) and what the user fixed
        (--fix), forbade (--forbid) or capped (--max-v). ZeRO over one replica counts as any stage."""
        sw = self.software
        assert sw is not None
        zero, sched, cp, v = cfg["zero"], cfg["schedule"], cfg["cp"], cfg["v"]
        single = cfg["cp"] * cfg["dp"] == 1
        ok = np.isin(zero, list(sw.zero)) | single
        ok &= np.isin(sched, [SCHEDULE.index(x) for x in sw.schedules]) | (cfg["pp"] == 1)
        if not sw.cp:
            ok &= cp == 1
        max_v = min(sw.max_v, self.max_v) if self.max_v else sw.max_v
        ok &= np.where(sched == 2, v, 1) <= max_v
        for k, val in self.fix.items():
            ok &= cfg[k] == val
        for tok in self.forbid:
            key, val = FORBID[tok]
            ok &= (cfg[key] <= 1) if val is None else (cfg[key] != val)
        return ok

    def score(self, cfg: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return evaluate(self.model, self.gpu, self.topo, self.eff, self.seq, self.global_seqs, cfg, self.software)

    def search(self) -> SearchResult:
        t0 = time.perf_counter()
        cfg, generated = self.enumerate()
        res = self.score(cfg)
        order = np.lexsort((-res["headroom"], -res["tokens_per_s"], ~res["fits"])) if cfg["tp"].size else \
            np.zeros(0, dtype=int)
        return SearchResult(self, cfg, res, order, generated, time.perf_counter() - t0)

    def evaluate_layout(self, lay: Layout) -> dict[str, Any]:
        why = self.why_invalid(lay)
        if why:
            raise TrainscaleError(why)
        cfg = _cfg([lay])
        return self.row(cfg, self.score(cfg), 0)

    # ------------------------------------------------------------------ output

    def row(self, cfg: dict[str, np.ndarray], res: dict[str, np.ndarray], i: int) -> dict[str, Any]:
        """One layout's figures as plain Python (the --json shape)."""
        lay = layout_at(cfg, i)
        tps = float(res["tokens_per_s"][i])
        out: dict[str, Any] = {
            "layout": str(lay),
            "step_time_s": float(res["step_time_s"][i]),
            "step_time_parts_s": {name: float(res[k][i]) for k, name in STEP_PARTS.items()},
            "mfu": float(res["mfu"][i]), "hfu": float(res["hfu"][i]),
            "mfu_by_convention": self.mfu_conventions(tps),
            "tflops_per_gpu": float(res["tflops_per_gpu"][i]),
            "tokens_per_s": tps,
            "memory_per_gpu_bytes": {"total": float(res["mem_total"][i]),
                                     **{name: float(res[k][i]) for k, name in MEM_PARTS.items()}},
            "memory_capacity_bytes": float(memory_capacity(self.gpu, self.eff)),
            "headroom_bytes": float(res["headroom"][i]),
            "fits": bool(res["fits"][i]),
            "runnable": bool(self.runnable_mask({k: a[i:i + 1] for k, a in cfg.items()})[0]),
            "micro_batches": int(res["micro_batches"][i]),
            "bubble_fraction": float(res["bubble_fraction"][i]),
            "layers_first_stage": int(res["layers_first_stage"][i]),
            "layers_max_stage": int(res["layers_max_stage"][i]),
            "heaviest_stage": int(res["heaviest_stage"][i]),
            "memory_first_stage_bytes": float(res["mem_first_stage"][i]),
            "hw_tflops_per_gpu": float(res["hw_tflops_per_gpu"][i]),
            "compute_parts_s": {"gemm": float(res["t_gemm"][i]), "attention": float(res["t_attention"][i]),
                                "elementwise": float(res["t_elementwise"][i])},
            "flop_convention": FLOP_CONVENTION,
            "software": self.software.name if self.software else None,
            "tp_in_scale_up": bool(res["tp_in_scale_up"][i]),
            "days": None, "gpu_hours": None,
        }
        if self.model.is_moe:
            out["step_time_parts_s"]["ep_comm"] = float(res["t_ep_comm"][i])
            out["ep_in_scale_up"] = bool(res["ep_in_scale_up"][i])
            out["a2a_per_moe_layer_s"] = float(res["a2a_per_layer_s"][i])
        if self.train_tokens:
            secs = self.train_tokens / tps
            out["days"] = secs / flops.SECONDS_PER_DAY
            out["gpu_hours"] = secs / flops.SECONDS_PER_HOUR * self.n_gpus
        return out

    def mfu_conventions(self, tokens_per_s: float) -> dict[str, float]:
        """The same throughput under the MFU conventions in use: 6N + attention with and without causal halving
        (PaLM App. B counts the full 12·L·H·Q·T; FlashAttention skips the masked half), and 6N alone."""
        m, n = self.model, flops.matmul_params(self.model)
        per = {"6N+attention causal": flops.training_flops_per_token(m, self.seq),  # the one FLOP_CONVENTION
               "6N+attention full": flops.model_flops_per_token(m, n, self.seq, causal=False),
               "6N": 6.0 * n}
        return {k: flops.mfu(tokens_per_s, v, self.n_gpus, self.gpu.peak_bf16_flops) for k, v in per.items()}

    def inputs(self) -> dict[str, Any]:
        return {"model": self.model.name, "gpu": self.gpu.name, "gpus": self.n_gpus, "seq": self.seq,
                "global_batch_tokens": self.global_batch_tokens, "global_batch_sequences": self.global_seqs,
                "train_tokens": self.train_tokens, "cluster": self.cluster.name,
                "peak_flops": self.gpu.peak_bf16_flops, "memory_bytes": self.gpu.memory_bytes,
                "software": self.software.name if self.software else None,
                "precision": self.software.precision if self.software else "bf16", "fix": self.fix,
                "forbid": list(self.forbid), "max_v": self.max_v, "runnable_only": self.runnable}

    def suggestions(self, lay: Layout, limit: int = 3) -> list[dict[str, Any]]:
        """Nearby layouts that fit when ``lay`` does not, fastest first: other recompute modes and ZeRO stages,
        and a doubled pp, cp or tp (fewer layers, or less sequence, per GPU) in place of half the data parallelism."""
        f = lay.model_dump()
        shifts: list[dict[str, int]] = [{}]
        if lay.dp % 2 == 0:
            shifts += [{k: f[k] * 2, "dp": lay.dp // 2} for k in ("pp", "cp", "tp")]
        cands: list[Layout] = []
        vs = np.union1d(divisors(self.model.n_layers), divisors(self.model.n_layers + 2))
        for shift in shifts:
            pp = shift.get("pp", lay.pp)
            # the schedule as given, and interleaving with the most virtual stages the layers allow
            sched = [{}]
            ok_v = vs[(vs > 1) & rules.balanced_cut(self.model.n_layers, pp, pp * vs)]
            if pp > 1 and ok_v.size:
                sched.append({"schedule": "interleaved", "v": int(ok_v.max())})
            for sc in sched:
                for rc in RECOMPUTE:
                    for z in ZERO_STAGES:
                        try:
                            c = Layout(**{**f, **shift, **sc, "recompute": rc, "zero": z})
                        except ValueError:
                            continue
                        if c != lay and self.why_invalid(c) is None:
                            cands.append(c)
        cands = list({str(c): c for c in cands}.values())  # one of each
        if not cands:
            return []
        cfg = _cfg(cands)
        keep = self.allowed(cfg)  # what the software supports and the user allowed
        cfg = {k: a[keep] for k, a in cfg.items()}
        if not cfg["tp"].size:
            return []
        res = self.score(cfg)
        idx = [int(i) for i in np.lexsort((-res["headroom"], -res["tokens_per_s"])) if res["fits"][i]]
        return [self.row(cfg, res, i) for i in idx[:limit]]


@dataclass
class SearchResult:
    problem: Problem
    cfg: dict[str, np.ndarray]
    res: dict[str, np.ndarray]
    order: np.ndarray
    generated: int
    seconds: float

    @property
    def n_valid(self) -> int:
        return int(self.cfg["tp"].size)

    @property
    def n_fit(self) -> int:
        return int(self.res["fits"].sum()) if self.n_valid else 0

    def best(self) -> int | None:
        if not self.n_fit:
            return None
        return int(self.order[0])

    def top(self, k: int) -> list[int]:
        return [int(i) for i in self.order[: min(k, self.n_fit)]]

    def runners_up(self, keys: tuple[str, ...] = ("tp", "pp", "cp", "v", "recompute", "zero", "mb")
                   ) -> list[dict[str, Any]]:
        """The best fitting layout that differs from the winner in each dimension, and what it loses on."""
        b = self.best()
        if b is None:
            return []
        if self.problem.model.is_moe and "ep" not in keys:
            keys = (*keys, "ep")
        fits = self.res["fits"]
        rank = np.empty(self.order.size, dtype=np.int64)
        rank[self.order] = np.arange(self.order.size)
        # how many choices (other than dp, which follows from the rest) a layout changes from the winner
        changed = sum((self.cfg[k] != self.cfg[k][b]).astype(np.int64) for k in KEYS if k != "dp")
        out, seen = [], {b}
        for k in keys:
            # the nearest fitting layout that changes k: fewest other changes, then the fastest
            ok = fits & (self.cfg[k] != self.cfg[k][b])
            ok[list(seen)] = False
            if not ok.any():
                continue
            cand = np.flatnonzero(ok)
            i = int(cand[np.lexsort((rank[cand], changed[cand]))[0]])
            seen.add(i)
            out.append(self.compare(i, b, k))
        # the fastest layout overall, if memory ruled it out
        fastest = int(np.argmax(self.res["tokens_per_s"]))
        if not fits[fastest]:
            out.append(self.compare(fastest, b, "memory"))
        return out

    def compare(self, i: int, b: int, differs: str) -> dict[str, Any]:
        r, p = self.res, self.problem
        lay = layout_at(self.cfg, i)
        slower = float(r["step_time_s"][i] / r["step_time_s"][b] - 1)
        if not r["fits"][i]:
            cap = memory_capacity(p.gpu, p.eff)
            reason = (f"{-slower:.1%} faster, but needs {r['mem_total'][i] / 1e9:,.1f} GB per GPU against "
                      f"{cap / 1e9:,.0f} GB")
        else:
            parts = {**STEP_PARTS, "t_ep_comm": "ep_comm"} if p.model.is_moe else STEP_PARTS
            deltas = {name: float(r[k][i] - r[k][b]) for k, name in parts.items()}
            worst = max(deltas, key=deltas.get)
            reason = f"{slower:.1%} slower: {_because(worst, deltas[worst], self, i)}"
        return {"layout": str(lay), "differs_in": differs, "step_time_s": float(r["step_time_s"][i]),
                "slower_by": slower, "fits": bool(r["fits"][i]), "reason": reason}

    def why_best(self) -> list[str]:
        """Sentences that say why the winner wins, from its own numbers."""
        b = self.best()
        if b is None:
            return []
        r, c, p = self.res, self.cfg, self.problem
        tp, cp, pp, v = (int(c[k][b]) for k in ("tp", "cp", "pp", "v"))
        out = []
        dom = p.topo.scale_up_domain
        if tp > 1:
            where = f"inside one {dom}-GPU NVLink domain" if r["tp_in_scale_up"][b] else "across the network"
            out.append(f"TP{tp} keeps the per-layer tensor-parallel traffic {where} "
                       f"({r['t_tp_comm'][b]:.2f} s of the {r['step_time_s'][b]:.2f} s step).")
        if pp > 1:
            sch = f"interleaved with v{v}" if int(c["schedule"][b]) == 2 else SCHEDULE[int(c["schedule"][b])]
            out.append(f"PP{pp} ({sch}, {int(r['micro_batches'][b])} micro-batches) costs a "
                       f"{r['bubble_fraction'][b]:.1%} bubble; its first stage holds {int(r['layers_first_stage'][b])} "
                       f"layers" + (" (the end stages give a layer's slot to the embedding and head, as Llama 3 does)"
                                    if r["balanced_ends"][b] else "") + ".")
        if p.model.is_moe:
            out.append(self.why_ep(b))
        if cp > 1:
            out.append(f"CP{cp} splits each sequence {cp} ways, dividing activations by {cp} for "
                       f"{r['t_cp_comm'][b]:.2f} s of exposed K/V all-gather per step.")
        rc = RECOMPUTE[int(c["recompute"][b])]
        out.append(f"Recompute {rc}: {r['mem_activations'][b] / 1e9:,.1f} GB of activations for "
                   f"{r['t_recompute'][b]:.2f} s of recomputation per step; ZeRO-{int(c['zero'][b])} over "
                   f"{int(c['cp'][b] * c['dp'][b])} replicas leaves {r['t_dp_comm'][b]:.2f} s of DP traffic exposed.")
        out.append(f"It uses {r['mem_total'][b] / 1e9:,.1f} GB of the {memory_capacity(p.gpu, p.eff) / 1e9:,.1f} GB "
                   f"a GPU offers ({r['headroom'][b] / 1e9:,.1f} GB headroom) at {r['mfu'][b]:.1%} MFU.")
        n_faster = int((r["tokens_per_s"] > r["tokens_per_s"][b]).sum())
        out.append(f"Searched {self.generated:,} candidates: {self.n_valid:,} divide, {self.n_fit:,} fit; "
                   f"{n_faster:,} faster layouts do not fit in memory.")
        return out

    def why_ep(self, b: int) -> str:
        """Where the winner's expert-parallel group sits and what its all-to-all costs, against the fastest
        fitting layout whose EP group sits on the other side of the scale-up boundary."""
        r, c, p = self.res, self.cfg, self.problem
        ep, dom = int(c["ep"][b]), p.topo.scale_up_domain
        inside = bool(r["ep_in_scale_up"][b])
        span = int(c["ep"][b] * c["tp"][b] * c["cp"][b])
        where = f"inside one {dom}-GPU NVLink domain" if inside else f"across {-(-span // dom)} scale-up domains"
        a2a = float(r["a2a_per_layer_s"][b])
        line = (f"EP{ep} splits the {p.model.n_experts} experts of each MoE layer {where}: its dispatch + combine "
                f"all-to-all takes {a2a * 1e3:.2f} ms per MoE layer per micro-batch, {r['t_ep_comm'][b]:.2f} s of the "
                f"step exposed")
        other = r["fits"] & (r["ep_in_scale_up"] != inside) & (c["ep"] > 1)
        if other.any():
            j = int(np.flatnonzero(other)[np.argmax(r["tokens_per_s"][other])])
            side = "across nodes" if inside else "inside a node"
            line += (f"; the best layout with EP {side}, {layout_at(c, j)}, spends {r['a2a_per_layer_s'][j] * 1e3:.2f} "
                     f"ms per MoE layer ({r['t_ep_comm'][j]:.2f} s exposed) and is "
                     f"{r['step_time_s'][j] / r['step_time_s'][b] - 1:.1%} slower")
        return line + "."

    def nothing_fits(self) -> str:
        """One sentence: why nothing fits and what would."""
        p = self.problem
        cap = memory_capacity(p.gpu, p.eff)
        what = "that this runtime trains " if p.runnable else ""
        head = (f"no layout of {p.model.name} {what}fits {cap / 1e9:,.0f} GB per GPU on {p.n_gpus:,} {p.gpu.name} "
                f"at seq {p.seq:,}")
        if not self.n_valid and p.runnable:
            planned, _ = replace(p, runnable=False).enumerate()
            if planned["tp"].size:
                return (f"none of the {planned['tp'].size:,} layouts the planner finds for {p.model.name} on "
                        f"{p.n_gpus:,} GPUs is one this runtime trains, e.g. {layout_at(planned, 0)}: "
                        f"{p.why_invalid(layout_at(planned, 0))}")
        if not self.n_valid:
            return (f"no layout of {p.model.name} {what}divides on {p.n_gpus:,} GPUs with a {p.global_seqs:,}-sequence "
                    f"batch (tp | {p.model.n_heads} heads and {p.model.n_kv_heads} KV heads, pp x v | "
                    f"{p.model.n_layers} layers, dp x mb | batch); try a GPU count and batch with more factors of 2")
        lean = int(np.argmin(self.res["mem_total"]))
        msg = (f"{head}: the leanest, {layout_at(self.cfg, lean)}, needs "
               f"{self.res['mem_total'][lean] / 1e9:,.1f} GB")
        more = self.more_gpus()
        if more:
            msg += f"; {more[0]:,} GPUs would fit, with {more[1]}"
        else:
            msg += "; try a shorter sequence or a GPU with more memory"
        return msg

    def more_gpus(self, max_factor: int = 64) -> tuple[int, str] | None:
        """The smallest multiple (x2, x4, ...) of the GPU count on which some layout fits."""
        p = self.problem
        f = 2
        while f <= max_factor:
            q = Problem(p.model, p.gpu, p.cluster, p.topo, p.eff, p.n_gpus * f, p.seq, p.global_batch_tokens,
                        software=p.software, forbid=p.forbid, max_v=p.max_v, runnable=p.runnable)
            s = q.search()
            b = s.best()
            if b is not None:
                return q.n_gpus, str(layout_at(s.cfg, b))
            f *= 2
        return None


def _because(part: str, delta: float, s: SearchResult, i: int) -> str:
    r, c = s.res, s.cfg
    what = {
        "compute": "more compute time (smaller GEMMs or an unbalanced stage)",
        "recompute": f"recomputation (rc={RECOMPUTE[int(c['recompute'][i])]})",
        "tp_comm": "tensor-parallel traffic" + ("" if r["tp_in_scale_up"][i] else " leaving the NVLink domain"),
        "cp_comm": "the context-parallel K/V all-gather",
        "pipeline_bubble": f"the pipeline bubble ({r['bubble_fraction'][i]:.1%})",
        "pipeline_p2p": "pipeline point-to-point transfers",
        "dp_comm": f"exposed ZeRO-{int(c['zero'][i])} data-parallel traffic",
        "optimizer": "the optimizer step",
        "ep_comm": "the expert all-to-all" + ("" if r["ep_in_scale_up"][i] else " leaving the NVLink domain"),
    }[part]
    return f"{what}, +{delta:.2f} s per step"


def _cfg(lays: list[Layout], **override: int) -> dict[str, np.ndarray]:
    rows = [{**lay.model_dump(), **override} for lay in lays]
    return {
        "tp": np.array([r["tp"] for r in rows]), "cp": np.array([r["cp"] for r in rows]),
        "ep": np.array([r["ep"] for r in rows]),
        "pp": np.array([r["pp"] for r in rows]), "dp": np.array([r["dp"] for r in rows]),
        "mb": np.array([r["mb"] for r in rows]), "v": np.array([r["v"] for r in rows]),
        "schedule": np.array([SCHEDULE.index(r["schedule"]) for r in rows]),
        "recompute": np.array([RECOMPUTE.index(r["recompute"]) for r in rows]),
        "zero": np.array([r["zero"] for r in rows]), "hsdp": np.array([r["hsdp"] for r in rows]),
        "sp": np.array([r["sp"] for r in rows], dtype=bool),
        "first": np.array([r["first"] for r in rows]), "last": np.array([r["last"] for r in rows]),
    }


def layout_at(cfg: dict[str, np.ndarray], i: int) -> Layout:
    pp, sched, v = int(cfg["pp"][i]), SCHEDULE[int(cfg["schedule"][i])], int(cfg["v"][i])
    return Layout(tp=int(cfg["tp"][i]), cp=int(cfg["cp"][i]), pp=pp, dp=int(cfg["dp"][i]), mb=int(cfg["mb"][i]),
                  v=v, schedule=sched if pp > 1 else "1f1b", recompute=RECOMPUTE[int(cfg["recompute"][i])],
                  zero=int(cfg["zero"][i]), hsdp=int(cfg["hsdp"][i]), sp=bool(cfg["sp"][i]),
                  ep=int(cfg["ep"][i]) if "ep" in cfg else 1, first=int(cfg["first"][i]) if "first" in cfg else 0,
                  last=int(cfg["last"][i]) if "last" in cfg else 0)


def problem(*, model: str = "llama3.1-405b", gpu: str | None = "h100-sxm", gpus: int = 16384, seq: int = 8192,
            global_batch_tokens: int = 2**24, tokens: float | None = None, cluster: str | None = None,
            profile: str | None = None, overrides: dict[str, float] | None = None,
            software: str | Software | None = None, fix: str | dict[str, Any] | None = None,
            forbid: str | tuple[str, ...] | None = None, max_v: int | None = None,
            precision: str | None = None, runnable: bool = False) -> Problem:
    """Build a planning problem from catalog names (or files), with the catalog's default efficiencies.
    ``precision`` (bf16 | fp16 | fp8) replaces the software's (fp16: the GEMMs at the bf16 rate, which the A100 and
    H100 datasheets give fp16 too, and the gradients as the software keeps them in fp16); ``runnable`` searches
    only what this runtime trains. Keyword-only: fifteen settings read by name, never by position."""
    m = load_model(model)
    cl, g = pick_cluster(gpu, gpus, cluster)
    sw = load_software(software)
    if precision is not None:
        if precision not in PRECISIONS:
            raise FieldError("precision", f"must be one of {', '.join(PRECISIONS)}, not {precision!r}")
        sw = with_knobs(sw, precision=precision)
    sw = resolve_precision(sw)
    if sw.precision == "fp8" and not g.peak_fp8_flops:
        raise TrainscaleError(f"{g.name} has no FP8 tensor cores (catalog/gpus.toml gives it no FP8 peak), so FP8 "
                              "training cannot be planned on it; use --precision bf16")
    eff = load_efficiencies(g, profile, overrides, g.peak_bf16_flops, g.hbm_bandwidth, g.scale_up_bandwidth)
    if max_v is not None and max_v < 1:
        raise FieldError("max_v", f"must be at least 1, not {max_v}")
    return Problem(m, g, cl, cluster_topology(cl, g, eff), eff, gpus, seq, global_batch_tokens, tokens,
                   sw, fix or {}, forbid or (), max_v, runnable)


FLOP_CONVENTION = f"MFU = model FLOPs ({flops.FLOP_CONVENTION}) / peak; HFU adds the recomputed FLOPs"
FIXABLE = {"tp": int, "cp": int, "pp": int, "dp": int, "mb": int, "v": int, "zero": int, "hsdp": int, "ep": int,
           "schedule": SCHEDULE.index, "recompute": RECOMPUTE.index, "rc": RECOMPUTE.index}
# --forbid tokens: a dimension (forbids degrees > 1) or one choice
FORBID: dict[str, tuple[str, int | None]] = {
    "tp": ("tp", None), "cp": ("cp", None), "pp": ("pp", None), "ep": ("ep", None),
    **{f"zero{z}": ("zero", z) for z in range(4)}, "fsdp": ("zero", 3),
    **{name: ("schedule", i) for i, name in enumerate(SCHEDULE)},
    **{f"rc={name}": ("recompute", i) for i, name in enumerate(RECOMPUTE)},
    **{name: ("recompute", i) for i, name in enumerate(RECOMPUTE) if name != "none"},
}


def parse_fix(text: str) -> dict[str, int]:
    """``tp=8,pp=16,schedule=interleaved`` -> {"tp": 8, "pp": 16, "schedule": 2}; numbers of at most
    ``specs.MAX_DIGITS`` ASCII digits (no degree exceeds 10^6), read only after that check; each key once."""
    out: dict[str, int] = {}
    for raw in text.replace(" ", "").lower().split(","):
        if not raw:
            continue
        key, sep, val = raw.partition("=")
        if not sep or key not in FIXABLE:
            raise TrainscaleError(f"--fix takes key=value with key in {', '.join(FIXABLE)}, not '{_clip(raw)}'")
        name = "recompute" if key == "rc" else key
        if name in out:
            raise TrainscaleError(f"--fix sets {name} twice (again by '{_clip(raw)}'); give each key once")
        if FIXABLE[key] is int and not re.fullmatch(rf"[0-9]{{1,{MAX_DIGITS}}}", val):
            raise TrainscaleError(f"--fix {key} needs a whole number of at most {MAX_DIGITS} digits, not "
                                  f"'{_clip(val)}'")
        try:
            out[name] = int(FIXABLE[key](val))
        except ValueError:
            raise TrainscaleError(f"--fix {key}={_clip(val)} is not a valid value") from None
    return out


def _clip(text: str, n: int = 40) -> str:
    """A user's token as an error message quotes it: at most n characters."""
    return text if len(text) <= n else text[:n] + "..."


def parse_forbid(text: str) -> tuple[str, ...]:
    toks = tuple(t for t in text.replace(" ", "").lower().split(",") if t)
    bad = [t for t in toks if t not in FORBID]
    if bad:
        raise TrainscaleError(f"--forbid does not know {_clip(', '.join(bad))}; use {', '.join(FORBID)}")
    return toks
