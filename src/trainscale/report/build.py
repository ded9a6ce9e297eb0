"""Assemble the report: pick the figures that the inputs allow and write index.html beside them.

With a run folder the page is the run's: its loss (held-out points and the unigram baseline), throughput
and MFU with every restart marked, its layout; the seed walkthrough (a frontier model on a data center)
follows only when asked for (``walkthrough``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate import flops, power
from trainscale.estimate.params import param_count
from trainscale.estimate.walkthrough import DEFAULT_SEQ
from trainscale.report import plots
from trainscale.report.html import write_page
from trainscale.report.schedule import bubble_fraction, rank_orders, timeline
from trainscale.runtime.job.metrics import run_rows
from trainscale.safeio import atomic_write_json, read_json_object
from trainscale.specs import Layout, facts, load_cluster, load_facility, load_gpu, load_model


def seed_sections(out: Path, model: str, gpu: str, gpus: int, cluster: str, layout: Layout | None,
                  tokens: float, mfu: float, home_gpu: str = "rtx4090", micro_batches: int | None = None,
                  seq: int = DEFAULT_SEQ) -> tuple[list, list[tuple[str, str]]]:
    m, g, home, cl, fac = load_model(model), load_gpu(gpu), load_gpu(home_gpu), load_cluster(cluster), load_facility()
    c = flops.training_compute(m, tokens, seq)  # the one convention explain, plan and the runtime count in
    sections: list[tuple[str, list[plots.Plot]]] = []
    sections.append(("Memory", [plots.training_state(m, [home, g], out)]))
    gr = facts()["compute_growth"]
    sections.append(("Time and compute", [plots.time_to_train(m, tokens, c, home, g, gpus, mfu, out),
                                          plots.compute_growth(c, gr["low"], gr["high"], out)]))
    if layout is not None:
        if layout.world_size != gpus:
            raise TrainscaleError(f"layout {layout} uses {layout.world_size:,} GPUs, not the {gpus:,} asked for")
        memory, invalid = layout_fit(model, gpu, gpus, cluster, layout, seq)
        mesh = [plots.layout_mesh(layout, cl, out, memory=memory, invalid=invalid)]
        if layout.pp > 1:
            m_mb = micro_batches or (max(layout.pp * 2, 8) if layout.schedule != "interleaved" else layout.pp * 2)
            tl = timeline(rank_orders(layout.schedule, layout.pp, m_mb, layout.v), layout.pp * layout.v)
            bf = bubble_fraction(tl)
            title = (f"{layout.schedule} schedule, {layout.pp} stages, {m_mb} micro-batches, v={layout.v}: "
                     f"bubble {bf / (1 - bf):.3f} of useful time (formula (p-1)/(v m) = "
                     f"{(layout.pp - 1) / (layout.v * m_mb):.3f})")
            mesh.append(plots.pipeline_gantt(tl, title, out))
        sections.append(("Parallel layout", mesh))
    gw = power.gpu_power_watts(gpus, g.tdp_watts)
    it = power.it_power_watts(gw, fac.server_overhead_fraction)
    racks = power.racks_for(gpus, cl.gpus_per_rack)
    days = flops.seconds_on(c, gpus, g.peak_bf16_flops, mfu) / flops.SECONDS_PER_DAY
    energy = power.energy_joules(power.facility_power_watts(it, fac.pue), days * flops.SECONDS_PER_DAY)
    summary = [
        ("model", f"{m.name}: {param_count(m):,} parameters"),
        ("training compute", f"{c:.3g} FLOPs ({flops.FLOP_CONVENTION_NAME}: {tokens:.3g} tokens of seq {seq:,})"),
        ("FLOP convention", flops.FLOP_CONVENTION),
        ("cluster", f"{gpus:,} x {g.name} in {racks:,} racks of {cl.gpus_per_rack}"),
        ("GPU power at TDP", f"{gw / 1e6:,.2f} MW ({g.tdp_watts:.0f} W each)"),
        ("GPUs at PUE " + f"{fac.pue}", f"{power.facility_power_watts(gw, fac.pue) / 1e6:,.2f} MW"),
        ("IT incl. servers, facility", f"{it / 1e6:,.2f} MW IT, {power.facility_power_watts(it, fac.pue) / 1e6:,.2f} "
                                       f"MW facility, {power.power_per_rack_watts(it, racks) / 1e3:,.1f} kW per rack"),
        ("floor under racks", f"{power.rack_floor_m2(racks, fac.rack_width_m, fac.rack_depth_m):,.0f} m2"),
        (f"days at {mfu:.0%} MFU", f"{days:,.1f}"),
        ("facility energy", f"{energy / 3.6e9:,.0f} MWh, {power.energy_cost(energy, fac.price_per_kwh) / 1e6:,.1f} M$ "
                            f"at {fac.price_per_kwh} $/kWh"),
    ]
    return sections, summary


def layout_fit(model: str, gpu: str, gpus: int, cluster: str, layout: Layout, seq: int
               ) -> tuple[tuple[float, float] | None, str | None]:
    """The planner's verdict on a layout: ((bytes per GPU, usable bytes), None), or (None, why it is invalid)."""
    from trainscale.estimate.planner.plan import problem

    try:
        row = problem(model=model, gpu=gpu, gpus=gpus, seq=seq, cluster=cluster).evaluate_layout(layout)
    except TrainscaleError as e:
        return None, str(e)
    return (row["memory_per_gpu_bytes"]["total"], row["memory_capacity_bytes"]), None


def plan_sections(out: Path, plan: dict[str, Any]) -> tuple[list, list[tuple[str, str]]]:
    """The planner's choice (``trainscale plan --json``): step-time and memory breakdown, and why."""
    parts = plan["step_time_parts_s"]
    mem = {k: v for k, v in plan["memory_per_gpu_bytes"].items() if k != "total"}
    step = plots.bars("plan_step_time", f"Predicted step time of {plan['layout']}", "seconds per step",
                      {k.replace("_", " "): {"predicted": v} for k, v in parts.items()}, out,
                      f"{plan['step_time_s']:.2f} s per step, MFU {plan['mfu']:.1%}.")
    memory = plots.bars("plan_memory", "Predicted memory per GPU (first pipeline stage)", "GB (decimal)",
                        {k: {"predicted": v / 1e9} for k, v in mem.items()}, out,
                        f"{plan['memory_per_gpu_bytes']['total'] / 1e9:.1f} GB of "
                        f"{plan['memory_capacity_bytes'] / 1e9:.0f} GB.")
    why = plan.get("why") or []
    step.table += [("why", str(w)) for w in (why if isinstance(why, list) else [why])]
    summary = [("planned layout", plan["layout"]), ("predicted MFU", f"{plan['mfu']:.1%}"),
               ("predicted tokens/s", f"{plan['tokens_per_s']:,.0f} tokens/s")]
    return [("The plan", [step, memory])], summary


def reliability_sections(out: Path, model: str, gpu: str, gpus: int, window_h: float = 6.0
                         ) -> tuple[list, list[tuple[str, str]]]:
    """Checkpoint-interval sweep, one simulated run's timeline, and the power trace derived from it."""
    import numpy as np

    from trainscale.estimate.reliability import STATES, reliability_report

    g, fac = load_gpu(gpu), load_facility()
    minutes = [1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120]
    rep = reliability_report(model=model, gpus=gpus, trials=200, sweep_intervals_s=[60 * x for x in minutes],
                             timeline=True)
    sw, iv = rep["sweep"], rep["intervals"]
    sweep_plot = plots.lines(
        "reliability_sweep", f"Effective training time vs checkpoint interval ({gpus:,} GPUs)",
        "checkpoint interval (minutes)", "effective training time (fraction of wall time)",
        {"simulated median": ([r["interval_s"] / 60 for r in sw], [r["effective_p50"] for r in sw]),
         "simulated p5": ([r["interval_s"] / 60 for r in sw], [r["effective_p5"] for r in sw]),
         "Daly analytic": ([r["interval_s"] / 60 for r in sw], [float(r["analytic"]) for r in sw])}, out,
        f"Monte Carlo of the whole run (Meta's interruption rates), checkpoint write "
        f"{rep['checkpoint']['write_s']:.1f} s, "
        f"restart {rep['checkpoint']['restart_s'] / 60:.0f} min.",
        marks={"Young interval (min)": iv["young_s"] / 60, "Daly interval (min)": iv["daly_s"] / 60},
        unit="of wall time")
    tl = rep["_timeline"]
    watts = power.state_power_watts(gpus, g.tdp_watts, fac.gpu_idle_fraction, fac.server_overhead_fraction, fac.pue)
    t = np.arange(0.0, window_h * 3600, 1.0)
    trace = power.power_trace(tl.state_at, t, STATES, watts)
    states = tl.state_at(t)
    power_plot = plots.lines(
        "power_trace", f"Facility power over the first {window_h:.0f} h of a simulated run", "time (hours)",
        "facility power (MW)", {"facility power": (list(t / 3600), list(trace / 1e6))}, out,
        "GPUs at TDP while computing, at idle while the job writes a checkpoint or restarts; x server overhead x PUE.",
        unit="MW")
    shares = {name: float((states == i).mean()) for i, name in enumerate(STATES)}
    power_plot.table += [("power computing", f"{watts['compute'] / 1e6:,.1f} MW"),
                         ("power paused (checkpoint / restart)", f"{watts['restart'] / 1e6:,.1f} MW"),
                         ("swing when the whole job pauses", f"{(watts['compute'] - watts['restart']) / 1e6:,.1f} MW")]
    power_plot.table += [(f"time {k} in window", f"{v:.1%}") for k, v in shares.items()]
    sim = rep["simulation"]
    n_int = rep["failures"]["expected_total"]
    summary = [("interruptions expected", f"{n_int:,.0f} in {rep['inputs']['days']:g} days"),
               ("effective training time", f"{sim['effective_p50']:.1%} (p5 {sim['effective_p5']:.1%}) at the Daly "
                                           f"interval {iv['daly_s'] / 60:.1f} min"),
               ("power swing on a pause", f"{(watts['compute'] - watts['restart']) / 1e6:,.1f} MW")]
    return [("Failures, checkpoints and power", [sweep_plot, power_plot])], summary


RESTART_KINDS = {"hand": "resumed by hand (--resume)", "torchrun": "torchrun restart", "slurm": "Slurm requeue"}


def restart_kind(prev: dict[str, Any], cur: dict[str, Any]) -> str:
    """How an attempt began after ``prev``, from two start events (runtime/job/runfolder.start_event): a new Slurm
    requeue count is Slurm's, a new torchrun attempt in the same launch is torchrun's, anything else (a new
    launch: the CLI or a person started the job again with --resume) was by hand."""
    if int(cur.get("requeue", 0)) != int(prev.get("requeue", 0)):
        return "slurm"
    if cur.get("launch") == prev.get("launch") and int(cur.get("attempt", 0)) != int(prev.get("attempt", 0)):
        return "torchrun"
    return "hand"


def run_timeline(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """A run's step rows in step order with each step once (its last run: a step run again after a restart
    replaced the lost one), and the restarts as (first step after it, label). Every attempt writes a start event
    first (runfolder.start_event); each after the first that trained is a restart, by hand, torchrun or Slurm
    (``restart_kind``). Folders from before start events: a change of the rows' ``attempt``/``requeue``."""
    last: dict[int, dict[str, Any]] = {}
    restarts: list[tuple[int, str]] = []
    starts = [r for r in rows if r.get("event") == "start"]
    prev_start: dict[str, Any] | None = None
    pending: str | None = None  # the kind of the restart whose first step is still to come
    prev_who = None
    for r in rows:
        if r.get("event") == "start":
            if prev_start is not None:
                pending = restart_kind(prev_start, r)
            prev_start = r
            continue
        if "loss" not in r or "step" not in r:
            continue
        step = int(r["step"])
        who = (int(r.get("requeue", 0)), int(r.get("attempt", 0)))
        if not starts and prev_who is not None and who != prev_who:
            pending = "slurm" if who[0] != prev_who[0] else "torchrun"
        prev_who = who
        if pending is not None:
            restarts.append((step, f"restart {len(restarts) + 1}: {RESTART_KINDS[pending]}, resumed after step "
                                   f"{step - 1}"))
            pending = None
        last[step] = r
    return [last[k] for k in sorted(last)], restarts


def eval_points(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The held-out evaluations by step (``eval_every`` rows and the final one; a step evaluated again after a
    restart counts once, its last value)."""
    return {int(r["step"]): r for r in rows if "val_loss" in r and "step" in r}


def _run_info(run_dir: Path) -> dict[str, Any]:
    try:
        return read_json_object(run_dir / "run.json", "run.json") if (run_dir / "run.json").exists() else {}
    except TrainscaleError:
        return {}


def unigram_baseline(info: dict[str, Any], evals: dict[int, dict[str, Any]]) -> tuple[str, float] | None:
    """The one unigram baseline of a run -> (what it is, nats/token): the held-out loss of the unigram model
    (train-split token frequencies, add-one smoothed: runtime/data/loader.unigram_loss) on the same held-out
    targets as the model's held-out loss, which it is compared with, and which train prints beside it; only a run
    without a held-out evaluation falls back to the entropy of the training tokens (a lower, in-sample figure)."""
    if evals and evals[max(evals)].get("unigram_loss") is not None:
        return "held-out loss of the unigram model", float(evals[max(evals)]["unigram_loss"])
    if info.get("unigram_loss") is not None:
        return "held-out loss of the unigram model", float(info["unigram_loss"])
    if info.get("unigram_entropy") is not None:
        return "entropy of the training tokens' unigram distribution", float(info["unigram_entropy"])
    return None


def run_label(run_dir: Path) -> str:
    """How a page names a run: its folder as given ("runs/run"), never the bare last name ("run run")."""
    return f"the run in {run_dir}"


def run_loss_plot(out: Path, run_dir: Path, steps: list[dict[str, Any]], rows: list[dict[str, Any]],
                  info: dict[str, Any], marks: dict[str, float], note: str) -> plots.Plot:
    """Training loss per step, the held-out loss as points, the run's unigram baseline as a level."""
    xs = [float(r["step"]) for r in steps]
    series = {"train loss (global batch)": (xs, [float(r["loss"]) for r in steps])}
    evals = eval_points(rows)
    if evals:
        ks = sorted(evals)
        series["held-out loss"] = ([float(k) for k in ks], [float(evals[k]["val_loss"]) for k in ks])
    base = unigram_baseline(info, evals)
    levels = {f"unigram baseline: {base[0]}": base[1]} if base else {}
    caption = ("Per-step loss on the global batch; dots: held-out loss (eval_every and the end); dotted: the "
               "unigram baseline, the loss of a model that ignores context." + note)
    return plots.lines("run_loss", f"Training loss of {run_label(run_dir)}", "step", "cross-entropy (nats/token)",
                       series, out, caption, marks=marks, unit="nats/token", points={"held-out loss"}, levels=levels)


def run_layout_plot(out: Path, info: dict[str, Any]) -> plots.Plot | None:
    """The run's own layout, one square per process (a server of the run's size: its processes on one machine)."""
    from trainscale.specs import ClusterSpec

    try:
        lay = Layout.parse(str(info["layout"]))
    except (KeyError, TrainscaleError):
        return None
    n = lay.world_size
    per = min(n, 8)
    device = str(info.get("device", "cpu"))
    cl = ClusterSpec(name=f"this run's {n} process(es), {device}", gpu=device, gpus=n, gpus_per_server=per,
                     servers_per_rack=-(-n // per), scale_up_domain=per, network_bandwidth=1.0)
    return plots.layout_mesh(lay, cl, out, unit="GPUs" if device == "cuda" else "processes")


def run_sections(out: Path, run_dir: Path) -> tuple[list, list[tuple[str, str]]]:
    """Figures of a real training run folder (metrics.jsonl written by trainscale train)."""
    rows = run_rows(run_dir)  # one sentence for a folder without metrics.jsonl or with a damaged line
    steps, restarts = run_timeline(rows)
    if not steps:
        raise TrainscaleError(f"{run_dir / 'metrics.jsonl'} has no training steps")
    info = _run_info(run_dir)
    xs = [float(r["step"]) for r in steps]
    marks = {label: float(step) for step, label in restarts}
    note = (f" Dashed lines: the {len(restarts)} restart(s); a step run again after a restart is drawn once "
            "(its last run)." if restarts else "")
    figs = [run_loss_plot(out, run_dir, steps, rows, info, marks, note)]
    if all("tokens_per_s" in r for r in steps):
        figs.append(plots.lines("run_throughput", "Throughput", "step", "tokens per second",
                                {"tokens/s": (xs, [float(r["tokens_per_s"]) for r in steps])}, out, note.strip(),
                                marks=marks, unit="tokens/s"))
    if all("mfu" in r for r in steps):
        figs.append(plots.lines("run_mfu", "Model FLOPs utilization", "step", "MFU (fraction of peak)",
                                {"MFU": (xs, [float(r["mfu"]) for r in steps])}, out, marks=marks,
                                unit="of peak"))
    mesh = run_layout_plot(out, info)
    if mesh is not None:
        figs.append(mesh)
    summary = [("run", str(run_dir)), ("steps", f"{len(steps)} steps"),
               ("final loss", f"{float(steps[-1]['loss']):.4f} nats/token"),
               ("restarts", f"{len(restarts)} restart(s)" + "".join(f"; {label}" for _, label in restarts))]
    evals = eval_points(rows)
    if evals:
        k = max(evals)
        summary.append(("held-out loss", f"{float(evals[k]['val_loss']):.4f} nats/token at step {k} "
                                         f"({len(evals)} evaluation(s))"))
    base = unigram_baseline(info, evals)
    if base is not None:
        summary.append(("unigram baseline", f"{base[1]:.4f} nats/token ({base[0]})"))
    for r in rows:
        if "goodput" in r:
            summary.append(("goodput", f"{float(r['goodput']):.1%} of wall time"))
    label = run_label(run_dir)
    return [(label[0].upper() + label[1:], figs)], summary


def build_report(out: str | Path, model: str = "llama3.1-405b", gpu: str = "h100-sxm", gpus: int = 16384,
                 cluster: str = "meta-h100", layout: str | None = "tp8,cp1,pp16,dp128,mb1,v8,zero2",
                 tokens: float | None = None, mfu: float = 0.40, run_dir: str | Path | None = None,
                 plan_file: str | Path | None = None, seq: int | None = None, walkthrough: bool | None = None
                 ) -> Path:
    """The report page; with ``plan_file`` (``trainscale plan --json``) the model, GPUs, cluster, layout, MFU,
    sequence and training tokens are the plan's, so its days are the plan's days. With ``run_dir`` the page
    leads with the run, and the walkthrough pages (memory, time, layout, failures and power of ``model`` on
    ``gpus``) follow only with ``walkthrough=True`` (default: without a run, or with a plan)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if walkthrough is None:
        walkthrough = run_dir is None or plan_file is not None
    sections: list = []
    summary: list[tuple[str, str]] = []
    if run_dir is not None:
        rs, rsum = run_sections(out, Path(run_dir))
        sections += rs
        summary += rsum
        if not walkthrough:
            return _write(out, f"trainscale report: {run_label(Path(run_dir))}",
                          "Every number below is read from the run folder's records (metrics.jsonl, run.json).",
                          sections, summary)
    tokens = tokens if tokens is not None else facts()["llama3_405b_training"]["tokens"]
    plan = None
    plan, seq = None, seq or DEFAULT_SEQ
    if plan_file is not None:
        plan = read_json_object(plan_file, "plan JSON")
        try:
            inp = plan["inputs"]
            model, gpu, gpus, layout = inp["model"], inp["gpu"], int(inp["gpus"]), plan["layout"]
            cluster = inp.get("cluster") or cluster
            mfu, seq = float(plan["mfu"]), int(inp["seq"])
            tokens = float(inp["train_tokens"]) if inp.get("train_tokens") else tokens
        except (KeyError, TypeError, ValueError) as e:
            raise TrainscaleError(f"{plan_file} is not the output of 'trainscale plan --json' (no {e})") from None
    lay = Layout.parse(layout) if layout else None
    ws, wsum = seed_sections(out, model, gpu, gpus, cluster, lay, tokens, mfu,
                             micro_batches=plan.get("micro_batches") if plan else None, seq=seq)
    sections += ws
    summary += wsum
    if plan is not None:
        ps, psum = plan_sections(out, plan)
        sections += ps
        summary += psum
    rel_sections, rel_summary = reliability_sections(out, model, gpu, gpus)
    sections += rel_sections
    summary += rel_summary
    title = f"trainscale report: {model} on {gpus:,} x {gpu}"
    if run_dir is not None:
        title = f"trainscale report: {run_label(Path(run_dir))}, then {model} on {gpus:,} x {gpu}"
    return _write(out, title, "Every number below is computed by trainscale from the model, hardware and run inputs.",
                  sections, summary)


def _write(out: Path, title: str, intro: str, sections: list, summary: list[tuple[str, str]]) -> Path:
    page = write_page(out, title, intro, sections, summary)
    atomic_write_json(out / "report.json", {
        "summary": dict(summary),
        "figures": [{"key": p.key, "title": p.title, "files": p.files, "table": dict(p.table)}
                    for _, ps in sections for p in ps]})
    return page
