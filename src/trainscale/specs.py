"""The model of the world: what a model, a GPU, a cluster and a parallel layout are.

Every other part of trainscale reads these objects; nothing else defines a shape or a constant.
Loaders accept a catalog name, a TOML file, or (for models) a Hugging Face ``config.json``.
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainscale import hf, rules
from trainscale.errors import TrainscaleError


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        """``gpus = true`` is a typo, not 1: pydantic's lax mode would read a bool as a number."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if isinstance(value, bool) and field is not None and field.annotation is not bool \
                        and bool not in getattr(field.annotation, "__args__", ()):
                    raise ValueError(f"{key} must be a number or text, not {str(value).lower()}")
        return data


# Upper bounds: far beyond any real model or machine, so that a typo (an extra digit, 1e400) is refused
# in one sentence instead of allocating, overflowing or running for ever.
_DIM = 1 << 24  # widths, heads, vocabulary
_LAYERS = 100_000
_SEQ = 1 << 30
_BYTES = 1e18  # a GPU's memory, bandwidths in bytes/s
_FLOPS = 1e20  # a GPU's peak FLOP/s


class ModelSpec(_Spec):
    """A decoder-only transformer, Llama-style or GPT-style."""

    name: str = "custom"
    source: str = ""
    n_layers: int = Field(gt=0, le=_LAYERS)
    d_model: int = Field(gt=0, le=_DIM)
    n_heads: int = Field(gt=0, le=_DIM)
    n_kv_heads: int = Field(gt=0, le=_DIM)
    d_ff: int = Field(gt=0, le=_DIM)
    vocab_size: int = Field(gt=0, le=_DIM)
    max_seq_len: int = Field(gt=0, le=_SEQ)
    head_dim_override: int | None = Field(default=None, gt=0, le=_DIM, alias="head_dim")
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    positions: Literal["rope", "learned"] = "rope"
    rope_theta: float = Field(default=10000.0, gt=0, le=1e15)
    tied_embeddings: bool = False
    bias: bool = False
    norm_eps: float = Field(default=1e-5, gt=0, le=1)
    # ---- what Hugging Face families add to the Llama block (read by hf.spec_fields; runtime/model.py computes them)
    family: Literal["", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2",
                    "gemma3_text"] = Field(
        default="", description="the Hugging Face model_type the model was read from; export writes it back "
        "('': Llama)")
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = Field(
        default="none", description="RoPE frequency scaling (transformers' modeling_rope_utils: linear divides every "
        "frequency by rope_factor; llama3 divides the low ones, keeps the high ones, blends between; yarn blends "
        "divided and kept frequencies over a ramp set by beta_fast / beta_slow and scales cos / sin)")
    rope_factor: float = Field(default=1.0, gt=0, le=1e6)
    rope_low_freq_factor: float = Field(default=1.0, gt=0, le=1e6)
    rope_high_freq_factor: float = Field(default=4.0, gt=0, le=1e6)
    rope_original_max_len: int = Field(default=8192, gt=0, le=_SEQ)
    # YaRN (Peng et al. 2023, arXiv 2309.00071; transformers' _compute_yarn_parameters and its defaults)
    rope_beta_fast: float = Field(default=32.0, gt=0, le=1e6)
    rope_beta_slow: float = Field(default=1.0, gt=0, le=1e6)
    rope_attention_factor: float | None = Field(
        default=None, gt=0, le=1e6, description="yarn: what cos and sin are multiplied by; None: 0.1 ln(factor) + 1 "
        "(YaRN eq. 21, transformers' yarn_get_mscale)")
    rope_truncate: bool = Field(default=True, description="yarn: the ramp's ends rounded down / up to whole dims")
    qkv_bias: bool = Field(default=False, description="biases on Q, K and V only, none on the output or the MLP "
                           "(Qwen2)")
    qk_norm: bool = Field(default=False, description="an RMSNorm over each head's query and key before RoPE (Qwen3)")
    rope_local_theta: float = Field(default=0.0, ge=0, le=1e15, description="RoPE's base on the sliding-window "
                                    "layers, unscaled there (Gemma 3's rope_local_base_freq); 0: rope_theta and its "
                                    "scaling on every layer")
    qk_norm_whole: bool = Field(default=False, description="qk_norm over the whole query and key projections (all "
                                "heads together, gains of q_dim and kv_dim) instead of each head (OLMo-2)")
    post_norms: bool = Field(default=False, description="the attention's and the MLP's outputs normed before the "
                             "residual add and their inputs not (OLMo-2's norms after each sub-layer only)")
    sliding_window: int = Field(default=0, ge=0, le=_SEQ, description="each query sees at most this many keys, "
                                "itself included (Mistral); 0: no window")
    norm_offset: bool = Field(default=False, description="the RMSNorm gain is 1 + weight, applied in fp32 (Gemma)")
    embed_scale: bool = Field(default=False, description="embeddings multiplied by sqrt(d_model) (Gemma)")
    gate_act: Literal["silu", "gelu_tanh"] = Field(default="silu", description="the gated MLP's activation: SiLU "
                                                   "(SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)")
    window_layers: tuple[int, ...] | None = Field(default=None, description="the layers the sliding window applies "
                                                  "to (Gemma 2: every other one); None: all")
    sandwich_norms: bool = Field(default=False, description="an RMSNorm on the attention's and the MLP's outputs too, "
                                 "before the residual add (Gemma 2)")
    attn_softcap: float = Field(default=0.0, ge=0, le=1e6, description="attention scores s -> c tanh(s / c) "
                                "(Gemma 2's attn_logit_softcapping); 0: none")
    final_softcap: float = Field(default=0.0, ge=0, le=1e6, description="logits z -> c tanh(z / c) (Gemma 2's "
                                 "final_logit_softcapping); 0: none")
    query_scale: float = Field(default=0.0, ge=0, le=1e9, description="scores scaled by query_scale^-0.5 instead of "
                               "head_dim^-0.5 (Gemma 2's query_pre_attn_scalar); 0: head_dim")
    # ---- mixture of experts (n_experts = 0: a dense model; every field below is then unused)
    # A MoE layer replaces the FFN: a router (a d_model x n_experts linear) picks experts_per_token of the
    # n_experts routed experts per token (top-k, Shazeer et al. 2017, arXiv 1701.06538), each a SwiGLU/GELU
    # FFN of width d_ff_expert; shared experts (DeepSeekMoE, arXiv 2401.06066) run on every token, here as one
    # FFN of their total width d_ff_shared. The first ``first_dense_layers`` layers keep a dense FFN of width
    # d_ff (DeepSeek-V3's first_k_dense_replace).
    n_experts: int = Field(default=0, ge=0, le=_DIM, description="routed experts per MoE layer (0: dense)")
    experts_per_token: int = Field(default=0, ge=0, le=_DIM, description="top-k")
    d_ff_expert: int = Field(default=0, ge=0, le=_DIM, description="one routed expert's FFN width (0: d_ff)")
    d_ff_shared: int = Field(default=0, ge=0, le=_DIM, description="the shared experts' total FFN width (0: none)")
    shared_expert_gate: bool = Field(default=False, description="a sigmoid gate (d_model -> 1) on the shared "
                                     "expert's output (Qwen2-MoE)")
    first_dense_layers: int = Field(default=0, ge=0, le=_LAYERS)
    router_norm_topk: bool = Field(default=True, description="renormalise the top-k router weights to sum to 1 "
                                   "(Mixtral, DeepSeek-V3; Qwen-MoE's norm_topk_prob)")
    capacity_factor: float = Field(default=0.0, ge=0, le=1e6, description="tokens an expert takes, as a multiple "
                                   "of its even share (0: dropless, every routed token is computed)")
    aux_loss_coef: float = Field(default=0.01, ge=0, le=1e6, description="load-balance loss weight (Switch "
                                 "Transformer's, arXiv 2101.03961 eq. 4)")
    # ---- multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 Sec. 2.1): queries and keys/values pass
    # through low-rank latents; each head's query/key is head_dim ("nope") + qk_rope_head_dim (decoupled
    # RoPE, a key part shared by all heads), its value v_head_dim wide.
    attention: Literal["mha", "mla"] = "mha"
    q_lora_rank: int = Field(default=0, ge=0, le=_DIM, description="MLA query latent (0: queries projected directly)")
    kv_lora_rank: int = Field(default=0, ge=0, le=_DIM)
    qk_rope_head_dim: int = Field(default=0, ge=0, le=_DIM)
    v_head_dim: int = Field(default=0, ge=0, le=_DIM, description="MLA value width per head (0: head_dim)")
    # ---- multi-token prediction (DeepSeek-V3, arXiv 2412.19437 Sec. 2.2): D sequential modules after the main
    # model, module k an RMSNorm on the previous depth's hidden state and one on the next token's embedding, a
    # projection M_k (d x 2d) of their concatenation, one transformer block (of the kind of the model's last layer)
    # and the output head and embedding shared with the main model. Megatron-Core: --mtp-num-layers; it puts them
    # on the last pipeline stage (multi_token_prediction.py mtp_on_this_rank).
    mtp_layers: int = Field(default=0, ge=0, le=_LAYERS, description="multi-token-prediction depth D (0: none)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole needs qk_norm (it says what the Q/K norms span)")
        if self.post_norms and (self.sandwich_norms or self.norm != "rmsnorm"):
            raise ValueError("post_norms (OLMo-2's RMSNorms after each sub-layer only) excludes sandwich_norms and "
                             "layernorm")
        if self.window_layers is not None and any(not 0 <= i < self.n_layers for i in self.window_layers):
            raise ValueError(f"window_layers {list(self.window_layers)} must be layers 0..{self.n_layers - 1}")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(f"rope_high_freq_factor ({self.rope_high_freq_factor}) must exceed rope_low_freq_factor "
                             f"({self.rope_low_freq_factor})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim_override is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_experts:
            if not 0 < self.experts_per_token <= self.n_experts:
                raise ValueError(f"experts_per_token ({self.experts_per_token}) must be between 1 and n_experts "
                                 f"({self.n_experts})")
            if self.first_dense_layers > self.n_layers:
                raise ValueError(f"first_dense_layers ({self.first_dense_layers}) exceeds n_layers ({self.n_layers})")
        elif self.experts_per_token or self.d_ff_shared or self.first_dense_layers or self.d_ff_expert:
            raise ValueError("experts_per_token, d_ff_expert, d_ff_shared and first_dense_layers need n_experts > 0")
        if self.attention == "mla":
            if not self.kv_lora_rank or not self.qk_rope_head_dim:
                raise ValueError("multi-head latent attention needs kv_lora_rank and qk_rope_head_dim")
        elif self.q_lora_rank or self.kv_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
            raise ValueError("q_lora_rank, kv_lora_rank, qk_rope_head_dim and v_head_dim need attention = 'mla'")
        return self

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has a MoE feed-forward (else a dense one of width d_ff)."""
        return self.n_experts > 0 and i >= self.first_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_dense_layers if self.n_experts else 0

    @property
    def expert_width(self) -> int:
        return self.d_ff_expert or self.d_ff

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: head_dim, plus the decoupled RoPE part under MLA."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class GPUSpec(_Spec):
    name: str = "custom"
    source: str = ""
    peak_bf16_flops: float = Field(gt=0, le=_FLOPS)
    peak_fp8_flops: float = Field(default=0.0, ge=0, le=_FLOPS,
                                  description="dense FP8 tensor peak (0: no FP8 tensor cores, e.g. A100)")
    peak_fp8_flops_source: str = ""
    memory_bytes: float = Field(gt=0, le=_BYTES)
    usable_bytes: float = Field(default=0.0, ge=0, le=_BYTES,
                                description="what the CUDA driver reports as the device's total memory "
                                            "(torch.cuda.get_device_properties().total_memory); 0: memory_bytes")
    usable_bytes_source: str = ""
    hbm_bandwidth: float = Field(gt=0, le=_BYTES)
    tdp_watts: float = Field(gt=0, le=1e6)
    scale_up: str = ""
    scale_up_bandwidth: float = Field(gt=0, le=_BYTES)
    sm_count: int = Field(default=0, ge=0, le=100_000,
                          description="streaming multiprocessors (0: unknown, no wave quantization)")
    generation: str = Field(default="", description="architecture whose constants catalog/planner.toml holds")

    @property
    def capacity_bytes(self) -> float:
        """The memory a process can allocate from: the driver's total (usable_bytes) where the catalog knows it,
        else the datasheet figure."""
        return self.usable_bytes or self.memory_bytes


class ClusterSpec(_Spec):
    name: str = "custom"
    source: str = ""
    gpu: str
    gpus: int = Field(gt=0, le=100_000_000)
    gpus_per_server: int = Field(gt=0, le=4096)
    servers_per_rack: int = Field(gt=0, le=4096)
    scale_up_domain: int = Field(gt=0, le=1_000_000)
    network_bandwidth: float = Field(gt=0, le=_BYTES, description="per GPU, one direction, bytes/s")
    network_latency_s: float = Field(default=5e-6, ge=0, le=60)
    host_link: str = ""
    host_link_bandwidth: float | None = Field(default=None, gt=0, le=_BYTES)
    pod_gpus: int = Field(default=0, ge=0, le=100_000_000,
                          description="GPUs per full-bisection pod (0: one flat network)")
    oversubscription: float = Field(default=1.0, ge=1.0, le=1e6, description="uplink oversubscription above a pod")
    pods_source: str = ""

    @property
    def gpus_per_rack(self) -> int:
        return self.gpus_per_server * self.servers_per_rack


class Facility(_Spec):
    name: str = "default"
    pue: float = Field(gt=1.0 - 1e-9)
    pue_source: str = ""
    rack_width_m: float = Field(gt=0)
    rack_depth_m: float = Field(gt=0)
    rack_height_m: float = Field(gt=0)
    rack_source: str = ""
    gpus_per_rack: int = Field(gt=0)
    gpus_per_rack_source: str = ""
    building_floor_m2: float = Field(gt=0)
    building_source: str = ""
    server_overhead_fraction: float = Field(default=0.25, ge=0)
    server_overhead_source: str = ""
    gpu_idle_fraction: float = Field(default=0.1, ge=0, le=1)
    gpu_idle_source: str = ""
    price_per_kwh: float = Field(default=0.08, ge=0)
    price_source: str = ""


# --------------------------------------------------------------------------- layout

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["none", "selective", "full"]

_NUM_TOKEN = re.compile(r"^([a-z]+)([0-9]+)$")  # ASCII digits only: int() would also read other scripts' digits
MAX_DIGITS = 6  # no layout degree exceeds 10^6 (rules.MAX_PROCESSES); longer numbers are refused unread
# number tokens -> the Layout field they set (a later parallel dimension, e.g. ``ep``, is one more entry)
_NUM_FIELDS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "mb": "mb", "v": "v", "zero": "zero", "hsdp": "hsdp",
               "ep": "ep", "first": "first", "last": "last"}
_GRAMMAR = ("tpN, cpN, ppN, dpN, fsdpN, epN, zero0-3, hsdpN, mbN, vN, gpipe|1f1b|interleaved, "
            "rc=none|selective|full, sp|nosp, firstN, lastN")


class Layout(_Spec):
    """How one training job is split: the same object the planner emits and the runtime applies, and one
    meaning per token wherever a layout string is read (plan, train, report, printed output).

    A layout string is comma-separated tokens, any order, each at most once; an absent token takes the
    default in brackets:

    - ``tpN`` [1] tensor parallel (Megatron-LM column/row split, ``placement.TP_BLOCK_PLAN``); ``cpN`` [1]
      context parallel; ``ppN`` [1] pipeline stages; ``dpN`` [1] data-parallel degree. World = tp·cp·pp·dp.
    - ``zeroK`` [0] how model state is spread over the dp (x cp) ranks (Rajbhandari et al. 2020, arXiv
      1910.02054 Sec. 5): 0 every rank holds everything, gradients all-reduced; 1 the optimizer state
      sharded, whole gradients and weights (Megatron's distributed optimizer; runtime/parallel/zero1.py);
      2 optimizer state and gradients sharded, the weights gathered for a micro-batch's forward and kept
      through its backward (FSDP2 ``reshard_after_forward=False``); 3 everything sharded, the weights
      gathered for each use and freed after (FSDP, ``reshard_after_forward=True``).
    - ``epN`` [1] expert parallelism (a MoE model only): each MoE layer's routed experts are split over N
      of a pipeline stage's tp x cp x dp ranks, which send each token to its experts' rank and back
      (all-to-all): Megatron-Core's expert_model_parallel_size with expert_tensor_parallel_size 1, where N
      divides tp x cp x dp (and hsdp the tp x cp x dp / N expert-data-parallel ranks). It adds no ranks:
      the N ranks still run their own tokens through the dense layers, while each expert's weights and
      optimizer state live on one of them, then are replicated/sharded over the tp x cp x dp / N ranks
      holding the same experts (the expert-data-parallel group). The expert weights are not split by tensor
      parallelism. This runtime trains N dividing dp / hsdp only (``rules.RUNTIME``'s ``ep_in_dp``).
    - ``firstN`` / ``lastN`` [policy] an uneven pipeline cut: N decoder layers on the first / last pipeline
      rank, the rest split evenly over the others (Megatron-Core's --decoder-first-pipeline-num-layers /
      --decoder-last-pipeline-num-layers, transformer_block.get_num_layers_to_build); absent, the cut is
      ``placement``'s. Counting the embedding and the loss as a layer each (Megatron's
      --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split) is the cut
      first = last = S - 1 with S = (L + 2) / pp layers on every middle rank (with one flag, S = (L + 1) / pp and
      only that end one short).
    - ``fsdpN`` is ``dpN,zero3``. ``hsdpN`` [1] (zero >= 1): the dp ranks form N replica groups, each
      sharding over dp/N ranks (hybrid sharding).
    - ``mbN`` [1] sequences per micro-batch, for the planner and the runtime alike: a step runs
      global_batch / (dp·mb) micro-batches per data-parallel rank (gradient accumulation; with a
      pipeline, its micro-batches). Without gradient accumulation: ``mb`` = global_batch / dp.
    - ``gpipe | 1f1b | interleaved`` [1f1b] the pipeline schedule (pp > 1 only); ``vN`` [1] stages per
      pipeline rank, v > 1 meaning interleaved (``placement.local_stage_ids``).
    - ``rc=none|selective|full`` [none] (or bare ``selective``/``full``) activation recomputation.
    - ``sp | nosp`` [sp] sequence parallelism with tp > 1 (without TP there is none: ``nosp`` is dropped).

    ``str(layout)`` writes every count (``tp8,cp1,pp16,dp128,mb1,1f1b,zero1``), the schedule with a
    pipeline and the rest when not the default, so ``Layout.parse(str(x)) == x`` and behaves the same.
    """

    tp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    pp: int = Field(default=1, gt=0)
    dp: int = Field(default=1, gt=0)
    zero: int = Field(default=0, ge=0, le=3)
    hsdp: int = Field(default=1, gt=0)
    ep: int = Field(default=1, gt=0)
    mb: int = Field(default=1, gt=0)
    v: int = Field(default=1, gt=0)
    first: int = Field(default=0, ge=0, description="decoder layers on the first pipeline rank (0: the policy's)")
    last: int = Field(default=0, ge=0, description="decoder layers on the last pipeline rank (0: the policy's)")
    schedule: Schedule = "1f1b"
    recompute: Recompute = "none"
    sp: bool = True

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tp", 1) == 1 and not data.get("sp", True):
            data = {**data, "sp": True}  # sequence parallelism only exists with tensor parallelism
        return data

    @model_validator(mode="after")
    def _check(self) -> Layout:
        why = rules.first_broken(rules.case_of([self]), rules.LAYOUT)  # the rules on a layout's own fields
        if why:
            raise ValueError(why)
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_replicate(self) -> int:
        """Data-parallel replica groups (outermost mesh dim): with zero0 every dp rank outside an EP group."""
        return self.dp // self.ep if self.zero == 0 else self.hsdp

    @property
    def dp_shard(self) -> int:
        """The dp ranks of one replica group outside its EP group (ZeRO's shard group is dp_shard x ep)."""
        return 1 if self.zero == 0 else self.dp // (self.hsdp * self.ep)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Read ``tp8,cp1,pp16,dp128,mb1,1f1b,zero1,rc=selective`` (any order, any subset; see the class)."""
        fields: dict[str, Any] = {}

        def put(key: str, value: Any, token: str) -> None:
            if key in fields and fields[key] != value:
                raise TrainscaleError(f"layout '{text}' sets {key} twice (again by '{token}')")
            fields[key] = value

        for raw in text.replace(" ", "").lower().split(","):
            if not raw:
                continue
            m = _NUM_TOKEN.match(raw)
            if m and (m.group(1) in _NUM_FIELDS or m.group(1) == "fsdp"):
                if len(m.group(2)) > MAX_DIGITS:
                    shown = raw if len(raw) <= 20 else raw[:20] + "..."
                    raise TrainscaleError(f"layout token '{shown}' has a number of more than {MAX_DIGITS} "
                                          "digits; no layout degree exceeds 10^6")
                key, val = m.group(1), int(m.group(2))
                if key == "fsdp":  # fsdpN = dpN,zero3
                    put("dp", val, raw)
                    put("zero", 3, raw)
                else:
                    put(_NUM_FIELDS[key], val, raw)
            elif raw in ("gpipe", "1f1b", "interleaved"):
                put("schedule", raw, raw)
            elif raw in ("sp", "nosp"):
                put("sp", raw == "sp", raw)
            elif raw.startswith(("rc=", "recompute=")):
                put("recompute", raw.split("=", 1)[1], raw)
            elif raw in ("selective", "full"):
                put("recompute", raw, raw)
            else:
                raise TrainscaleError(f"layout token '{raw}' is not understood; use {_GRAMMAR}")
        if fields.get("v", 1) > 1 and "schedule" not in fields:
            fields["schedule"] = "interleaved"
        try:
            return cls(**fields)
        except ValidationError as e:
            raise TrainscaleError(f"layout '{text}' is invalid: {_first_error(e)}") from None

    def __str__(self) -> str:
        parts = [f"tp{self.tp}", f"cp{self.cp}", f"pp{self.pp}", f"dp{self.dp}", f"mb{self.mb}"]
        if self.pp > 1:
            parts.append(self.schedule)
            if self.v > 1:
                parts.append(f"v{self.v}")
            parts += [f"{k}{getattr(self, k)}" for k in ("first", "last") if getattr(self, k)]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"zero{self.zero}")
        if self.hsdp > 1:
            parts.append(f"hsdp{self.hsdp}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.tp > 1 and not self.sp:
            parts.append("nosp")
        return ",".join(parts)


# --------------------------------------------------------------------------- loaders


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", str(e)).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


@cache
def _catalog(kind: str) -> dict[str, dict[str, Any]]:
    text = resources.files("trainscale.catalog").joinpath(f"{kind}.toml").read_text()
    return tomllib.loads(text)


def catalog_names(kind: str) -> list[str]:
    return sorted(_catalog(kind))


def facts() -> dict[str, dict[str, Any]]:
    """Published figures (with sources) from ``catalog/facts.toml``."""
    return _catalog("facts")


def _build(cls: type[BaseModel], data: dict[str, Any], what: str) -> Any:
    try:
        return cls(**data)
    except ValidationError as e:
        raise TrainscaleError(f"{what} is invalid: {_first_error(e)}") from None
    except TypeError as e:
        raise TrainscaleError(f"{what} is invalid: {e}") from None


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    from trainscale.safeio import parse_toml, read_text

    return parse_toml(read_text(path, f"{what} file"), f"{what} file {path}")


def _present(path: Path) -> bool:
    """Whether ``path`` exists; a name too long (or otherwise unusable) is simply not there."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _load(kind: str, cls: type[BaseModel], ref: str | Path, what: str) -> Any:
    path = Path(ref)
    if str(ref) in _catalog(kind):
        return _build(cls, {"name": str(ref), **_catalog(kind)[str(ref)]}, f"{what} '{ref}'")
    if path.suffix == ".toml" and _present(path):
        data = _read_toml(path, what)
        data.setdefault("name", path.stem)
        return _build(cls, data, f"{what} file {path}")
    raise TrainscaleError(
        f"unknown {what} '{ref}'; known: {', '.join(catalog_names(kind))} (or a path to a .toml file)"
    )


def load_model(ref: str | Path | dict[str, Any]) -> ModelSpec:
    """A model from a catalog name, a TOML file, a Hugging Face config.json, or a dict."""
    if isinstance(ref, ModelSpec):
        return ref
    if isinstance(ref, dict):
        return _build(ModelSpec, dict(ref), "model")
    path = Path(ref)
    if _present(path / "config.json"):
        path = path / "config.json"
    if path.suffix == ".json" and _present(path):  # a Hugging Face config.json, read by hf.py
        return _build(ModelSpec, hf.spec_fields(hf.read_config(path), path), f"model file {path}")
    return _load("models", ModelSpec, ref, "model")


def load_gpu(ref: str | Path) -> GPUSpec:
    return ref if isinstance(ref, GPUSpec) else _load("gpus", GPUSpec, ref, "GPU")


def load_cluster(ref: str | Path) -> ClusterSpec:
    return ref if isinstance(ref, ClusterSpec) else _load("clusters", ClusterSpec, ref, "cluster")


def load_facility(ref: str | Path = "default") -> Facility:
    return _load("facility", Facility, ref, "facility")
