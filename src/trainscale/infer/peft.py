"""A trainscale LoRA folder as a PEFT adapter: ``adapter_config.json`` + ``adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(base, folder)`` loads onto the transformers model of the base (the base exported
with ``export --to hf``).

The format, as peft 0.21 writes it (``PeftModel.save_pretrained``: peft/utils/save_and_load.py
``get_peft_model_state_dict`` drops the adapter name "default"; peft/utils/constants.py names the two files):
tensor ``base_model.model.<module>.lora_A.weight`` [r, d_in] and ``...lora_B.weight`` [d_out, r] for each adapted
``nn.Linear`` ``<module>`` of the transformers model (``model.layers.N.self_attn.q_proj``...). peft's LoRA layer
adds ``scaling · B A x`` with ``scaling = lora_alpha / r`` (peft/tuners/lora/layer.py ``update_layer``, without
rsLoRA), Hu et al. 2021's update, as infer/lora.py computes it: A and B are written unchanged (shapes equal),
save for one row order. trainscale's Q and K rows rotate interleaved pairs, the HF families' halves
(``hf.rope_interleaved_to_half``, what the base export does to wq / wk): the merged weight's rows
W + s·B A permute as P W + s·(P B) A, so B of wq / wk gets the same per-head row permutation and A none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trainscale import hf
from trainscale.errors import TrainscaleError
from trainscale.estimate.lora import lora_targets
from trainscale.infer.chatfiles import read_chat_files
from trainscale.infer.export import HF_DTYPES, check_llama, check_mixtral, write_tokenizer_files
from trainscale.infer.load import load_tokenizer_for
from trainscale.infer.lora import ADAPTER_FILE, read_adapter_config
from trainscale.infer.quantize import safetensors_layout
from trainscale.runtime.artifact import check_finite, check_header, read_header, read_spec
from trainscale.safeio import atomic_write, atomic_write_json
from trainscale.specs import ModelSpec

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's PeftModelForCausalLM (.base_model) wrapping LoraModel (.model)
_LEAF = {"lora_a": "lora_A", "lora_b": "lora_B"}


def _expected_shapes(spec: ModelSpec, rank: int, targets: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The adapter tensors infer/lora.py makes for this model (meta tensors): names and shapes to check against."""
    from trainscale.infer.lora import adapter_state_dict, apply_lora
    from trainscale.runtime.model import build_model

    meta = build_model(spec, "meta")
    apply_lora(meta, rank, 1.0, targets)
    return adapter_state_dict(meta)


def peft_name(name: str, family: hf.Family) -> str:
    """``layers.3.attention.wq.lora_b`` -> ``base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight``."""
    stem, _, leaf = name.rpartition(".")
    module = hf.hf_name(f"{stem}.weight", family).removesuffix(".weight")
    return f"{PREFIX}{module}.{_LEAF[leaf]}.weight"


def peft_state_dict(sd: dict[str, torch.Tensor], spec: ModelSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our adapter tensors under peft's names; B of Q and K with its rows in the HF family's rotate-half order."""
    family, out = hf.export_family(spec), {}
    for name, t in sd.items():
        t = t.detach().float()
        heads = hf.rope_permuted_heads(name, spec)
        if heads is not None and name.endswith(".lora_b"):
            t = hf.rope_interleaved_to_half(t, heads, spec.head_dim)
        out[peft_name(name, family)] = t.to(dtype).contiguous()
    return out


def peft_config(spec: ModelSpec, rank: int, alpha: float, targets: tuple[str, ...], base: str) -> dict[str, Any]:
    """peft's LoraConfig fields (peft/tuners/lora/config.py) for adapters on every layer's ``targets``."""
    family = hf.export_family(spec)
    sub = {t: "attention" if t in ("wq", "wk", "wv", "wo") else "feed_forward" for t in targets}
    modules = sorted({hf.hf_name(f"layers.0.{sub[t]}.{t}.weight", family).split(".")[-2] for t in targets})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
            "lora_alpha": alpha, "target_modules": modules, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}}


def check_not_into_base(out: Path, base: Path) -> None:
    """A PEFT adapter goes beside its base, never into it (nor into a folder inside it): peft loads the base from
    its own folder, and the adapter's tokenizer files would overwrite the base's. One sentence otherwise."""
    o, b = out.resolve(), base.resolve()
    if o == b or b in o.parents:
        raise TrainscaleError(f"--to peft would write the adapter into {out}, which is {'' if o == b else 'inside '}"
                              f"its base model folder {base} (its tokenizer files would be overwritten); give "
                              "another output folder")


def export_peft(folder: Path, out: str | Path, dtype: str = "float32") -> dict[str, Any]:
    """Write OUT/{adapter_config.json, adapter_model.safetensors} from the LoRA folder ``folder``
    (``trainscale lora``'s output); the tensors checked against the base's projections first."""
    if dtype not in HF_DTYPES:
        raise TrainscaleError(f"PEFT export dtype must be one of {', '.join(HF_DTYPES)}, not {dtype!r}")
    if not (folder / "adapter.json").exists():
        raise TrainscaleError(f"--to peft exports a LoRA folder (trainscale lora's output); {folder} has no "
                              "adapter.json")
    cfg = read_adapter_config(folder)
    check_not_into_base(Path(out), Path(cfg.base))
    if cfg.base_bits:
        raise TrainscaleError(f"{folder} was trained on its base quantized to int{cfg.base_bits} (lora --base-bits); "
                              "peft would add it to the full-precision base, another model: merge it (lora --merge) "
                              "and export the merged folder --to hf")
    spec = read_spec(folder)
    check_llama(spec, "PEFT", allow_bias=not spec.is_moe)  # the base must export to HF for peft to load onto it
    check_mixtral(spec, "PEFT")
    hf.check_exportable(spec)
    try:
        targets = lora_targets(spec, cfg.targets)
    except ValueError as e:
        raise TrainscaleError(f"{folder / 'adapter.json'}: {e}") from None
    path = folder / ADAPTER_FILE
    check_header(path, read_header(path), _expected_shapes(spec, cfg.rank, targets), against="adapter.json")
    try:
        sd = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{path} is corrupt or unreadable: {str(e)[:200]}") from None
    check_finite(path, sd)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = peft_state_dict(sd, spec, HF_DTYPES[dtype])
    atomic_write(out / PEFT_WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    config = peft_config(spec, cfg.rank, cfg.alpha, targets, cfg.base)
    atomic_write_json(out / PEFT_CONFIG, config)
    if (folder / "tokenizer.json").exists():  # the base's tokenizer, chat template and end ids beside the adapter
        write_tokenizer_files(out, folder, read_chat_files(folder, load_tokenizer_for(folder)), spec.max_seq_len)
    return {"out": str(out), "source": str(folder), "base": cfg.base, "dtype": dtype, "tensors": len(tensors),
            "rank": cfg.rank, "alpha": cfg.alpha, "targets": list(targets), "target_modules": config["target_modules"],
            **safetensors_layout(out / PEFT_WEIGHTS)}
