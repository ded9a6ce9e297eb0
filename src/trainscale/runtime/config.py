"""The training job config: a TOML file (torchtitan-like sections), validated with pydantic.

    [model]   name = "llama3.1-8b" (a catalog entry, optionally with field overrides), or the
              ModelSpec fields inline (n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, ...),
              or init = "PATH": a Hugging Face folder whose config.json gives the model and whose
              safetensors give the starting weights, or a trainscale model, run or checkpoint; runtime/init.py
              resolves it (``resolved_config``) before this module validates the tables: config is data, read
              here without opening a folder or a weight
    [train]   steps, lr, min_lr_ratio, warmup, schedule ("cosine" | "linear" | "wsd" | "constant"), decay_fraction
              (WSD), seq_len, global_batch (sequences), seed, weight_decay, grad_clip, betas, precision ("auto" |
              "bf16" | "fp32"), compile, eval_every (the schedules: runtime/schedule.py)
    [data]    files (the user's corpus: text / JSONL / Parquet / Megatron .bin+.idx / .npy token paths, globs
              or folders; default: the Shakespeare plays) or [[data.sources]] tables (files, weight, name:
              a weighted mixture), format, text_field, documents, held_out, tokenizer (tokenizer.json or an
              HF tokenizer folder; default: a BPE trained on the corpus; token files need theirs), eot,
              prepared (shard folder), workers, shard_mb; max_chars (limit the text the tokenizer and, for
              the plays, the loader see), cache (folder), tokenizer_vocab (default: the model's vocab_size);
              format = "chat": JSONL conversations rendered by the tokenizer folder's chat template, only the
              assistant's words learned (runtime/data/chat.py); document_mask (always on with chat): packed
              documents do not attend to each other and their positions restart at 0
    [run]     out (run folder), log_every, eval_sequences, layout (default layout string), save_final, sinks;
              straggler_margin, hang_factor, hang_floor_s (runtime/job/ranks.py)
    [profile] steps = [a, b] (torch.profiler trace + memory snapshot of those steps), ranks

Any value can be overridden from the command line: ``--set train.lr=1e-4`` (``parse_set``: the value read as
TOML, then validated by the same models; an unknown section or key is refused in one sentence).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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
    schedule: Literal["cosine", "linear", "wsd", "constant"] = Field(
        default="cosine", description="after the warmup: cosine or linear to min_lr_ratio x lr at the last step; wsd: "
        "constant, then linear to min_lr_ratio x lr over the last decay_fraction of the steps (MiniCPM, arXiv "
        "2404.06395); constant (runtime/schedule.py)")
    decay_fraction: float = Field(default=0.1, gt=0, le=1, description="wsd: the share of the steps that decay "
                                  "(MiniCPM: about 10% suffices)")
    seq_len: int = Field(default=256, gt=0, le=1 << 24)
    global_batch: int = Field(default=8, gt=0, le=1 << 24, description="sequences per optimizer step")
    seed: int = Field(default=0, ge=0, lt=2**63)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    grad_clip: float = Field(default=1.0, ge=0, le=1e6, description="0: no clipping")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="bf16: FSDP2 mixed precision (bf16 weights and compute, fp32 gradient "
        "reduction) or bf16 autocast without FSDP; fp32; auto: bf16 on GPUs, fp32 on CPU")
    compile: bool | None = Field(default=None, description="torch.compile each transformer block (default: on "
                                 "CUDA, where it is the fast path, off on CPU)")
    eval_every: int = Field(default=0, ge=0, le=1_000_000_000, description="held-out loss every N steps on the "
                            "run's own held-out split (0: only at the end)")


def _as_tuple(v: Any) -> Any:
    return (v,) if isinstance(v, str) else v


class SourceSection(_Section):
    """One ``[[data.sources]]`` table: a mixture component."""

    files: tuple[str, ...] = Field(min_length=1, description="its files, globs or folders")
    weight: float = Field(default=1.0, gt=0, le=1e9, description="its share of the sequences drawn (normalised)")
    name: str = Field(default="", max_length=200)

    _one_file = field_validator("files", mode="before")(_as_tuple)


class DataSection(_Section):
    files: tuple[str, ...] = Field(default=(), description="text/JSONL/Parquet/.bin+.idx/.npy files, globs or "
                                   "folders; empty: the Shakespeare plays")
    sources: tuple[SourceSection, ...] = Field(default=(), max_length=1000, description="[[data.sources]]: a "
                                               "weighted mixture, instead of files")
    format: Literal["auto", "text", "jsonl", "parquet", "megatron", "npy", "chat"] = Field(
        default="auto", description="auto: by suffix; chat: JSONL conversations ({\"messages\": [...]} or "
        "{\"prompt\", \"response\"}) rendered with the tokenizer folder's chat template")
    document_mask: bool = Field(default=False, description="packed documents do not attend to each other, and "
                                "each one's positions restart at 0 (always on with format = \"chat\")")
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
    shard_mb: float = Field(default=64.0, gt=0, le=1 << 20, description="input megabytes per shard (a unit of "
                            "work: small files are gathered into one, a large file is cut into several)")
    max_chars: int | None = Field(default=None, gt=0)
    cache: str | None = None
    tokenizer_vocab: int | None = Field(default=None, gt=256, description="default: the model's vocab_size")

    _one_file = field_validator("files", mode="before")(_as_tuple)

    @property
    def documents_apart(self) -> bool:
        """Whether packed documents are kept apart (``document_mask``, or chat data)."""
        return self.document_mask or self.format == "chat"

    @model_validator(mode="after")
    def _files_or_sources(self) -> DataSection:
        if self.files and self.sources:
            raise ValueError("give data.files (one source) or [[data.sources]] (a mixture), not both")
        if self.format == "chat" and not (self.files or self.sources):
            raise ValueError("data.format = \"chat\" needs the conversations: data.files = [\"chat.jsonl\"]")
        if self.document_mask and not (self.files or self.sources or self.tokenizer):
            raise ValueError("data.document_mask needs a prepared corpus (data.files or data.tokenizer); the "
                             "default plays are read without document boundaries")
        return self

    def request(self):
        """The corpus to prepare (runtime/data/shards.py), or None for the Shakespeare plays with a trained
        tokenizer (the plays with a loaded tokenizer are prepared like a user's files, a play a document)."""
        if not self.files and not self.sources and self.tokenizer is None:
            return None
        from trainscale.runtime.data.shards import Component, DataRequest
        from trainscale.runtime.data.sources import Settings, corpus_files

        files, documents = self.files, self.documents
        components = tuple(Component(c.files, c.weight, c.name or f"source {i + 1}")
                           for i, c in enumerate(self.sources))
        if not files and not components:
            files, documents = tuple(str(f) for f in corpus_files()), "file"
        return DataRequest(files=files, components=components, format=self.format, tokenizer=self.tokenizer,
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
    sinks: tuple[Literal["mlflow", "wandb"], ...] = Field(default=(), description="metrics sinks beside "
                                                          "TensorBoard: mlflow (file store), wandb (offline)")
    straggler_margin: float = Field(default=0.5, ge=0.05, le=100, description="a rank whose own time per step "
                                    "exceeds its peers' and its predicted one by this fraction is named a straggler")
    hang_factor: float = Field(default=20.0, gt=1, le=1e6, description="a step this many times its reference "
                               "(predicted, else the median so far) writes every rank's stacks to RUN/stacks")
    hang_floor_s: float = Field(default=60.0, ge=0.1, le=86_400, description="the stacks are never written before "
                                "a step has run this long")


class CheckpointSection(_Section):
    every_steps: int = Field(default=0, ge=0, le=1_000_000_000, description="save every N steps (0: never)")
    every_seconds: float = Field(default=0.0, ge=0, le=1e9, description="also save when this long has passed (0: off)")
    keep: int = Field(default=3, gt=0, le=10_000, description="committed checkpoints to retain")
    async_save: bool = Field(default=False, description="write in the background while training goes on")
    dir: str | None = Field(default=None, description="default: RUN_DIR/checkpoints")
    collective_timeout_s: float = Field(default=600.0, gt=0, le=86_400,
                                        description="a rank silent this long counts as hung")


class ProfileSection(_Section):
    """[profile] steps = [a, b]: torch.profiler around steps a..b (1-based, inclusive) on the ranks listed, a
    chrome trace per rank and a CUDA memory snapshot (or, on CPU, the profiler's memory view) in RUN/profile."""
    steps: tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]] | None = Field(
        default=None, description="first and last step to profile (inclusive)")
    ranks: tuple[Annotated[int, Field(ge=0)], ...] = Field(default=(0,), description="ranks that write a trace")

    @field_validator("steps")
    @classmethod
    def _ordered(cls, v: Any) -> Any:
        if v is not None and v[0] > v[1]:
            raise ValueError(f"[profile] steps must be [first, last] with first <= last, not {list(v)}")
        return v


class TrainConfig(_Section):
    name: str = "run"
    model: ModelSpec
    init: str | None = Field(default=None, description="[model] init: a Hugging Face folder to start from")
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    run: RunSection = RunSection()
    checkpoint: CheckpointSection = CheckpointSection()
    profile: ProfileSection = ProfileSection()

    @property
    def tokenizer_vocab(self) -> int:
        return self.data.tokenizer_vocab or self.model.vocab_size

    def to_toml(self) -> str:
        """The resolved config (model fields spelled out), as TOML that reads back equal (``safeio.toml_text``)."""
        from trainscale.safeio import toml_text

        data: dict[str, Any] = {"name": self.name}
        for section, obj in (("model", self.model), ("train", self.train), ("data", self.data), ("run", self.run),
                             ("checkpoint", self.checkpoint), ("profile", self.profile)):
            fields = obj.model_dump(by_alias=True, exclude_none=True)
            data[section] = {"init": self.init, **fields} if section == "model" and self.init is not None else fields
        return toml_text(data)


def _model_from(section: dict[str, Any]) -> ModelSpec:
    """The ``[model]`` section's ModelSpec: a catalog entry with the section's fields over it, or the fields."""
    name = section.get("name")
    if name is not None and name in catalog_names("models"):
        base = load_model(name).model_dump(by_alias=True, exclude_none=True)
        section = {**base, **section}
    return load_model(section)


_TABLES = ("name", "model", "train", "data", "run", "checkpoint", "profile")


def check_sections(data: dict[str, Any], what: str = "config") -> None:
    """The config's raw tables have a [model] section, no unknown section, and ``[model] init`` (if any) is a
    path (a string): refused in one sentence each."""
    if "model" not in data or not isinstance(data["model"], dict):
        raise TrainscaleError(f"{what} needs a [model] section (name = a catalog model, or the ModelSpec fields)")
    unknown = set(data) - set(_TABLES)
    if unknown:
        raise TrainscaleError(f"{what}: unknown section or key '{sorted(unknown)[0]}'; "
                              "use [model], [train], [data], [run], [checkpoint], [profile]")
    for section in _SECTIONS:
        table = data.get(section)
        if isinstance(table, dict):
            for key in table:
                _known_key(section, str(key), what)
    init = data["model"].get("init")
    if init is not None and not isinstance(init, str):
        raise TrainscaleError(f"{what}: [model] init must be a folder path (a string), not {init!r}")


def config_from_dict(data: dict[str, Any], what: str = "config", init: str | None = None) -> TrainConfig:
    """The config's raw tables validated into a ``TrainConfig``; nothing is read from disk. A ``[model] init`` is
    resolved first by ``runtime/init.py`` (``resolve_init``), which spells the folder's model fields out in
    [model] and passes the folder as ``init``: this module never opens the folder or its weights."""
    data = dict(data)
    check_sections(data, what)
    if data["model"].get("init") is not None:
        raise TrainscaleError(f"{what}: [model] init {data['model']['init']} is read by trainscale.runtime.init "
                              "(resolved_config), not by the config parser")
    section = {k: v for k, v in data["model"].items() if k != "init"}
    # a resolved init: its fields are complete (the folder's, the section's over them), no catalog entry under them
    try:
        data["model"] = load_model(section) if init is not None else _model_from(section)
    except TrainscaleError as e:  # name the file: "config c.toml: [model] max_seq_len: Field required"
        raise TrainscaleError(f"{what}: [model] {str(e).removeprefix('model is invalid: ')}") from None
    if init is not None:
        data["init"] = init
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


_SECTIONS: dict[str, type[BaseModel]] = {"model": ModelSpec, "train": TrainSection, "data": DataSection,
                                         "run": RunSection, "checkpoint": CheckpointSection, "profile": ProfileSection}


def _keys(section: str) -> set[str]:
    fields = _SECTIONS[section].model_fields
    keys = set(fields) | {f.alias for f in fields.values() if f.alias}
    return keys | {"init"} if section == "model" else keys


def _known_key(section: str, key: str, what: str) -> None:
    """A key the section has, or one sentence naming the key, the nearest known one and where it was written."""
    import difflib

    if key in _keys(section):
        return
    near = difflib.get_close_matches(key, sorted(_keys(section)), n=1)
    hint = f"; did you mean {near[0]}?" if near else f"; its keys are {', '.join(sorted(_keys(section)))}"
    raise TrainscaleError(f"{what}: [{section}] has no key {key[:80]!r}{hint}")


def parse_set(text: str) -> tuple[str | None, str, Any]:
    """``--set section.key=value`` (or ``name=value``) -> (section, key, value). The value is read as a TOML value
    (``1e-4``, ``true``, ``"text"``, ``[0.9, 0.99]``, ``[{files = "a.txt"}]``); one that is not TOML is taken as a
    string (``run.out=runs/x``). The config's models then type and check it, as they do the file's values."""
    import difflib

    name, sep, raw = text.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name:
        raise TrainscaleError(f"--set {text!r}: give section.key=value, e.g. --set train.lr=1e-4")
    section, _, key = name.rpartition(".")
    if section not in _SECTIONS and name != "name":
        raise TrainscaleError(f"--set {name}: no config section {section or name!r}; the sections are "
                              f"{', '.join(_SECTIONS)} (and the top-level name)")
    if section and key not in _keys(section):
        near = difflib.get_close_matches(key, sorted(_keys(section)), n=1)
        hint = f"; did you mean {section}.{near[0]}?" if near else ""
        raise TrainscaleError(f"--set {name}: [{section}] has no key {key!r}{hint}")
    try:
        value = _toml_value(raw)
    except tomllib.TOMLDecodeError:
        value = raw
    return section or None, key, value


def _toml_value(raw: str) -> Any:
    return tomllib.loads(f"v = {raw}")["v"]


def apply_sets(data: dict[str, Any], sets: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The config's raw tables with each ``--set`` applied (later ones win)."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for text in sets:
        section, key, value = parse_set(text)
        if section is None:
            data[key] = value
            continue
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise TrainscaleError(f"--set {section}.{key}: the config's {section} is not a table")
        data[section] = {**table, key: value}
    return data


def config_tables(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None,
                  sets: list[str] | tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """A training config TOML's raw tables, ``sets`` (``--set section.key=value``, ``parse_set``) then ``overrides``
    ({section: {key: value}}, e.g. ``--steps``) applied -> (tables, the config's name for a sentence)."""
    from trainscale.safeio import parse_toml, read_text

    path = Path(path)
    data = parse_toml(read_text(path, "config file"), f"config file {path}")
    data.setdefault("name", path.stem)
    data = apply_sets(data, sets)
    for section, values in (overrides or {}).items():
        data[section] = {**data.get(section, {}), **values}
    return data, f"config {path}" + (f" with --set {' --set '.join(sets)}" if sets else "")


def load_config(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None,
                sets: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a training config TOML (``config_tables``) and validate it (``config_from_dict``). A config with
    ``[model] init`` is read by ``trainscale.runtime.init.resolved_config``, which resolves the folder first."""
    return config_from_dict(*config_tables(path, overrides, sets))


def check_layout(cfg: TrainConfig, layout: Layout) -> None:
    """What this runtime refuses to train, in one sentence: ``rules.RUNTIME_CHECK`` (the model, the layout, the
    config's sequence length and global batch, and whether its data keeps documents apart)."""
    documents = "chat" if cfg.data.format == "chat" else "document_mask" if cfg.data.document_mask else ""
    rules.check_layout(cfg.model, layout, cfg.train.seq_len, cfg.train.global_batch, documents)

