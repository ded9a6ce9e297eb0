"""Group-wise weight quantization to int8 / int4, trainscale's own file format.

Every 2-D weight matrix (embeddings and output head included) is split along its rows into groups
of ``group_size`` consecutive weights; each group gets its own fp16 scale (Frantar et al. 2022,
GPTQ; Dettmers et al. 2023, QLoRA Sec. 2 — the grouping, not their rounding algorithms: this is
plain round-to-nearest). 1-D tensors (norms, biases) stay bf16.

- symmetric int8: q = round(w / s), s = max|w| / 127, q in [-127, 127] stored as int8.
- symmetric int4: ggml's Q4_0 rule (ggml-quants.c quantize_row_q4_0_ref): s = m / -8 with m the
  group's largest-magnitude weight, q = round(w / s) + 8 clipped to [0, 15], so all 16 levels are used.
- asymmetric (both widths): s = (max - min) / (2^bits - 1), offset = min (fp16, one per group, as in
  ggml's Q4_1), q = round((w - offset) / s) in [0, 2^bits - 1], stored unsigned.
- int4 codes are packed two per byte: low nibble = even column, high nibble = odd column.
- a row whose length is not a multiple of the group size ends in a shorter group (its own scale).

Scales (and offsets) are rounded to fp16 before the codes are computed, so dequantizing with the
stored fp16 values reproduces exactly what was optimised. The file is a safetensors file
(``quantized.safetensors``) next to model.json and tokenizer.json; its tensor bytes equal
``estimate.inference.quantized_model_bytes`` exactly.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from trainscale.errors import TrainscaleError
from trainscale.runtime.model import build_model
from trainscale.safeio import atomic_write, atomic_write_bytes, atomic_write_json

QUANT_FILE = "quantized.safetensors"
FORMATS = {"int8": 8, "int4": 4, "bf16": 16}
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantConfig:
    fmt: str
    group_size: int = 32
    asymmetric: bool = False

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt]

    @property
    def scheme(self) -> str:
        return "asymmetric" if self.asymmetric else "symmetric"

    def check(self) -> QuantConfig:
        if self.fmt not in FORMATS:
            raise TrainscaleError(f"quantization format must be int8 or int4 (or bf16), not {self.fmt!r}")
        if self.group_size not in GROUP_SIZES:
            raise TrainscaleError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                                  f"not {self.group_size}")
        return self


# ------------------------------------------------------------------------------------- one matrix


def _groups(cols: int, g: int) -> tuple[int, int]:
    """(groups per row, padding): a row's last group may be short (ceil(cols / g) scales per row)."""
    n = math.ceil(cols / g)
    return n, n * g - cols


def quantize_matrix(w: torch.Tensor, cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """[rows, cols] float matrix -> {"qweight", "scales"(, "offsets")}, one scale per group of a row.

    A row whose length is not a multiple of the group size ends in a short group; it is padded for the
    arithmetic by repeating its last weight (which leaves the group's max |w|, min and max unchanged),
    and only the real columns are stored."""
    rows, cols = w.shape
    g = cfg.group_size
    if cfg.bits == 4 and cols % 2:
        raise TrainscaleError(f"int4 packs two weights per byte; a row of {cols} weights is odd")
    ng, pad = _groups(cols, g)
    x = w.detach().float()
    if pad:
        x = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1)
    x = x.reshape(rows, ng, g)
    levels = 2 ** cfg.bits - 1
    if cfg.asymmetric:
        lo, hi = x.amin(-1), x.amax(-1)
        offset = lo.half().float()
        scale = ((hi - offset) / levels).half().float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round((x - offset[..., None]) * inv[..., None]).clamp_(0, levels).to(torch.uint8)
        out = {"scales": scale.half(), "offsets": offset.half()}
    elif cfg.bits == 8:
        scale = (x.abs().amax(-1) / 127).half().float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(x * inv[..., None]).clamp_(-127, 127).to(torch.int8)
        out = {"scales": scale.half()}
    else:  # symmetric int4, Q4_0's signed-max rule
        idx = x.abs().argmax(-1, keepdim=True)
        m = torch.gather(x, -1, idx).squeeze(-1)
        scale = (m / -8).half().float()
        inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        q = (torch.round(x * inv[..., None]) + 8).clamp_(0, 15).to(torch.uint8)
        out = {"scales": scale.half()}
    q = q.reshape(rows, ng * g)[:, :cols]
    if cfg.bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    out["qweight"] = q.contiguous()
    return out


def dequantize_matrix(parts: dict[str, torch.Tensor], cfg: QuantConfig, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of quantize_matrix, in fp32."""
    rows, cols = shape
    g = cfg.group_size
    ng, pad = _groups(cols, g)
    q = parts["qweight"]
    if cfg.bits == 4:
        q = torch.stack((q & 0x0F, q >> 4), dim=-1).reshape(rows, cols)
    x = q.float()
    if pad:
        x = torch.cat([x, x.new_zeros(rows, pad)], dim=1)
    x = x.reshape(rows, ng, g)
    scale = parts["scales"].float()[..., None]
    if cfg.asymmetric:
        w = x * scale + parts["offsets"].float()[..., None]
    elif cfg.bits == 8:
        w = x * scale
    else:
        w = (x - 8) * scale
    return w.reshape(rows, ng * g)[:, :cols].contiguous()


# ------------------------------------------------------------------------------------- a model


def quantize_state_dict(sd: dict[str, torch.Tensor], cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """Every matrix -> NAME.qweight / NAME.scales (/ NAME.offsets); 1-D tensors -> NAME in bf16. A MoE's stacked
    experts [E, rows, cols] are E matrices, quantized as the [E * rows, cols] matrix of their rows (groups run
    along each row, so no group spans two experts)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if t.ndim >= 2 and cfg.fmt != "bf16":
            for part, v in quantize_matrix(t.reshape(-1, t.shape[-1]), cfg).items():
                out[f"{name}.{part}"] = v
        else:
            out[name] = t.detach().to(torch.bfloat16).contiguous()
    return out


def dequantize_state_dict(qsd: dict[str, torch.Tensor], cfg: QuantConfig,
                          shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name in qsd:
            out[name] = qsd[name].float()
        else:
            parts = {p: qsd[f"{name}.{p}"] for p in ("qweight", "scales", "offsets") if f"{name}.{p}" in qsd}
            rows = math.prod(shape[:-1])
            out[name] = dequantize_matrix(parts, cfg, (rows, shape[-1])).reshape(shape)
    return out


def weight_error(original: dict[str, torch.Tensor], restored: dict[str, torch.Tensor]) -> dict[str, float]:
    """Over all matrices (a MoE's stacked experts included): relative Frobenius error ||W - W'|| / ||W||, and
    the largest |W - W'|."""
    num = den = 0.0
    worst = 0.0
    for name, w in original.items():
        if w.ndim < 2:
            continue
        d = w.float() - restored[name].float()
        num += float(d.pow(2).sum())
        den += float(w.float().pow(2).sum())
        worst = max(worst, float(d.abs().max()))
    return {"relative_frobenius": math.sqrt(num / den) if den else 0.0, "max_abs": worst}


# ------------------------------------------------------------------------------------- a frozen base in memory


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` held as its group-quantized codes and fp16 scales (``quantize_matrix``: buffers, no
    parameters), dequantized to fp32 in each forward: QLoRA's base (Dettmers et al. 2023, arXiv 2305.14314, Sec. 3:
    a frozen quantized base, adapters in higher precision on top, the weight dequantized for the matmul), with
    trainscale's round-to-nearest int4 / int8 groups instead of NF4 and double quantization."""

    def __init__(self, linear: nn.Linear, cfg: QuantConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_features, self.out_features = linear.in_features, linear.out_features
        for name, t in quantize_matrix(linear.weight.detach(), cfg).items():
            self.register_buffer(name, t)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def parts(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.named_buffers() if k in ("qweight", "scales", "offsets")}

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in fp32, as the codes and scales give it."""
        return dequantize_matrix(self.parts(), self.cfg, (self.out_features, self.in_features))

    def nbytes(self) -> int:
        """Bytes of the codes and scales (offsets) held: what this layer's weight costs in memory."""
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (and the bias)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            out.weight.copy_(self.dequantized())
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out.requires_grad_(False)


def quantize_linears(model, cfg: QuantConfig, modules) -> dict[str, int]:
    """Replace each (path, parent, attribute) of ``modules`` (an ``nn.Linear``) by its ``QuantizedLinear``;
    -> {"weights": quantized weights, "bytes": bytes held, "bf16_bytes": those weights in bf16}."""
    cfg.check()
    if cfg.fmt == "bf16":
        raise TrainscaleError("a quantized base is int8 or int4")
    weights = held = 0
    for _, parent, attr in modules:
        lin = getattr(parent, attr)
        q = QuantizedLinear(lin, cfg)
        setattr(parent, attr, q)
        weights += lin.weight.numel()
        held += q.nbytes()
    return {"weights": weights, "bytes": held, "bf16_bytes": 2 * weights}


# ------------------------------------------------------------------------------------- files


def safetensors_layout(path: str | Path) -> dict[str, int]:
    """Bytes of a safetensors file: 8-byte length prefix + JSON header + tensor data (read from disk)."""
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return {"file_bytes": size, "header_bytes": 8 + header_len, "tensor_bytes": size - 8 - header_len}


@dataclass
class QuantResult:
    spec: Any
    source: Path
    path: Path
    original: dict[str, torch.Tensor]
    restored: dict[str, torch.Tensor]


def save_quantized(model, spec, src: Path, out: str | Path, cfg: QuantConfig) -> QuantResult:
    """Quantize ``model`` (``spec``), loaded from the folder ``src`` (infer/load.py: ``save_quantized(
    *load_for_inference(folder), out, cfg)``), into OUT (quantized.safetensors + model.json + tokenizer.json)."""
    cfg.check()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    qsd = quantize_state_dict(sd, cfg)
    out = Path(out)
    if out.resolve() == src.resolve():
        raise TrainscaleError(f"the quantized model cannot overwrite its source folder {src}; pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"producer": "trainscale", "format": cfg.fmt, "bits": str(cfg.bits), "group_size": str(cfg.group_size),
            "scheme": cfg.scheme}
    atomic_write(out / QUANT_FILE, lambda tmp: save_file(qsd, str(tmp), metadata=meta))
    atomic_write_json(out / "model.json", spec.model_dump(by_alias=True, exclude_none=True))
    if (src / "tokenizer.json").exists():
        atomic_write_bytes(out / "tokenizer.json", (src / "tokenizer.json").read_bytes())
    restored = dequantize_state_dict(qsd, cfg, {k: tuple(v.shape) for k, v in sd.items()})
    return QuantResult(spec, src, out / QUANT_FILE, sd, restored)


def model_from_state_dict(spec, sd: dict[str, torch.Tensor]):
    """A Transformer in eval mode holding ``sd`` (fp32)."""
    model = build_model(spec, "meta")
    model.load_state_dict({k: v.float() for k, v in sd.items()}, assign=True)
    return model.eval()


def read_quant_config(path: str | Path) -> QuantConfig:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise TrainscaleError(f"{path} is corrupt or unreadable: {e}") from None
    try:
        return QuantConfig(meta["format"], int(meta["group_size"]), meta["scheme"] == "asymmetric").check()
    except (KeyError, ValueError):
        raise TrainscaleError(f"{path} lacks trainscale's quantization metadata (format, group_size, scheme)") from None
