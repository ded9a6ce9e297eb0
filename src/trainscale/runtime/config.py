"""The training job config: a TOML file (torchtitan-like sections), validated with pydantic.

    [model]   name = "llama3.1-8b" (a catalog entry, optionally with field overrides), or the
              ModelSpec fields inline (n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, ...),
              or init = "PATH": a Hugging Face Llama folder whose config.json gives the model and whose
              safetensors give the starting weights (runtime/hf_init.py)
    [train]   steps, lr, min_lr_ratio, warmup, seq_len, global_batch (sequences), seed,
              weight_decay, grad_clip, betas, precision ("auto" | "bf16" | "fp32"), compile
    [data]    files (the user's corpus: text / JSONL / Parquet paths, globs or folders; default: the
              Shakespeare plays), format, text_field, documents, held_out, tokenizer (tokenizer.json or an
              HF tokenizer folder; default: a BPE trained on the corpus), eot, prepared (shard folder),
              workers, shard_mb; max_chars (limit the text the tokenizer and, for the plays, the loader
              see), cache (folder), tokenizer_vocab (default: the model's vocab_size)
    [run]     out (run folder), log_every, eval_sequences, layout (default layout string), save_final
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainscale import rules
from trainscale.errors import TrainscaleError
from trainscale.specs import Layout, ModelSpec, _first_error, catalog_names, load_model


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TrainSection(_Section):
    steps: int = Field(default=100, gt=0, le=1_000_000_000)
    lr: float = Field(default=3e-4, gt=0, le=10)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup: int = Field(default=10, ge=0, le=1_000_000_000)
    seq_len: int = Field(default=256, gt=0, le=1 << 24)
    global_batch: int = Field(default=8, gt=0, le=1 << 24, description="sequences per optimizer step")
    seed: int = Field(default=0, ge=0, lt=2**63)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    grad_clip: float = Field(default=1.0, ge=0, le=1e6, description="0: no clipping")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="bf16: FSDP2 mixed precision (bf16 weights and compute, fp32 gradient "
        "reduction) or bf16 autocast without FSDP; fp32; auto: bf16 on GPUs, fp32 on CPU")
    compile: bool = Field(default=False, description="torch.compile each transformer block")


class DataSection(_Section):
    files: tuple[str, ...] = Field(default=(), description="text/JSONL/Parquet files, globs or folders; "
                                   "empty: the Shakespeare plays")
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(default="auto", description="auto: by suffix")
    text_field: str = Field(default="text", description="the JSONL field / Parquet column holding the text")
    documents: Literal["paragraph", "file"] = Field(default="paragraph", description="plain text: a document "
                                                    "is a blank-line separated paragraph, or a whole file")
    held_out: float = Field(default=0.05, gt=0, lt=1, description="fraction of documents held out")
    tokenizer: str | None = Field(default=None, description="tokenizer.json or a Hugging Face tokenizer "
                                  "folder; default: a byte-level BPE trained on the corpus")
    eot: str | None = Field(default=None, description="end-of-text token (default: the tokenizer's)")
    prepared: str | None = Field(default=None, description="where prepare-data writes the shards "
                                 "(default: a folder in the cache named by the inputs)")
    workers: int = Field(default=0, ge=0, description="tokenising processes (0: one per CPU)")
    shard_mb: float = Field(default=32.0, gt=0, description="input megabytes per shard (a unit of work)")
    max_chars: int | None = Field(default=None, gt=0)
    cache: str | None = None
    tokenizer_vocab: int | None = Field(default=None, gt=256, description="default: the model's vocab_size")

    @field_validator("files", mode="before")
    @classmethod
    def _one_file(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    def request(self):
        """The corpus to prepare (runtime/data/shards.py), or None for the Shakespeare plays with a trained
        tokenizer (the plays with a loaded tokenizer are prepared like a user's files, a play a document)."""
        if not self.files and self.tokenizer is None:
            return None
        from trainscale.runtime.data.shards import DataRequest
        from trainscale.runtime.data.sources import Settings, corpus_files

        files, documents = self.files, self.documents
        if not files:
            files, documents = tuple(str(f) for f in corpus_files()), "file"
        return DataRequest(files=files, format=self.format, tokenizer=self.tokenizer,
                           tokenizer_vocab=self.tokenizer_vocab, eot=self.eot, max_chars=self.max_chars,
                           folder=self.prepared, workers=self.workers,
                           settings=Settings(documents=documents, text_field=self.text_field,
                                             held_out=self.held_out, unit_bytes=max(1, int(self.shard_mb * 2**20))))


class RunSection(_Section):
    out: str = "runs/run"
    log_every: int = Field(default=1, gt=0, le=1_000_000_000)
    eval_sequences: int = Field(default=64, ge=0, le=1_000_000)
    layout: str = ""
    save_final: bool = Field(default=True, description="gather the weights to rank 0 and write RUN_DIR/final")


class CheckpointSection(_Section):
    every_steps: int = Field(default=0, ge=0, le=1_000_000_000, description="save every N steps (0: never)")
    every_seconds: float = Field(default=0.0, ge=0, le=1e9, description="also save when this long has passed (0: off)")
    keep: int = Field(default=3, gt=0, le=10_000, description="committed checkpoints to retain")
    async_save: bool = Field(default=False, description="write in the background while training goes on")
    dir: str | None = Field(default=None, description="default: RUN_DIR/checkpoints")
    collective_timeout_s: float = Field(default=600.0, gt=0, le=86_400,
                                        description="a rank silent this long counts as hung")


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
        """The resolved config (model fields spelled out), as TOML that reads back equal (``safeio.toml_text``)."""
        from trainscale.safeio import toml_text

        data: dict[str, Any] = {"name": self.name}
        for section, obj in (("model", self.model), ("train", self.train), ("data", self.data), ("run", self.run),
                             ("checkpoint", self.checkpoint)):
            fields = obj.model_dump(by_alias=True, exclude_none=True)
            data[section] = {"init": self.init, **fields} if section == "model" and self.init is not None else fields
        return toml_text(data)


def _model_from(section: dict[str, Any]) -> ModelSpec:
    section = dict(section)
    if "init" in section:  # a Hugging Face folder: its config.json is the model, the section's fields override
        from trainscale.runtime.artifact import init_spec_fields  # (or a trainscale model: its model.json)
        from trainscale.runtime.hf_init import hf_folder_spec

        init = section.pop("init")
        base = init_spec_fields(init) or hf_folder_spec(init).model_dump(by_alias=True, exclude_none=True)
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
    if init is not None:  # a trainscale model, run or checkpoint -> its model folder (runtime/artifact.py)
        from trainscale.runtime.artifact import check_init_weights, init_folder

        init = init_folder(init)
        data["model"] = {**data["model"], "init": init}
        if (Path(init) / "tokenizer.json").exists() and isinstance(data.get("data", {}), dict) \
                and (Path(init) / "model.json").exists() and data.get("data", {}).get("tokenizer") is None:
            data["data"] = {**data.get("data", {}), "tokenizer": str(Path(init) / "tokenizer.json")}  # its token ids
    data["model"] = _model_from(data["model"])
    if init is not None:
        from trainscale.runtime.hf_init import check_hf_weights

        data["init"] = init
        if not check_init_weights(init, data["model"]):
            check_hf_weights(init, data["model"])
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
    from trainscale.safeio import read_text

    path = Path(path)
    try:
        data = tomllib.loads(read_text(path, "config file"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TrainscaleError(f"config file {path} cannot be read: {e}") from None
    data.setdefault("name", path.stem)
    for section, values in (overrides or {}).items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data, f"config {path}")


def check_layout(cfg: TrainConfig, layout: Layout) -> None:
    """What this runtime refuses to train, in one sentence: ``rules.RUNTIME_CHECK`` (the model, the layout, the
    config's sequence length and global batch)."""
    rules.check_layout(cfg.model, layout, cfg.train.seq_len, cfg.train.global_batch)


def micro_batch(cfg: TrainConfig, layout: Layout) -> int:
    """Sequences per forward pass: the layout's ``mb`` (1 unless the layout says otherwise, as in the
    planner); a step runs global_batch / (dp x mb) of them per data-parallel rank."""
    return layout.mb
