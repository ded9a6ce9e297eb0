"""The seed article's running example, recomputed from first principles (``trainscale explain``).

``walkthrough()`` returns every figure with the formula that made it and where its inputs come from;
the CLI only formats it. Training compute is counted as everywhere in trainscale (``flops.FLOP_CONVENTION``:
6N + 6LHQT, N the matmul weights a token passes through, active ones for a MoE); the seed's 6ND rule of thumb
is shown beside it, named as such. Nothing here is a stored answer: change the model, GPU or cluster and every
figure follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainscale.errors import FieldError
from trainscale.estimate import flops, inference, memory, power
from trainscale.estimate.params import active_params, embedding_params, expert_params, param_count
from trainscale.specs import Facility, GPUSpec, ModelSpec, facts, load_facility, load_gpu, load_model

# Llama 3 405B pre-trained mostly on 8,192-token sequences (arXiv 2407.21783 Sec. 3.4.1: 4,096 at first, 8,192
# after 252M tokens): the sequence of the attention term when none is given.
DEFAULT_SEQ = 8192


@dataclass
class Figure:
    key: str
    label: str
    value: float
    unit: str
    formula: str
    source: str = ""


@dataclass
class Section:
    title: str
    figures: list[Figure] = field(default_factory=list)

    def add(self, *args: Any, **kw: Any) -> Figure:
        f = Figure(*args, **kw)
        self.figures.append(f)
        return f


@dataclass
class _Walk:
    """The inputs of one walkthrough and what the sections pass on to each other."""
    m: ModelSpec
    g: GPUSpec
    home: GPUSpec
    hm: ModelSpec
    fac: Facility
    f: dict[str, Any]
    tokens: float
    gpus: int
    seq: int
    mfu: float
    gpu_hours: float | None
    n: int = 0  # total parameters
    n_c: int = 0  # active parameters (embedding in), the total for a dense model
    c: float = 0.0  # training compute under flops.FLOP_CONVENTION
    days: float = 0.0

    @property
    def run(self) -> dict[str, Any]:
        return self.f["llama3_405b_training"]

    @property
    def is_seed(self) -> bool:
        return self.m.name == "llama3.1-405b"


def _inputs(model: str, tokens: float | None, gpu: str, gpus: int | None, mfu: float, home_gpu: str,
            home_model: str, gpu_hours: float | None, seq: int | None) -> _Walk:
    if not 0 < mfu <= 1:
        raise FieldError("mfu", f"must be in (0, 1], not {mfu}")
    if seq is not None and seq <= 0:
        raise FieldError("seq", f"must be a positive number of tokens, not {seq}")
    f = facts()
    run = f["llama3_405b_training"]
    w = _Walk(load_model(model), load_gpu(gpu), load_gpu(home_gpu), load_model(home_model), load_facility(), f,
              run["tokens"] if tokens is None else tokens, run["gpus"] if gpus is None else gpus,
              seq or DEFAULT_SEQ, mfu, gpu_hours)
    if w.gpu_hours is None and w.is_seed and w.g.name == "h100-sxm" and w.tokens == run["tokens"]:
        w.gpu_hours = run["gpu_hours"]
    w.n = param_count(w.m)
    # a mixture of experts: compute follows the parameters a token passes through (active), memory all of them
    w.n_c = active_params(w.m) if w.m.is_moe else w.n
    w.c = flops.training_compute(w.m, w.tokens, w.seq)
    return w


def _moe_counts(w: _Walk, s: Section) -> None:
    m, n, n_c = w.m, w.n, w.n_c
    conv = "embedding in, as DeepSeek-V3's 671B/37B and Mixtral's 46.7B/12.9B count"
    s.add("params", "total parameters (embedding in)", n, "params",
          f"embeddings + {m.first_dense_layers} dense + {m.n_moe_layers} MoE layers (router, "
          f"{m.n_experts} routed experts{', shared expert' if m.d_ff_shared else ''}) + head", m.source)
    s.add("expert_params", "of which routed experts", expert_params(m), "params",
          f"{m.n_moe_layers} layers x {m.n_experts} experts x FFN({m.d_model} x {m.expert_width})")
    s.add("active_params", "active per token (embedding in)", n_c, "params",
          f"total - routed x (1 - {m.experts_per_token}/{m.n_experts}); router, shared in full; {conv}",
          "estimate/params.py active_params")
    s.add("active_params_no_embedding", "active per token (embedding out)", active_params(m, embeddings=False),
          "params", "active - vocab x d_model (a lookup, no multiply-adds)")
    s.add("memory_follows_total", "memory: state of ALL parameters", 16.0 * n, "bytes",
          "16 B x total: bf16 weights + grads + Adam (every expert is held and trained)",
          "ZeRO (arXiv 1910.02054) Sec. 3.1")
    s.add("time_follows_active", "time: training FLOPs per token", flops.training_flops_per_token(m, w.seq), "FLOP",
          f"{flops.FLOP_CONVENTION_NAME}, N = active matmul weights only (active/total = {n_c / n:.1%})",
          "estimate/flops.py training_flops_per_token")
    s.add("embedding_params", "embedding table", embedding_params(m), "params", "vocab x d_model")


def _counting(w: _Walk) -> Section:
    """Parameters, the seed's 2N + 4N = 6N rule of thumb, and the training compute under the one convention."""
    m, n_c, moe = w.m, w.n_c, w.m.is_moe
    s = Section("Counting the math")
    if moe:
        _moe_counts(w, s)
    else:
        s.add("params", f"parameters of {m.name}", w.n, "params", "embeddings + L x (attention + MLP + norms) + head",
              m.source)
    kaplan = "Kaplan et al. 2020 (arXiv 2001.08361)"
    s.add("forward_flops_per_token", "forward FLOPs per token", flops.forward_flops_per_token(n_c), "FLOP",
          "2N" if not moe else "2 x active", kaplan)
    s.add("backward_flops_per_token", "backward FLOPs per token", flops.backward_flops_per_token(n_c), "FLOP",
          "4N" if not moe else "4 x active", kaplan)
    s.add("tokens", "training tokens", w.tokens, "tokens", "given", w.run["tokens_source"] if w.is_seed else "")
    s.add("rule_of_thumb_flops", "6ND rule of thumb", flops.training_flops(n_c, w.tokens), "FLOP",
          "6 x N x D (all parameters, no attention term)" if not moe else "6 x active x D (no attention term)",
          w.f["scaling_rule"]["source"])
    if w.is_seed:
        s.add("reported_flops", "Meta's reported compute", w.run["reported_flops"], "FLOP", "published",
              w.run["reported_flops_source"])
    s.add("matmul_params", "N of the FLOP count: matmul weights", flops.matmul_params(m), "params",
          "active weights a token multiplies by: LM head in, input embedding (a lookup) out",
          "estimate/flops.py matmul_params")
    s.add("attention_flops_per_token", f"causal attention FLOPs per token at seq {w.seq:,}",
          flops.attention_flops_per_token(m, w.seq, causal=True), "FLOP", "6·L·H·Q·T (12·L·H·Q·T halved)",
          "PaLM (arXiv 2204.02311) App. B")
    s.add("training_flops", f"training compute ({flops.FLOP_CONVENTION_NAME})", w.c, "FLOP",
          f"(6 x matmul weights + 6·L·H·Q·T) x D, T = {w.seq:,}", "estimate/flops.py training_compute")
    return s


def _one_gpu(w: _Walk) -> Section:
    """One home GPU against the math, and the cluster's days (published GPU-hours, or the compute at ``mfu``)."""
    g, home, c, mfu, gpus = w.g, w.home, w.c, w.mfu, w.gpus
    s = Section(f"One {home.name} against the math")
    years_peak = flops.seconds_on(c, 1, home.peak_bf16_flops) / flops.SECONDS_PER_YEAR
    s.add("one_gpu_seconds_at_peak", f"one {home.name} at peak, in seconds", years_peak * flops.SECONDS_PER_YEAR,
          "seconds", f"C / {home.peak_bf16_flops:.4g} FLOP/s", home.source)
    s.add("one_gpu_years_at_peak", f"one {home.name} at peak", years_peak, "years", "seconds / 31,557,600")
    s.add("one_gpu_years_at_mfu", f"one {home.name} at {mfu:.0%} MFU",
          flops.seconds_on(c, 1, home.peak_bf16_flops, mfu) / flops.SECONDS_PER_YEAR, "years", "years at peak / MFU")
    thumb = flops.training_flops(w.n_c, w.tokens)  # the seed's own chain: 6ND / peak, then at the MFU
    s.add("one_gpu_years_at_peak_6nd", f"one {home.name} at peak, 6ND rule of thumb",
          flops.seconds_on(thumb, 1, home.peak_bf16_flops) / flops.SECONDS_PER_YEAR, "years",
          "6ND / peak / 31,557,600")
    s.add("one_gpu_years_at_mfu_6nd", f"one {home.name} at {mfu:.0%} MFU, 6ND rule of thumb",
          flops.seconds_on(thumb, 1, home.peak_bf16_flops, mfu) / flops.SECONDS_PER_YEAR, "years",
          "6ND years at peak / MFU")
    if w.gpu_hours is not None:
        w.days = flops.days_from_gpu_hours(w.gpu_hours, gpus)
        s.add("gpu_hours", "reported GPU-hours", w.gpu_hours, "GPU-h", "published", w.run["gpu_hours_source"])
        s.add("cluster_days", f"{gpus:,} {g.name} running the whole time", w.days, "days", "GPU-hours / GPUs / 24")
    else:
        w.days = flops.seconds_on(c, gpus, g.peak_bf16_flops, mfu) / flops.SECONDS_PER_DAY
        s.add("gpu_hours", f"GPU-hours at {mfu:.0%} MFU", flops.gpu_hours(c, g.peak_bf16_flops, mfu), "GPU-h",
              "C / (peak x MFU) / 3600")
        s.add("cluster_days", f"{gpus:,} {g.name} at {mfu:.0%} MFU", w.days, "days", "C / (GPUs x peak x MFU)")
    s.add("cluster_gpu_vs_home", f"one {g.name} vs one {home.name}", g.peak_bf16_flops / home.peak_bf16_flops,
          "x", "peak / peak", g.source)
    if w.is_seed:
        implied = c / (gpus * g.peak_bf16_flops * w.days * flops.SECONDS_PER_DAY)
        s.add("implied_mfu", "utilization implied by those days", implied, "fraction",
              "C / (GPUs x peak x days x 86400)", w.run["mfu_source"])
    return s


def _racks(w: _Walk) -> Section:
    fac, gpus = w.fac, w.gpus
    s = Section("The racks")
    racks = power.racks_for(gpus, fac.gpus_per_rack)
    s.add("gpus", "GPUs", gpus, "GPUs", "given", w.run["gpus_source"] if w.is_seed else "")
    s.add("racks", f"racks of {fac.gpus_per_rack} GPUs", racks, "racks", "ceil(GPUs / GPUs per rack)",
          fac.gpus_per_rack_source)
    s.add("rack_floor_m2", "floor under the racks alone", power.rack_floor_m2(racks, fac.rack_width_m,
          fac.rack_depth_m), "m2", "racks x 0.6 m x 1.068 m", fac.rack_source)
    return s


def _memory_wall(w: _Walk) -> Section:
    g, home = w.g, w.home
    s = Section("The memory wall")
    st = memory.training_state_bytes(w.n)
    s.add("weights_bytes", "weights (bf16)", st.weights, "bytes", "2 bytes x N", "ZeRO (arXiv 1910.02054) Sec. 3.1")
    s.add("gradients_bytes", "gradients (bf16)", st.gradients, "bytes", "2 bytes x N", "ZeRO Sec. 3.1")
    s.add("optimizer_bytes", "Adam: fp32 master + m + v", st.optimizer, "bytes", "12 bytes x N", "ZeRO Sec. 3.1")
    s.add("state_total_bytes", "training state before activations", st.total, "bytes", "16 bytes x N",
          "ZeRO Sec. 3.1")
    s.add("state_vs_home_gpu", f"times one {home.name}'s memory", st.total / home.memory_bytes, "x",
          "state / memory", home.source)
    s.add("state_vs_gpu", f"times one {g.name}'s memory", st.total / g.memory_bytes, "x", "state / memory",
          g.source)
    s.add("gpus_to_hold_state", f"{g.name}s just to hold the state", memory.gpus_to_hold(st.total, g.memory_bytes),
          "GPUs", "ceil(state / memory)")
    return s


def _power(w: _Walk) -> Section:
    g, fac, gpus = w.g, w.fac, w.gpus
    s = Section("Power and cooling")
    gw = power.gpu_power_watts(gpus, g.tdp_watts)
    s.add("gpu_power_watts", f"{gpus:,} GPUs at {g.tdp_watts:.0f} W", gw, "W", "GPUs x TDP", g.source)
    s.add("pue", "power usage effectiveness", fac.pue, "", "facility / IT power", fac.pue_source)
    s.add("facility_power_watts", "facility at that PUE (GPUs as the IT load)", power.facility_power_watts(gw, fac.pue),
          "W", "GPU power x PUE", fac.pue_source)
    s.add("energy_joules", "GPU energy over the run at TDP", power.energy_joules(gw, w.days * flops.SECONDS_PER_DAY),
          "J", "GPU power x days x 86400")
    return s


def _home_weights(hm: ModelSpec) -> dict[str, float]:
    return {
        "bf16": inference.quantized_model_bytes(hm, "bf16"),
        "int8": inference.quantized_model_bytes(hm, "int8", 32),
        "int4": inference.quantized_model_bytes(hm, "int4", 32),
        "gguf_q8_0": inference.gguf_tensor_bytes(hm, "q8_0"),
        "gguf_q4_0": inference.gguf_tensor_bytes(hm, "q4_0"),
        "gguf_q4_k_m": inference.gguf_tensor_bytes(hm, "q4_k_m"),
    }


def _at_home(w: _Walk) -> Section:
    m, hm, home = w.m, w.hm, w.home
    s = Section(f"Running {hm.name} at home")
    s.add("inference_flops_per_token", f"inference FLOPs per token ({m.name})",
          inference.inference_flops_per_token(w.n_c), "FLOP", "2N" if not m.is_moe else "2 x active",
          "Kaplan et al. 2020")
    s.add("home_params", f"parameters of {hm.name}", param_count(hm), "params", "exact count", hm.source)
    q = _home_weights(hm)
    for k, v in q.items():
        s.add(f"quantized_{k}", f"{hm.name} weights as {k}", v, "bytes",
              "bits/weight x N + per-group scales" if not k.startswith("gguf") else
              "sum of tensors x ggml bytes per block (llama.cpp type mix)")
    cq = w.f["community_q4_k_m"]
    if hm.name == cq["model"]:
        s.add("community_q4_k_m_bytes", "community Q4_K_M file", cq["file_bytes"], "bytes", "published", cq["source"])
    kv = memory.kv_cache_bytes_per_token(hm)
    s.add("kv_cache_bytes_per_token", "KV cache per token (bf16)", kv, "bytes", "2 x L x kv_heads x head_dim x 2")
    ctx = 8192
    fits = q["gguf_q4_k_m"] + memory.kv_cache_bytes(hm, ctx)
    s.add("home_4bit_with_8k_context", f"4-bit weights + {ctx:,}-token KV cache", fits, "bytes", "Q4_K_M + KV")
    s.add("home_4bit_fits", f"fits one {home.name} ({home.memory_bytes / 1e9:.0f} GB)",
          float(fits < home.memory_bytes), "bool", "bytes < memory", home.source)
    return s


def _growth(w: _Walk) -> Section:
    s = Section("Growth")
    gr = w.f["compute_growth"]
    for yrs in (1, 2, 3):
        s.add(f"compute_in_{yrs}y_low", f"frontier compute in {yrs} year(s) at {gr['low']:.0f}x/yr",
              flops.compute_growth(w.c, yrs, gr["low"]), "FLOP", "C x 4^years", gr["source"])
        s.add(f"compute_in_{yrs}y_high", f"frontier compute in {yrs} year(s) at {gr['high']:.0f}x/yr",
              flops.compute_growth(w.c, yrs, gr["high"]), "FLOP", "C x 5^years", gr["source"])
    return s


def walkthrough(model: str = "llama3.1-405b", tokens: float | None = None, gpu: str = "h100-sxm",
                gpus: int | None = None, mfu: float = 0.40, home_gpu: str = "rtx4090",
                home_model: str = "llama3.1-8b", gpu_hours: float | None = None,
                seq: int | None = None) -> dict[str, Any]:
    """All figures of the walkthrough as ``{"sections": [...], "figures": {key: value}, ...}``; ``seq`` is the
    training sequence of the attention term (default DEFAULT_SEQ)."""
    w = _inputs(model, tokens, gpu, gpus, mfu, home_gpu, home_model, gpu_hours, seq)
    sections = [_counting(w), _one_gpu(w), _racks(w), _memory_wall(w), _power(w), _at_home(w), _growth(w)]
    figs = {fig.key: fig.value for sec in sections for fig in sec.figures}
    return {
        "inputs": {"model": w.m.name, "tokens": w.tokens, "gpu": w.g.name, "gpus": w.gpus, "mfu": mfu,
                   "home_gpu": w.home.name, "home_model": w.hm.name, "seq": w.seq},
        "flop_convention": flops.FLOP_CONVENTION,
        "params": w.n,
        "active_params": w.n_c,
        "training_flops": w.c,
        "one_gpu_years_at_peak": figs["one_gpu_years_at_peak"],
        "one_gpu_years_at_mfu": figs["one_gpu_years_at_mfu"],
        "cluster_days": w.days,
        "state_bytes": memory.training_state_bytes(w.n).as_dict(),
        "gpus_to_hold_state": figs["gpus_to_hold_state"],
        "racks": figs["racks"],
        "gpu_power_watts": figs["gpu_power_watts"],
        "facility_power_watts": figs["facility_power_watts"],
        "quantized_bytes": {k[len("quantized_"):]: v for k, v in figs.items() if k.startswith("quantized_")},
        "figures": figs,
        "sections": [{"title": sec.title, "figures": [vars(x) for x in sec.figures]} for sec in sections],
    }
