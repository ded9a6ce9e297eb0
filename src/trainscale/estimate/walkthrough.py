"""The seed article's running example, recomputed from first principles (``trainscale explain``).

``walkthrough()`` returns every figure with the formula that made it and where its inputs come from;
the CLI only formats it. Nothing here is a stored answer: change the model, GPU or cluster and every
figure follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate import flops, inference, memory, power
from trainscale.estimate.params import active_params, embedding_params, expert_params, param_count
from trainscale.specs import facts, load_facility, load_gpu, load_model


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


def walkthrough(model: str = "llama3.1-405b", tokens: float | None = None, gpu: str = "h100-sxm",
                gpus: int | None = None, mfu: float = 0.40, home_gpu: str = "rtx4090",
                home_model: str = "llama3.1-8b", gpu_hours: float | None = None) -> dict[str, Any]:
    """All figures of the walkthrough as ``{"sections": [...], "figures": {key: value}, ...}``."""
    if not 0 < mfu <= 1:
        raise TrainscaleError(f"--mfu must be in (0, 1], not {mfu}")
    f = facts()
    run = f["llama3_405b_training"]
    m, g, home, hm = load_model(model), load_gpu(gpu), load_gpu(home_gpu), load_model(home_model)
    fac = load_facility()
    is_seed = m.name == "llama3.1-405b"
    if tokens is None:
        tokens = run["tokens"]
    if gpus is None:
        gpus = run["gpus"]
    if gpu_hours is None and is_seed and g.name == "h100-sxm" and tokens == run["tokens"]:
        gpu_hours = run["gpu_hours"]

    n = param_count(m)
    # a mixture of experts: compute follows the parameters a token passes through (active), memory all of them
    n_c = active_params(m) if m.is_moe else n
    c = flops.training_flops(n_c, tokens)
    sections: list[Section] = []

    s = Section("Counting the math")
    if m.is_moe:
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
        s.add("time_follows_active", "time: training FLOPs per token", 6.0 * n_c, "FLOP",
              f"6 x active only (active/total = {n_c / n:.1%})", "Kaplan et al. 2020 (arXiv 2001.08361)")
        s.add("embedding_params", "embedding table", embedding_params(m), "params", "vocab x d_model")
    else:
        s.add("params", f"parameters of {m.name}", n, "params", "embeddings + L x (attention + MLP + norms) + head",
              m.source)
    s.add("forward_flops_per_token", "forward FLOPs per token", flops.forward_flops_per_token(n_c), "FLOP",
          "2N" if not m.is_moe else "2 x active", "Kaplan et al. 2020 (arXiv 2001.08361)")
    s.add("backward_flops_per_token", "backward FLOPs per token", flops.backward_flops_per_token(n_c), "FLOP",
          "4N" if not m.is_moe else "4 x active", "Kaplan et al. 2020 (arXiv 2001.08361)")
    s.add("tokens", "training tokens", tokens, "tokens", "given", run["tokens_source"] if is_seed else "")
    s.add("training_flops", "training compute", c, "FLOP", "6 x N x D" if not m.is_moe else "6 x active x D",
          f["scaling_rule"]["source"])
    if is_seed:
        s.add("reported_flops", "Meta's reported compute", run["reported_flops"], "FLOP", "published",
              run["reported_flops_source"])
    sections.append(s)

    s = Section(f"One {home.name} against the math")
    years_peak = flops.seconds_on(c, 1, home.peak_bf16_flops) / flops.SECONDS_PER_YEAR
    years_mfu = flops.seconds_on(c, 1, home.peak_bf16_flops, mfu) / flops.SECONDS_PER_YEAR
    s.add("one_gpu_seconds_at_peak", f"one {home.name} at peak, in seconds", years_peak * flops.SECONDS_PER_YEAR,
          "seconds", f"6ND / {home.peak_bf16_flops:.4g} FLOP/s", home.source)
    s.add("one_gpu_years_at_peak", f"one {home.name} at peak", years_peak, "years", "seconds / 31,557,600")
    s.add("one_gpu_years_at_mfu", f"one {home.name} at {mfu:.0%} MFU", years_mfu, "years", "years at peak / MFU")
    if gpu_hours is not None:
        days = flops.days_from_gpu_hours(gpu_hours, gpus)
        s.add("gpu_hours", "reported GPU-hours", gpu_hours, "GPU-h", "published", run["gpu_hours_source"])
        s.add("cluster_days", f"{gpus:,} {g.name} running the whole time", days, "days", "GPU-hours / GPUs / 24")
    else:
        days = flops.seconds_on(c, gpus, g.peak_bf16_flops, mfu) / flops.SECONDS_PER_DAY
        s.add("gpu_hours", f"GPU-hours at {mfu:.0%} MFU", flops.gpu_hours(c, g.peak_bf16_flops, mfu), "GPU-h",
              "6ND / (peak x MFU) / 3600")
        s.add("cluster_days", f"{gpus:,} {g.name} at {mfu:.0%} MFU", days, "days", "6ND / (GPUs x peak x MFU)")
    s.add("cluster_gpu_vs_home", f"one {g.name} vs one {home.name}", g.peak_bf16_flops / home.peak_bf16_flops,
          "x", "peak / peak", g.source)
    if is_seed:
        implied = c / (gpus * g.peak_bf16_flops * days * flops.SECONDS_PER_DAY)
        s.add("implied_mfu", "utilization implied by those days", implied, "fraction",
              "6ND / (GPUs x peak x days x 86400)", run["mfu_source"])
    sections.append(s)

    s = Section("The racks")
    racks = power.racks_for(gpus, fac.gpus_per_rack)
    s.add("gpus", "GPUs", gpus, "GPUs", "given", run["gpus_source"] if is_seed else "")
    s.add("racks", f"racks of {fac.gpus_per_rack} GPUs", racks, "racks", "ceil(GPUs / GPUs per rack)",
          fac.gpus_per_rack_source)
    s.add("rack_floor_m2", "floor under the racks alone", power.rack_floor_m2(racks, fac.rack_width_m,
          fac.rack_depth_m), "m2", "racks x 0.6 m x 1.068 m", fac.rack_source)
    sections.append(s)

    s = Section("The memory wall")
    st = memory.training_state_bytes(n)
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
    sections.append(s)

    s = Section("Power and cooling")
    gw = power.gpu_power_watts(gpus, g.tdp_watts)
    s.add("gpu_power_watts", f"{gpus:,} GPUs at {g.tdp_watts:.0f} W", gw, "W", "GPUs x TDP", g.source)
    s.add("pue", "power usage effectiveness", fac.pue, "", "facility / IT power", fac.pue_source)
    s.add("facility_power_watts", "facility at that PUE (GPUs as the IT load)", power.facility_power_watts(gw, fac.pue),
          "W", "GPU power x PUE", fac.pue_source)
    s.add("energy_joules", "GPU energy over the run at TDP", power.energy_joules(gw, days * flops.SECONDS_PER_DAY),
          "J", "GPU power x days x 86400")
    sections.append(s)

    s = Section(f"Running {hm.name} at home")
    hn = param_count(hm)
    s.add("inference_flops_per_token", f"inference FLOPs per token ({m.name})",
          inference.inference_flops_per_token(n_c), "FLOP", "2N" if not m.is_moe else "2 x active",
          "Kaplan et al. 2020")
    s.add("home_params", f"parameters of {hm.name}", hn, "params", "exact count", hm.source)
    q = {
        "bf16": inference.quantized_model_bytes(hm, "bf16"),
        "int8": inference.quantized_model_bytes(hm, "int8", 32),
        "int4": inference.quantized_model_bytes(hm, "int4", 32),
        "gguf_q8_0": inference.gguf_tensor_bytes(hm, "q8_0"),
        "gguf_q4_0": inference.gguf_tensor_bytes(hm, "q4_0"),
        "gguf_q4_k_m": inference.gguf_tensor_bytes(hm, "q4_k_m"),
    }
    for k, v in q.items():
        s.add(f"quantized_{k}", f"{hm.name} weights as {k}", v, "bytes",
              "bits/weight x N + per-group scales" if not k.startswith("gguf") else
              "sum of tensors x ggml bytes per block (llama.cpp type mix)")
    cq = f["community_q4_k_m"]
    if hm.name == cq["model"]:
        s.add("community_q4_k_m_bytes", "community Q4_K_M file", cq["file_bytes"], "bytes", "published", cq["source"])
    kv = memory.kv_cache_bytes_per_token(hm)
    s.add("kv_cache_bytes_per_token", "KV cache per token (bf16)", kv, "bytes", "2 x L x kv_heads x head_dim x 2")
    ctx = 8192
    fits = q["gguf_q4_k_m"] + memory.kv_cache_bytes(hm, ctx)
    s.add("home_4bit_with_8k_context", f"4-bit weights + {ctx:,}-token KV cache", fits, "bytes", "Q4_K_M + KV")
    s.add("home_4bit_fits", f"fits one {home.name} ({home.memory_bytes / 1e9:.0f} GB)",
          float(fits < home.memory_bytes), "bool", "bytes < memory", home.source)
    sections.append(s)

    s = Section("Growth")
    gr = f["compute_growth"]
    for yrs in (1, 2, 3):
        s.add(f"compute_in_{yrs}y_low", f"frontier compute in {yrs} year(s) at {gr['low']:.0f}x/yr",
              flops.compute_growth(c, yrs, gr["low"]), "FLOP", "C x 4^years", gr["source"])
        s.add(f"compute_in_{yrs}y_high", f"frontier compute in {yrs} year(s) at {gr['high']:.0f}x/yr",
              flops.compute_growth(c, yrs, gr["high"]), "FLOP", "C x 5^years", gr["source"])
    sections.append(s)

    figs = {fig.key: fig.value for sec in sections for fig in sec.figures}
    return {
        "inputs": {"model": m.name, "tokens": tokens, "gpu": g.name, "gpus": gpus, "mfu": mfu,
                   "home_gpu": home.name, "home_model": hm.name},
        "params": n,
        "active_params": n_c,
        "training_flops": c,
        "one_gpu_years_at_peak": years_peak,
        "one_gpu_years_at_mfu": years_mfu,
        "cluster_days": days,
        "state_bytes": st.as_dict(),
        "gpus_to_hold_state": figs["gpus_to_hold_state"],
        "racks": racks,
        "gpu_power_watts": gw,
        "facility_power_watts": figs["facility_power_watts"],
        "quantized_bytes": q,
        "figures": figs,
        "sections": [{"title": sec.title, "figures": [vars(x) for x in sec.figures]} for sec in sections],
    }
