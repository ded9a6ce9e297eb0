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
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from trainscale.errors import TrainscaleError
from trainscale.estimate.memory import ActivationCaching
from trainscale.estimate.planner.efficiencies import ATTENTION_KERNELS
from trainscale.safeio import parse_toml, read_text
from trainscale.specs import Schedule

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
    attention_speed: float = 1.0  # a factor on the fused kernel's published rate (catalog/planner.toml)
    attention_kernel: str = "fa2"  # the fused kernel whose published curve the planner uses (planner.toml [attention])
    precision: str = "bf16"  # "bf16" | "fp16" | "fp8" (fp8: the layers' GEMMs at the GPU's FP8 peak; fp16 runs as bf16)
    fp16_grad_bytes: int = 0  # grad_bytes of an fp16 run (0: as grad_bytes); resolve_precision applies it
    fp16_grad_reduce_bytes: int = 0  # grad_reduce_bytes of an fp16 run (0: as grad_reduce_bytes)
    moe_node_limit: int = 0  # a token's routed experts lie on at most this many nodes (0: no limit)
    a2a_overlap: float = 0.0  # fraction of a MoE layer's compute the expert all-to-all can hide under
    pipeline: str = "standard"  # "standard" (the layout's schedule) | "dualpipe" (DeepSeek-V3 Sec. 3.2.1)
    comm_sms: int = 0  # SMs the communication kernels take from the GEMMs while they overlap
    tp_wgrad_overlap: bool = False  # a column-parallel linear's backward TP collective runs under its weight gradient
    dp_chunk_sync: str = "none"  # interleaved schedule: when a virtual chunk's gradient reduction starts ("none": the
    #                              stage's reduction as dp_overlap says; "after"/"during" its last backward: dp.py)
    dp_chunk_gather: bool = False  # interleaved schedule: each chunk's weight all-gather dispatched one chunk ahead
    # what a MoE / MLA layer caches for its backward (memory.ActivationCaching; dense layers keep Korthikanti's count)
    linear_act_bytes: float = 2.0  # bytes per element of a cached Linear input (2: bf16; ~1 under FP8 caching)
    attn_out_act_bytes: float = 2.0  # the attention output (attention backward + output projection input)
    swiglu_in_act_bytes: float = 2.0  # a MoE SwiGLU's inputs
    recompute_norms: bool = False  # RMSNorm outputs recomputed in the backward, not kept
    recompute_mla_up: bool = False  # MLA up-projections (q, k, v) recomputed from the latents in the backward
    recompute_swiglu_output: bool = False  # a MoE SwiGLU's output recomputed from its inputs in the backward
    recompute_early_stop: bool = False  # full recompute stops before a dense layer's last GEMM (w2): torch's
    #                                     non-reentrant checkpoint with early stop (catalog/software.toml)
    moe_weighted_combine: bool = True  # the combine weights expert outputs by the gate (keeps them); False: the gate
    #                                    is applied on the expert side and the combine is a plain sum (DeepEP)
    recompute_attention_core: bool = True  # rc=selective redoes the attention core (Korthikanti); False: its output is
    #                                        saved (torchtitan's op-level SAC saves the SDPA ops)
    dropout: bool = False  # the layers run dropout (hidden and attention): its masks kept, its kernels run
    optimizer_state_bytes: float = 12.0  # bytes per parameter of optimizer state: 12 = fp32 master, Adam m and v
    microbatch_grad_bytes: float = 0.0  # HBM bytes per unsharded parameter each micro-batch moves outside the layers
    #                                     (FSDP1's gradient concat, cast and divide: stages.param_pass_time)
    microbatch_shard_bytes: float = 0.0  # HBM bytes per parameter of the rank's ZeRO shard each micro-batch moves
    fp8_weights: bool = False  # under precision fp8, the layers' GEMM weights kept in FP8: ZeRO gathers them at 1 byte
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def state_bytes_per_param(self) -> int:
        """Weights (2) + gradients (grad_bytes) + Adam's fp32 master, momentum, variance (12): ZeRO Sec. 3.1."""
        return 2 + self.grad_bytes + int(self.optimizer_state_bytes)

    def activation_caching(self) -> ActivationCaching:
        return ActivationCaching(self.linear_act_bytes, self.attn_out_act_bytes, self.swiglu_in_act_bytes,
                                 self.recompute_norms, self.recompute_mla_up, self.recompute_swiglu_output,
                                 self.moe_weighted_combine, self.dropout)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name != "sources"}


_KNOBS = tuple(f.name for f in fields(Software) if f.name not in ("name", "source", "sources"))
# knobs a preset may leave out, with their default
_OPTIONAL = {"attention_speed": 1.0, "attention_kernel": "fa2", "precision": "bf16", "moe_node_limit": 0,
             "a2a_overlap": 0.0, "pipeline": "standard", "comm_sms": 0, "linear_act_bytes": 2.0,
             "attn_out_act_bytes": 2.0, "swiglu_in_act_bytes": 2.0, "recompute_norms": False, "recompute_mla_up": False,
             "recompute_swiglu_output": False, "recompute_early_stop": False, "moe_weighted_combine": True,
             "dropout": False, "tp_wgrad_overlap": False, "dp_chunk_sync": "none", "dp_chunk_gather": False,
             "optimizer_state_bytes": 12.0, "fp16_grad_bytes": 0, "fp16_grad_reduce_bytes": 0,
             "microbatch_grad_bytes": 0.0, "microbatch_shard_bytes": 0.0, "recompute_attention_core": True,
             "fp8_weights": False}
PRECISIONS = ("bf16", "fp16", "fp8")


_Fraction = Annotated[float, Field(ge=0, le=1)]
_Passes = Annotated[float, Field(ge=0, le=1000)]
_ActBytes = Annotated[float, Field(ge=0.5, le=4)]
_SMs = Annotated[int, Field(ge=0, le=4096)]


def _two_or_four(n: int) -> int:
    if n not in (2, 4):
        raise ValueError("2 or 4")
    return n


_GradBytes = Annotated[int, AfterValidator(_two_or_four)]  # an int (strict: not 2.0, not true), 2 or 4


def _zero_two_or_four(n: int) -> int:
    if n not in (0, 2, 4):
        raise ValueError("0, 2 or 4")
    return n


_Fp16GradBytes = Annotated[int, AfterValidator(_zero_two_or_four)]


class SoftwareKnobs(BaseModel):
    """The knobs of one software preset (catalog/software.toml's header says what each means), strictly typed:
    TOML's own types, finite numbers, each in the range its meaning allows (KNOB_ALLOWED says it in words)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", frozen=True)

    attention: Literal["flash", "unfused"]
    grad_bytes: _GradBytes
    grad_reduce_bytes: _GradBytes
    dp_overlap: _Fraction
    tp_overlap: _Fraction
    selective_gemms: list[Literal[GEMM_NAMES]]  # type: ignore[valid-type]
    elementwise_passes: _Passes
    mlp_act_passes: Annotated[float, Field(ge=0, le=100)]
    microbatch_overhead_s: Annotated[float, Field(gt=0, le=1)]
    zero: Annotated[list[Annotated[int, Field(ge=0, le=3)]], Field(min_length=1)]
    schedules: Annotated[list[Schedule], Field(min_length=1)]
    cp: bool
    max_v: Annotated[int, Field(ge=1, le=1024)]
    attention_speed: Annotated[float, Field(gt=0, le=4)]
    attention_kernel: Literal[ATTENTION_KERNELS]  # type: ignore[valid-type]
    precision: Literal["bf16", "fp16", "fp8"]
    fp16_grad_bytes: _Fp16GradBytes
    fp16_grad_reduce_bytes: _Fp16GradBytes
    moe_node_limit: _SMs
    a2a_overlap: _Fraction
    pipeline: Literal["standard", "dualpipe"]
    comm_sms: _SMs
    tp_wgrad_overlap: bool
    dp_chunk_sync: Literal["none", "after", "during"]
    dp_chunk_gather: bool
    linear_act_bytes: _ActBytes
    attn_out_act_bytes: _ActBytes
    swiglu_in_act_bytes: _ActBytes
    recompute_norms: bool
    recompute_mla_up: bool
    recompute_swiglu_output: bool
    recompute_early_stop: bool
    recompute_attention_core: bool
    moe_weighted_combine: bool
    dropout: bool
    optimizer_state_bytes: Annotated[float, Field(ge=0, le=32)]
    microbatch_grad_bytes: Annotated[float, Field(ge=0, le=256)]
    microbatch_shard_bytes: Annotated[float, Field(ge=0, le=256)]
    fp8_weights: bool


_FRACTION = "a fraction, a finite number in [0, 1]"
_BYTES = "bytes per cached element, a finite number in [0.5, 4] (FP8 with scales to fp32)"
_BOOL = "true or false"
KNOB_ALLOWED: dict[str, str] = {
    "attention": "flash or unfused", "grad_bytes": "2 or 4", "grad_reduce_bytes": "2 or 4",
    "fp16_grad_bytes": "0 (as grad_bytes), 2 or 4", "fp16_grad_reduce_bytes": "0 (as grad_reduce_bytes), 2 or 4",
    "dp_overlap": _FRACTION, "tp_overlap": _FRACTION, "a2a_overlap": _FRACTION,
    "selective_gemms": f"a list of GEMM names among {', '.join(GEMM_NAMES)}",
    "elementwise_passes": "HBM passes per token per layer, a finite number in [0, 1000]",
    "mlp_act_passes": "HBM passes over the d_ff activation, a finite number in [0, 100]",
    "microbatch_overhead_s": "a latency in seconds, a finite number in (0, 1]",
    "zero": "a non-empty list of ZeRO stages among 0, 1, 2, 3",
    "schedules": f"a non-empty list of schedules among {', '.join(get_args(Schedule))}",
    "cp": _BOOL, "max_v": "a whole number of virtual stages from 1 to 1024",
    "attention_speed": "a factor on the kernel's published rate, a finite number in (0, 4]",
    "attention_kernel": f"one of {', '.join(ATTENTION_KERNELS)}",
    "precision": f"one of {', '.join(PRECISIONS)}", "pipeline": "standard or dualpipe",
    "moe_node_limit": "a whole number of nodes from 0 (no limit) to 4096",
    "comm_sms": "a whole number of SMs from 0 to 4096",
    "linear_act_bytes": _BYTES, "attn_out_act_bytes": _BYTES, "swiglu_in_act_bytes": _BYTES,
    "recompute_norms": _BOOL, "recompute_mla_up": _BOOL, "recompute_swiglu_output": _BOOL,
    "recompute_early_stop": _BOOL, "moe_weighted_combine": _BOOL, "dropout": _BOOL, "tp_wgrad_overlap": _BOOL,
    "dp_chunk_sync": "none, after or during", "dp_chunk_gather": _BOOL, "recompute_attention_core": _BOOL,
    "fp8_weights": _BOOL,
    "optimizer_state_bytes": "bytes per parameter of optimizer state, a finite number in [0, 32] (12: fp32 master, "
                             "Adam m and v)",
    "microbatch_grad_bytes": "HBM bytes per parameter per micro-batch, a finite number in [0, 256]",
    "microbatch_shard_bytes": "HBM bytes per sharded parameter per micro-batch, a finite number in [0, 256]",
}


def check_knobs(vals: dict[str, Any], where: str) -> None:
    """All of a preset's knobs against SoftwareKnobs; the first bad one in one sentence with what it allows."""
    try:
        SoftwareKnobs(**vals)
    except ValidationError as e:
        loc = e.errors()[0].get("loc") or ("?",)
        k = str(loc[0])
        shown = repr(vals.get(k))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TrainscaleError(f"software {where}: {k} must be {KNOB_ALLOWED.get(k, 'a known knob')}, "
                              f"not {shown}") from None


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
    check_knobs(vals, where)
    for k in ("selective_gemms", "zero", "schedules"):
        vals[k] = tuple(vals[k])
    for k in ("linear_act_bytes", "attn_out_act_bytes", "swiglu_in_act_bytes", "optimizer_state_bytes",
              "microbatch_grad_bytes", "microbatch_shard_bytes"):
        vals[k] = float(vals[k])
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
        data = parse_toml(read_text(path, "software file"), f"software file {path}")
        return _build(path.stem, data, f"file {path}")
    raise TrainscaleError(f"unknown software '{ref}'; known: {', '.join(software_names())} (or a .toml file)")


def with_knobs(sw: Software, **kw: Any) -> Software:
    return replace(sw, **kw)


def resolve_precision(sw: Software) -> Software:
    """The software as an fp16 run of it keeps its gradients: a framework that accumulates and reduces in fp32 only
    when it must (Megatron-LM forces --accumulate-allreduce-grads-in-fp32 for bf16, not for fp16) keeps 2-byte
    gradients in fp16 (``fp16_grad_bytes`` / ``fp16_grad_reduce_bytes``); bf16 and fp8 runs keep the preset's.
    FP8 weights (``fp8_weights``) need an fp8 run: NeMo builds the model under Transformer Engine's fp8_model_init only
    when fp8 is on too (megatron_gpt_model.py: ``cfg.fp8 and cfg.fp8_params``), so another precision keeps bf16 ones."""
    if sw.fp8_weights and sw.precision != "fp8":
        sw = replace(sw, fp8_weights=False)
    if sw.precision != "fp16":
        return sw
    return replace(sw, grad_bytes=sw.fp16_grad_bytes or sw.grad_bytes,
                   grad_reduce_bytes=sw.fp16_grad_reduce_bytes or sw.grad_reduce_bytes)
