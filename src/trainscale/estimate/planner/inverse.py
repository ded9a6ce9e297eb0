"""The planner asked backwards: how many GPUs finish the tokens in D days, what a GPU-hour budget buys, and the
largest model of a family that fits a cluster. Each answer is the planner's own search (``Problem.search``) run
on other GPU counts or other models; nothing here models time or memory itself.

GPU counts are the ones a cluster is allocated in (``gpu_counts``): whole servers, and below one server the
parts of a server a job can hold (the divisors of its GPUs per server). The planner's best time is not monotone
in the count (a count whose factors divide nothing has no layout), so the count is found by a bracket: counts
on a geometric ladder until one meets the target, then bisection between that rung and the one below, which
ends on two neighbouring counts, the larger meeting the target and the smaller not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trainscale.errors import FieldError, TrainscaleError
from trainscale.estimate import flops
from trainscale.estimate.planner.plan import Problem, layout_at
from trainscale.specs import ClusterSpec, ModelSpec, catalog_names, load_model


@dataclass(frozen=True)
class Point:
    """The planner's best layout on ``gpus`` GPUs (``layout`` None when nothing fits there)."""

    gpus: int
    layout: str | None
    tokens_per_s: float
    row: dict[str, Any] | None

    @property
    def fits(self) -> bool:
        return self.layout is not None

    def days(self, tokens: float) -> float:
        """Days to train ``tokens`` (infinite when nothing fits)."""
        return tokens / self.tokens_per_s / flops.SECONDS_PER_DAY if self.fits else float("inf")

    def gpu_hours(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / flops.SECONDS_PER_HOUR * self.gpus if self.fits else float("inf")

    def as_dict(self, tokens: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"gpus": self.gpus, "layout": self.layout, "tokens_per_s": self.tokens_per_s}
        if tokens is not None and self.fits:
            out.update(days=self.days(tokens), gpu_hours=self.gpu_hours(tokens))
        return out


def gpu_counts(cluster: ClusterSpec, upto: int) -> list[int]:
    """Counts a job on this cluster can have, up to ``upto``: the divisors of a server's GPUs below one server,
    then whole servers."""
    per = cluster.gpus_per_server
    part = [d for d in range(1, per) if per % d == 0 and d <= upto]
    return part + list(range(per, upto + 1, per))


class Searcher:
    """The planner's best layout per GPU count for one problem, each count searched once."""

    def __init__(self, p: Problem) -> None:
        self.p = p
        self.points: dict[int, Point] = {}

    def at(self, n: int) -> Point:
        if n not in self.points:
            q = self.p if n == self.p.n_gpus else replace(self.p, n_gpus=n)
            s = q.search()
            b = s.best()
            self.points[n] = (Point(n, None, 0.0, None) if b is None else
                              Point(n, str(layout_at(s.cfg, b)), float(s.res["tokens_per_s"][b]),
                                    q.row(s.cfg, s.res, b)))
        return self.points[n]

    def boundary(self, counts: list[int], ok: Callable[[Point], bool], first: bool = True) -> tuple[int, int] | None:
        """Indices (lo, hi) of two neighbouring counts where ``ok`` changes: with ``first``, the smallest rung
        of the ladder that is ok and the count just below it that is not (lo = -1 when the smallest count is
        ok); otherwise the largest ok rung and the count just above it that is not (hi = len when the largest
        is ok). None when no rung is ok."""
        rungs = _ladder(counts, self.p.cluster.gpus_per_server)
        good = [i for i in rungs if ok(self.at(counts[i]))]
        if not good:
            return None
        if first:
            hi = good[0]
            below = [i for i in rungs if i < hi]
            lo = below[-1] if below else -1
            inside, outside = hi, lo
        else:
            lo = good[-1]
            above = [i for i in rungs if i > lo]
            hi = above[0] if above else len(counts)
            inside, outside = lo, hi
        if outside in (-1, len(counts)):
            return (outside, inside) if first else (inside, outside)
        while abs(inside - outside) > 1:
            mid = (inside + outside) // 2
            if ok(self.at(counts[mid])):
                inside = mid
            else:
                outside = mid
        return (outside, inside) if first else (inside, outside)


def _ladder(counts: list[int], per: int) -> list[int]:
    """Indices of the rungs: every part of a server, the power-of-two multiples of a server (``per`` GPUs; each
    rung about twice the last) and the largest count."""
    out = [i for i, c in enumerate(counts) if c < per or (c % per == 0 and _pow2(c // per))]
    if not out or out[-1] != len(counts) - 1:
        out.append(len(counts) - 1)
    return out


def _d(days: float) -> str:
    """Days as the sentences give them: three significant digits, whole days from 100 on."""
    return f"{days:,.0f}" if days >= 100 else f"{days:.3g}"


def _pow2(k: int) -> bool:
    return k > 0 and k & (k - 1) == 0


# ------------------------------------------------------------------ the questions


@dataclass
class Answer:
    """What an inverse question found: the chosen point (None: nothing meets the target), the neighbour that
    shows it is the boundary, every count searched, and one sentence."""

    question: str
    point: Point | None
    neighbour: Point | None
    searched: list[Point]
    sentence: str
    tokens: float | None = None  # the training tokens days and GPU-hours are counted for
    extra: dict[str, Any] = field(default_factory=dict)  # what one question adds (the model, tokens bought)

    def as_dict(self) -> dict[str, Any]:
        t = self.tokens
        return {"question": self.question, "answer": None if self.point is None else self.point.as_dict(t),
                "neighbour": None if self.neighbour is None else self.neighbour.as_dict(t),
                "searched": [pt.as_dict(t) for pt in sorted(self.searched, key=lambda q: q.gpus)],
                "sentence": self.sentence, "tokens": t, **self.extra}


def _need_tokens(p: Problem, what: str) -> float:
    if not p.train_tokens:
        raise TrainscaleError(f"{what} needs --tokens (the training budget in tokens, e.g. --tokens 15.6T)")
    return float(p.train_tokens)


def gpus_for_days(p: Problem, target_days: float, upto: int | None = None) -> Answer:
    """The fewest GPUs (up to ``upto``, default the problem's count) whose best layout trains the problem's
    tokens within ``target_days``: a count that does, next to the count below it that does not."""
    if not target_days > 0:
        raise FieldError("target_days", f"must be positive, not {target_days}")
    tokens = _need_tokens(p, "--days")
    s = Searcher(p)
    counts = gpu_counts(p.cluster, upto or p.n_gpus)
    found = s.boundary(counts, lambda pt: pt.days(tokens) <= target_days)
    q = f"GPUs to train {tokens:,.0f} tokens of {p.model.name} in {target_days:g} days"
    if found is None:
        best = max(s.points.values(), key=lambda pt: pt.tokens_per_s)
        why = (f"the fastest searched, {best.gpus:,} GPUs with {best.layout}, takes {_d(best.days(tokens))} days"
               if best.fits else "no searched count has a layout that fits")
        return Answer(q, None, None, list(s.points.values()),
                      f"no count up to {counts[-1]:,} GPUs of {p.gpu.name} trains it in {target_days:g} days: "
                      f"{why}", tokens)
    lo, hi = found
    pt, nb = s.at(counts[hi]), (s.at(counts[lo]) if lo >= 0 else None)
    tail = (f"; {nb.gpus:,} GPUs would take {_d(nb.days(tokens))} days" if nb is not None and nb.fits else
            f"; on {nb.gpus:,} GPUs no layout fits" if nb is not None else "; it is the smallest count")
    return Answer(q, pt, nb, list(s.points.values()),
                  f"{pt.gpus:,} GPUs train it in {_d(pt.days(tokens))} days with {pt.layout}{tail}", tokens)


def budget(p: Problem, gpu_hours: float, upto: int | None = None) -> Answer:
    """What ``gpu_hours`` buy. With the problem's tokens: the fastest count (up to ``upto``) whose GPU-hours
    stay within the budget. Without: the count whose best layout trains the most tokens in the budget (the best
    tokens/s per GPU), and how long that takes."""
    if not gpu_hours > 0:
        raise FieldError("gpu_hours", f"must be positive, not {gpu_hours}")
    s = Searcher(p)
    counts = gpu_counts(p.cluster, upto or p.n_gpus)
    if not p.train_tokens:
        return _most_tokens(p, s, counts, gpu_hours)
    tokens = float(p.train_tokens)
    q = f"the fastest way to train {tokens:,.0f} tokens of {p.model.name} in {gpu_hours:,.0f} GPU-hours"
    found = s.boundary(counts, lambda pt: pt.gpu_hours(tokens) <= gpu_hours, first=False)
    if found is None:
        cheap = min(s.points.values(), key=lambda pt: pt.gpu_hours(tokens))
        why = (f"the cheapest searched, {cheap.gpus:,} GPUs with {cheap.layout}, needs "
               f"{cheap.gpu_hours(tokens):,.0f} GPU-hours" if cheap.fits else "no searched count has a layout "
               "that fits")
        return Answer(q, None, None, list(s.points.values()),
                      f"no count up to {counts[-1]:,} GPUs trains it within {gpu_hours:,.0f} GPU-hours: {why}",
                      tokens)
    lo, hi = found
    within = [pt for pt in s.points.values() if pt.gpu_hours(tokens) <= gpu_hours]
    pt = min(within, key=lambda x: x.days(tokens))
    nb = s.at(counts[hi]) if hi < len(counts) else None
    tail = (f"; {nb.gpus:,} GPUs would need {nb.gpu_hours(tokens):,.0f} GPU-hours" if nb is not None and nb.fits
            else "")
    return Answer(q, pt, nb, list(s.points.values()),
                  f"{pt.gpus:,} GPUs train it in {_d(pt.days(tokens))} days and {pt.gpu_hours(tokens):,.0f} "
                  f"GPU-hours with {pt.layout}{tail}", tokens)


def _most_tokens(p: Problem, s: Searcher, counts: list[int], gpu_hours: float) -> Answer:
    """Tokens in a budget = tokens/s x budget seconds / GPUs: the ladder's counts, the best per GPU taken."""
    q = f"the most tokens of {p.model.name} in {gpu_hours:,.0f} GPU-hours"
    pts = [s.at(counts[i]) for i in _ladder(counts, p.cluster.gpus_per_server)]
    fit = [pt for pt in pts if pt.fits]
    if not fit:
        return Answer(q, None, None, pts, f"no count up to {counts[-1]:,} GPUs has a layout of {p.model.name} "
                      "that fits")
    pt = max(fit, key=lambda x: x.tokens_per_s / x.gpus)
    n_tok = pt.tokens_per_s * gpu_hours * flops.SECONDS_PER_HOUR / pt.gpus
    days = gpu_hours / pt.gpus / 24
    return Answer(q, pt, None, pts, f"{pt.gpus:,} GPUs with {pt.layout} train the most, {n_tok:,.0f} tokens, "
                  f"in {_d(days)} days", None, {"tokens_in_budget": n_tok, "days_in_budget": days})


# ------------------------------------------------------------------ the largest model


_SIZE = re.compile(r"^(?P<family>.+?)-(?P<size>\d+(?:\.\d+)?[bm]|\d+x\d+(?:\.\d+)?b)$", re.IGNORECASE)


def family(name: str) -> str:
    """A catalog name without its size: llama3.1-405b -> llama3.1, mpt-7b -> mpt, mixtral-8x7b -> mixtral."""
    m = _SIZE.match(name)
    return m.group("family") if m else name


def family_members(name: str) -> list[ModelSpec]:
    """The catalog's models of ``name``'s family (published architectures, each with its source), largest first
    by parameter count."""
    from trainscale.estimate.params import numel, tensor_inventory

    fam = family(name)
    members = [load_model(n) for n in catalog_names("models") if family(n) == fam]
    if not members:
        raise TrainscaleError(f"--max-model: the catalog has no model of the family '{fam}' (from {name}); "
                              f"families: {', '.join(sorted({family(n) for n in catalog_names('models')}))}")
    return sorted(members, key=lambda m: numel(tensor_inventory(m)), reverse=True)


def max_model(p: Problem) -> Answer:
    """The largest catalog model of the problem's model family with a layout that fits the problem's GPUs,
    found by searching each member from the largest down. The family's published sizes are the candidates: a
    shape between them (layers or width scaled by hand) is not a model anyone has trained or checked."""
    members = family_members(p.model.name)
    tried: list[Point] = []
    notes: list[str] = []
    q = f"the largest {family(p.model.name)} model that fits {p.n_gpus:,} x {p.gpu.name}"
    for m in members:
        try:
            pm = replace(p, model=m)
            s = pm.search()
        except TrainscaleError as e:  # e.g. a member this runtime cannot build, with --runnable
            notes.append(f"{m.name}: {e}")
            continue
        b = s.best()
        if b is None:
            lean = float(s.res["mem_total"].min()) if s.n_valid else float("nan")
            notes.append(f"{m.name} does not fit" + (f" (its leanest layout needs {lean / 1e9:,.1f} GB per GPU)"
                                                     if s.n_valid else " (no layout divides)"))
            continue
        pt = Point(p.n_gpus, str(layout_at(s.cfg, b)), float(s.res["tokens_per_s"][b]), pm.row(s.cfg, s.res, b))
        tried.append(pt)
        sentence = f"{m.name} is the largest of its family in the catalog that fits, with {pt.layout}"
        return Answer(q, pt, None, tried, sentence + ("; " + "; ".join(notes) if notes else ""), p.train_tokens,
                      {"model": m.name, "not_fitting": notes})
    return Answer(q, None, None, tried, f"no {family(p.model.name)} model in the catalog fits {p.n_gpus:,} x "
                  f"{p.gpu.name}: " + "; ".join(notes), p.train_tokens, {"model": None, "not_fitting": notes})
