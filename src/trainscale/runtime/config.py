"""The training job config: a TOML file (torchtitan-like sections), validated with pydantic.

    [model]   name = "llama3.1-8b" (a catalog entry, optionally with field overrides), or the
              ModelSpec fields inline (n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, ...),
              or init = "PATH": a Hugging Face Llama folder whose config.json gives the model and whose
              safetensors give the starting weights (runtime/hf_init.py)
    [train]   steps, lr, min_lr_ratio, warmup, seq_len, global_batch (sequences), seed,
              weight_decay, grad_clip, betas, precision ("auto" | "bf16" | "fp32"), compile
    [data]    max_chars (limit the text the tokenizer and loader see), cache (folder), tokenizer_vocab
              (default: the model's vocab_size; smaller for a big-vocabulary model on this small corpus)
    [run]     out (run folder), log_every, eval_sequences, layout (default layout string), save_final
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainscale.errors import TrainscaleError
from trainscale.specs import Layout, ModelSpec, _first_error, catalog_names, load_model


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainSection(_Section):
    steps: int = Field(default=100, gt=0)
    lr: float = Field(default=3e-4, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup: int = Field(default=10, ge=0)
    seq_len: int = Field(default=256, gt=0)
    global_batch: int = Field(default=8, gt=0, description="sequences per optimizer step")
    seed: int = 0
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, ge=0, description="0: no clipping")
    betas: tuple[float, float] = (0.9, 0.95)
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="bf16: FSDP2 mixed precision (bf16 weights and compute, fp32 gradient "
        "reduction) or bf16 autocast without FSDP; fp32; auto: bf16 on GPUs, fp32 on CPU")
    compile: bool = Field(default=False, description="torch.compile each transformer block")


class DataSection(_Section):
    max_chars: int | None = Field(default=None, gt=0)
    cache: str | None = None
    tokenizer_vocab: int | None = Field(default=None, gt=256, description="default: the model's vocab_size")


class RunSection(_Section):
    out: str = "runs/run"
    log_every: int = Field(default=1, gt=0)
    eval_sequences: int = Field(default=64, ge=0)
    layout: str = ""
    save_final: bool = Field(default=True, description="gather the weights to rank 0 and write RUN_DIR/final")


class CheckpointSection(_Section):
    every_steps: int = Field(default=0, ge=0, description="save every N steps (0: never)")
    every_seconds: float = Field(default=0.0, ge=0, description="also save when this long has passed (0: off)")
    keep: int = Field(default=3, gt=0, description="committed checkpoints to retain")
    async_save: bool = Field(default=False, description="write in the background while training goes on")
    dir: str | None = Field(default=None, description="default: RUN_DIR/checkpoints")
    collective_timeout_s: float = Field(default=600.0, gt=0, description="a rank silent this long counts as hung")


class TrainConfig(_Section):
    name: str = "run"
    model: ModelSpec
    init: str | None = Field(default=None, description="[model] init: a Hugging Face folder to start from")
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    run: RunSection = RunSection()
    checkpoint: CheckpointSection = CheckpointSection()

    @property
    def tokenizer_vocab(self) -> int:
        return self.data.tokenizer_vocab or self.model.vocab_size

    def to_toml(self) -> str:
        """The resolved config (model fields spelled out), as TOML."""
        def val(v: Any) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, str):
                return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            if isinstance(v, tuple | list):
                return "[" + ", ".join(val(x) for x in v) + "]"
            return repr(v)

        lines = [f"name = {val(self.name)}", ""]
        for section, obj in (("model", self.model), ("train", self.train), ("data", self.data), ("run", self.run),
                             ("checkpoint", self.checkpoint)):
            lines.append(f"[{section}]")
            if section == "model" and self.init is not None:
                lines.append(f"init = {val(self.init)}")
            for k, v in obj.model_dump(by_alias=True, exclude_none=True).items():
                lines.append(f"{k} = {val(v)}")
            lines.append("")
        return "\n".join(lines)


def _model_from(section: dict[str, Any]) -> ModelSpec:
    section = dict(section)
    if "init" in section:  # a Hugging Face folder: its config.json is the model, the section's fields override
        from trainscale.runtime.hf_init import hf_folder_spec

        base = hf_folder_spec(section.pop("init")).model_dump(by_alias=True, exclude_none=True)
        return load_model({**base, **section})
    name = section.get("name")
    if name is not None and name in catalog_names("models"):
        base = load_model(name).model_dump(by_alias=True, exclude_none=True)
        section = {**base, **section}
    return load_model(section)


def config_from_dict(data: dict[str, Any], what: str = "config") -> TrainConfig:
    data = dict(data)
    if "model" not in data or not isinstance(data["model"], dict):
        raise TrainscaleError(f"{what} needs a [model] section (name = a catalog model, or the ModelSpec fields)")
    unknown = set(data) - {"name", "model", "train", "data", "run", "checkpoint"}
    if unknown:
        raise TrainscaleError(f"{what}: unknown section or key '{sorted(unknown)[0]}'; "
                              "use [model], [train], [data], [run], [checkpoint]")
    init = data["model"].get("init")
    if init is not None and not isinstance(init, str):
        raise TrainscaleError(f"{what}: [model] init must be a folder path (a string), not {init!r}")
    data["model"] = _model_from(data["model"])
    if init is not None:
        from trainscale.runtime.hf_init import check_hf_weights

        data["init"] = str(Path(init).expanduser().resolve())
        check_hf_weights(data["init"], data["model"])
    try:
        cfg = TrainConfig(**data)
    except ValidationError as e:
        raise TrainscaleError(f"{what} is invalid: {_first_error(e)}") from None
    if cfg.data.tokenizer_vocab is not None and cfg.data.tokenizer_vocab > cfg.model.vocab_size:
        raise TrainscaleError(f"{what}: data.tokenizer_vocab {cfg.data.tokenizer_vocab} exceeds the model's vocab_size "
                              f"{cfg.model.vocab_size}")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise TrainscaleError(f"{what}: train.seq_len {cfg.train.seq_len} exceeds the model's max_seq_len "
                              f"{cfg.model.max_seq_len}")
    return cfg


def load_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> TrainConfig:
    """Read a training config TOML; ``overrides`` ({section: {key: value}}) replace its values."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TrainscaleError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TrainscaleError(f"config file {path} cannot be read: {e}") from None
    data.setdefault("name", path.stem)
    for section, values in (overrides or {}).items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data, f"config {path}")


def check_layout(cfg: TrainConfig, layout: Layout) -> None:
    """Everything a layout must divide, said in one sentence each."""
    m, t = cfg.model, cfg.train
    if m.n_heads % layout.tp or m.n_kv_heads % layout.tp:
        raise TrainscaleError(f"tp{layout.tp} must divide the model's {m.n_heads} heads and {m.n_kv_heads} KV heads")
    if m.d_ff % layout.tp:
        raise TrainscaleError(f"tp{layout.tp} must divide d_ff {m.d_ff}")
    if layout.tp > 1 and m.vocab_size % layout.tp:
        raise TrainscaleError(f"tp{layout.tp} must divide vocab_size {m.vocab_size}")
    if layout.cp > 1 and t.seq_len % (2 * layout.cp):
        raise TrainscaleError(f"cp{layout.cp} needs seq_len divisible by 2*cp = {2 * layout.cp}, not {t.seq_len}")
    if layout.tp > 1 and layout.sp and (t.seq_len // layout.cp) % layout.tp:
        raise TrainscaleError(f"sequence parallel needs the per-rank sequence ({t.seq_len // layout.cp}) divisible "
                              f"by tp{layout.tp}")
    stages = layout.pp * layout.v
    if stages > m.n_layers:
        raise TrainscaleError(f"pp{layout.pp} x v{layout.v} = {stages} stages exceed the model's {m.n_layers} layers")
    if t.global_batch % (layout.dp * layout.mb):
        raise TrainscaleError(f"global_batch {t.global_batch} must be divisible by dp{layout.dp} x mb{layout.mb}")
    n_micro = t.global_batch // (layout.dp * layout.mb)
    if layout.pp > 1 and layout.schedule == "1f1b" and n_micro < layout.pp:
        raise TrainscaleError(f"1F1B needs at least pp{layout.pp} microbatches per step, but global_batch / (dp x mb) "
                              f"= {n_micro}")
    if layout.pp > 1 and layout.schedule == "interleaved" and n_micro % max(1, n_micro // layout.pp):
        raise TrainscaleError(f"interleaved 1F1B needs the {n_micro} microbatches to be a multiple of "
                              f"{n_micro // layout.pp}")
    if m.tied_embeddings and (layout.tp > 1 or layout.pp > 1):
        raise TrainscaleError("tied embeddings are supported without tensor or pipeline parallelism only")


def micro_batch(cfg: TrainConfig, layout: Layout) -> int:
    """Sequences per forward pass: the layout's ``mb`` if given (or with a pipeline, which needs
    microbatches), else the whole local batch (no gradient accumulation)."""
    local = cfg.train.global_batch // layout.dp
    if layout.pp > 1 or "mb" in layout.model_fields_set:
        return layout.mb
    return local
