"""The training software as an input: which kernels, dtypes and overlaps a framework really has.

A ``Software`` is a table of independent knobs (catalog/software.toml documents each one); presets
describe the frameworks people run (Megatron-LM 2021, Megatron-Core, Megatron-DeepSpeed, Meta's
Llama 3 stack as its paper describes it, torchtitan with and without torch.compile, MosaicML
llm-foundry, metaseq), every knob with the source that says so.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.estimate.memory import ActivationCaching

GEMM_NAMES = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")  # runtime/model.py's Linear names (params.py)
DEFAULT = "trainscale"  # the runtime this project ships; launch.py plans for it


@dataclass(frozen=True)
class Software:
    name: str
    source: str
    attention: str  # "flash" | "unfused"
    grad_bytes: int  # 4: fp32 main grads (18 B/param of Adam state), 2: bf16 grads (16 B/param)
    grad_reduce_bytes: int
    dp_overlap: float
    tp_overlap: float
    selective_gemms: tuple[str, ...]
    elementwise_passes: float
    mlp_act_passes: float
    microbatch_overhead_s: float
    zero: tuple[int, ...]
    schedules: tuple[str, ...]
    cp: bool
    max_v: int
    attention_speed: float = 1.0  # the fused kernel's rate relative to FlashAttention-2's (planner.toml), 1 = FA2
    precision: str = "bf16"  # "bf16" | "fp8": the layers' GEMMs at the GPU's FP8 peak (master state unchanged)
    moe_node_limit: int = 0  # a token's routed experts lie on at most this many nodes (0: no limit)
    a2a_overlap: float = 0.0  # fraction of a MoE layer's compute the expert all-to-all can hide under
    pipeline: str = "standard"  # "standard" (the layout's schedule) | "dualpipe" (DeepSeek-V3 Sec. 3.2.1)
    comm_sms: int = 0  # SMs the communication kernels take from the GEMMs while they overlap
    # what a MoE / MLA layer caches for its backward (memory.ActivationCaching; dense layers keep Korthikanti's count)
    linear_act_bytes: float = 2.0  # bytes per element of a cached Linear input (2: bf16; ~1 under FP8 caching)
    attn_out_act_bytes: float = 2.0  # the attention output (attention backward + output projection input)
    swiglu_in_act_bytes: float = 2.0  # a MoE SwiGLU's inputs
    recompute_norms: bool = False  # RMSNorm outputs recomputed in the backward, not kept
    recompute_mla_up: bool = False  # MLA up-projections (q, k, v) recomputed from the latents in the backward
    recompute_swiglu_output: bool = False  # a MoE SwiGLU's output recomputed from its inputs in the backward
    moe_weighted_combine: bool = True  # the combine weights expert outputs by the gate (keeps them); False: the gate
    #                                    is applied on the expert side and the combine is a plain sum (DeepEP)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def state_bytes_per_param(self) -> int:
        """Weights (2) + gradients (grad_bytes) + Adam's fp32 master, momentum, variance (12): ZeRO Sec. 3.1."""
        return 2 + self.grad_bytes + 12

    def activation_caching(self) -> ActivationCaching:
        return ActivationCaching(self.linear_act_bytes, self.attn_out_act_bytes, self.swiglu_in_act_bytes,
                                 self.recompute_norms, self.recompute_mla_up, self.recompute_swiglu_output,
                                 self.moe_weighted_combine)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name != "sources"}


_KNOBS = tuple(f.name for f in fields(Software) if f.name not in ("name", "source", "sources"))
# knobs a preset may leave out, with their default
_OPTIONAL = {"attention_speed": 1.0, "precision": "bf16", "moe_node_limit": 0, "a2a_overlap": 0.0,
             "pipeline": "standard", "comm_sms": 0, "linear_act_bytes": 2.0, "attn_out_act_bytes": 2.0,
             "swiglu_in_act_bytes": 2.0, "recompute_norms": False, "recompute_mla_up": False,
             "recompute_swiglu_output": False, "moe_weighted_combine": True}
PRECISIONS = ("bf16", "fp8")


@cache
def _catalog() -> dict[str, dict[str, Any]]:
    return tomllib.loads(resources.files("trainscale.catalog").joinpath("software.toml").read_text())


def software_names() -> list[str]:
    return sorted(_catalog())


def _build(name: str, data: dict[str, Any], where: str) -> Software:
    data = {**_OPTIONAL, **data}
    missing = [k for k in _KNOBS if k not in data]
    if missing:
        raise TrainscaleError(f"software {where} lacks {', '.join(missing)}")
    unknown = [k for k in data if k not in _KNOBS and k != "source" and not k.endswith("_source")]
    if unknown:
        raise TrainscaleError(f"software {where} has unknown knobs {', '.join(unknown)}; known: {', '.join(_KNOBS)}")
    vals: dict[str, Any] = {k: data[k] for k in _KNOBS}
    for k in ("selective_gemms", "zero", "schedules"):
        vals[k] = tuple(vals[k])
    if vals["attention"] not in ("flash", "unfused"):
        raise TrainscaleError(f"software {where}: attention must be flash or unfused, not {vals['attention']!r}")
    if vals["grad_bytes"] not in (2, 4) or vals["grad_reduce_bytes"] not in (2, 4):
        raise TrainscaleError(f"software {where}: grad_bytes and grad_reduce_bytes must be 2 or 4")
    bad = [g for g in vals["selective_gemms"] if g not in GEMM_NAMES]
    if bad:
        raise TrainscaleError(f"software {where}: selective_gemms {bad} are not among {', '.join(GEMM_NAMES)}")
    for k in ("dp_overlap", "tp_overlap"):
        if not 0 <= float(vals[k]) <= 1:
            raise TrainscaleError(f"software {where}: {k} must be in [0, 1]")
    if not 0 < float(vals["attention_speed"]) <= 4:
        raise TrainscaleError(f"software {where}: attention_speed must be in (0, 4]")
    if vals["precision"] not in PRECISIONS:
        raise TrainscaleError(f"software {where}: precision must be bf16 or fp8, not {vals['precision']!r}")
    if vals["pipeline"] not in ("standard", "dualpipe"):
        raise TrainscaleError(f"software {where}: pipeline must be standard or dualpipe, not {vals['pipeline']!r}")
    if not 0 <= float(vals["a2a_overlap"]) <= 1:
        raise TrainscaleError(f"software {where}: a2a_overlap must be in [0, 1]")
    for k in ("moe_node_limit", "comm_sms"):
        if isinstance(vals[k], bool) or not isinstance(vals[k], int) or not 0 <= vals[k] <= 4096:
            raise TrainscaleError(f"software {where}: {k} must be a whole number from 0 to 4096")
    for k in ("linear_act_bytes", "attn_out_act_bytes", "swiglu_in_act_bytes"):
        if isinstance(vals[k], bool) or not isinstance(vals[k], int | float) or not 0.5 <= vals[k] <= 4:
            raise TrainscaleError(f"software {where}: {k} must be a number of bytes from 0.5 to 4")
        vals[k] = float(vals[k])
    for k in ("recompute_norms", "recompute_mla_up", "recompute_swiglu_output", "moe_weighted_combine"):
        if not isinstance(vals[k], bool):
            raise TrainscaleError(f"software {where}: {k} must be true or false")
    sources = {k: str(data.get(f"{k}_source", "")) for k in _KNOBS}
    return Software(name=name, source=str(data.get("source", "")), sources=sources, **vals)


def load_software(ref: str | Path | Software | None = None) -> Software:
    """A preset by name (catalog/software.toml), or a TOML file with the same knobs."""
    if isinstance(ref, Software):
        return ref
    ref = ref or DEFAULT
    if str(ref) in _catalog():
        return _build(str(ref), _catalog()[str(ref)], f"'{ref}'")
    path = Path(ref)
    if path.suffix == ".toml" and path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise TrainscaleError(f"software file {path} cannot be read: {e}") from None
        return _build(path.stem, data, f"file {path}")
    raise TrainscaleError(f"unknown software '{ref}'; known: {', '.join(software_names())} (or a .toml file)")


def with_knobs(sw: Software, **kw: Any) -> Software:
    return replace(sw, **kw)
