"""Group-wise quantization: exact codes, packed storage, file bytes equal to the estimator, perplexity."""

from __future__ import annotations

import pytest
import torch
from infer_fixtures import small_model_dir  # noqa: F401  (session fixture)

from trainscale.errors import TrainscaleError
from trainscale.estimate.inference import quantized_model_bytes
from trainscale.infer.load import load_for_inference
from trainscale.infer.quantize import (
    QuantConfig,
    dequantize_matrix,
    dequantize_state_dict,
    quantize_matrix,
    quantize_state_dict,
    safetensors_layout,
    save_quantized,
    weight_error,
)
from trainscale.specs import load_model


def test_int4_symmetric_codes_follow_q4_0():
    # one group of 32: largest magnitude is -1.6, so scale = -1.6 / -8 = 0.2 and q = round(w / 0.2) + 8
    w = torch.zeros(1, 32)
    w[0, :5] = torch.tensor([-1.6, 0.2, 0.41, 1.4, 0.0])
    parts = quantize_matrix(w, QuantConfig("int4", 32))
    assert parts["scales"].dtype == torch.float16 and parts["scales"].shape == (1, 1)
    assert float(parts["scales"]) == pytest.approx(0.2, rel=1e-3)
    assert parts["qweight"].dtype == torch.uint8 and parts["qweight"].shape == (1, 16)  # two codes per byte
    codes = torch.stack((parts["qweight"] & 15, parts["qweight"] >> 4), -1).flatten()
    assert codes[:5].tolist() == [0, 9, 10, 15, 8]
    assert parts["qweight"][0, 0] == 0 | (9 << 4)  # low nibble = even column
    back = dequantize_matrix(parts, QuantConfig("int4", 32), (1, 32))
    assert back[0, :5].tolist() == pytest.approx([-1.6, 0.2, 0.4, 1.4, 0.0], abs=1e-3)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_round_trip_error_is_bounded_by_the_step(fmt, asym, g):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    w[:, :3] += 2.0  # shifted groups: where the asymmetric offset matters
    cfg = QuantConfig(fmt, g, asym)
    parts = quantize_matrix(w, cfg)
    assert parts["scales"].shape == (8, 256 // g)
    assert ("offsets" in parts) == asym
    assert parts["qweight"].numel() == 8 * 256 * cfg.bits // 8
    err = (dequantize_matrix(parts, cfg, (8, 256)) - w).abs().reshape(8, -1, g)
    step = parts["scales"].float().abs()[..., None]
    # round-to-nearest: half a step; Q4_0's signed-max rule reaches -8 steps but only +7, so the side
    # opposite the largest weight can clip by up to one step
    bound = 1.0 if (fmt, asym) == ("int4", False) else 0.5
    assert bool((err <= step * bound * 1.01 + 1e-4).all())


def test_bad_group_size_and_format():
    with pytest.raises(TrainscaleError, match="group size"):
        QuantConfig("int4", 48).check()
    with pytest.raises(TrainscaleError, match="int8 or int4"):
        QuantConfig("int3", 32).check()
    with pytest.raises(TrainscaleError, match="odd"):
        quantize_matrix(torch.randn(4, 95), QuantConfig("int4", 32))


@pytest.mark.parametrize("fmt,asym", [("int8", False), ("int4", False), ("int4", True)])
def test_short_last_group(fmt, asym):
    # rows of 688 (configs/small.toml's d_ff) in groups of 32: 21 full groups and one of 16
    w = torch.randn(3, 688, generator=torch.Generator().manual_seed(2))
    w[:, -16:] += 3.0
    cfg = QuantConfig(fmt, 32, asym)
    parts = quantize_matrix(w, cfg)
    assert parts["scales"].shape == (3, 22)
    assert parts["qweight"].numel() == 3 * 688 * cfg.bits // 8
    back = dequantize_matrix(parts, cfg, (3, 688))
    last = parts["scales"][:, -1].float().abs()
    bound = 1.0 if (fmt, asym) == ("int4", False) else 0.5
    assert bool(((back - w)[:, -16:].abs() <= last[:, None] * bound * 1.01 + 1e-4).all())
    spec = load_model({"n_layers": 1, "d_model": 64, "n_heads": 2, "n_kv_heads": 2, "d_ff": 688, "vocab_size": 50,
                       "max_seq_len": 16})
    from trainscale.runtime.model import build_model

    qsd = quantize_state_dict(build_model(spec).state_dict(), cfg)
    assert sum(t.numel() * t.element_size() for t in qsd.values()) == quantized_model_bytes(spec, fmt, 32, asym)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,g,asym", [("int8", 32, False), ("int8", 128, True), ("int4", 32, False),
                                         ("int4", 64, True), ("int4", 128, False)])
def test_file_tensor_bytes_equal_estimator(small_model_dir, tmp_path, fmt, g, asym):  # noqa: F811
    res = save_quantized(*load_for_inference(small_model_dir), tmp_path / "q", QuantConfig(fmt, g, asym))
    layout = safetensors_layout(res.path)
    assert layout["tensor_bytes"] == quantized_model_bytes(res.spec, fmt, g, asym)
    assert layout["file_bytes"] == layout["header_bytes"] + layout["tensor_bytes"]
    assert res.path.stat().st_size == layout["file_bytes"]


@pytest.mark.slow
def test_int4_g32_perplexity_within_a_few_percent_of_bf16(small_model_dir, tmp_path):  # noqa: F811
    from trainscale.infer.evaluate import eval_ids, perplexity
    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.load import load_tokenizer_for
    from trainscale.infer.quantize import model_from_state_dict

    res = save_quantized(*load_for_inference(small_model_dir), tmp_path / "q4", QuantConfig("int4", 32))
    tok = load_tokenizer_for(res.source)
    ids = eval_ids(tok, max_tokens=8192)
    bf16 = perplexity(model_from_state_dict(res.spec, {k: v.bfloat16() for k, v in res.original.items()}), ids)
    q4, _, _ = load_for_inference(tmp_path / "q4")  # from the file on disk
    ppl4 = perplexity(q4, ids)
    assert ppl4 / bf16 - 1 < 0.03
    g = generate_ids(q4, tok.encode("ROMEO:").ids, 16, Sampling(0.8, seed=0))
    assert len(g.new_ids) == 16 and tok.decode(g.new_ids)


@pytest.mark.slow
def test_quantized_folder_errors(small_model_dir, tmp_path):  # noqa: F811
    res = save_quantized(*load_for_inference(small_model_dir), tmp_path / "q", QuantConfig("int8", 64))
    res.path.write_bytes(res.path.read_bytes()[:1000])
    with pytest.raises(TrainscaleError, match="corrupt"):
        load_for_inference(tmp_path / "q")
    with pytest.raises(TrainscaleError, match="overwrite"):
        save_quantized(*load_for_inference(small_model_dir), small_model_dir, QuantConfig("int8", 64))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_moe_experts_are_quantized_per_expert_and_counted(fmt):
    """A MoE's stacked experts [E, rows, cols] are quantized as E matrices (groups along each row, none spanning
    two experts); the bytes equal the estimator's and every restored tensor keeps its shape."""
    from trainscale.runtime.config import load_config
    from trainscale.runtime.model import build_model

    spec = load_config("configs/moe-tiny.toml").model
    sd = build_model(spec, "cpu", seed=0).state_dict()
    cfg = QuantConfig(fmt, 32)
    qsd = quantize_state_dict(sd, cfg)
    assert "layers.1.moe.experts.w1.qweight" in qsd and "layers.1.moe.experts.w1" not in qsd
    assert sum(v.numel() * v.element_size() for v in qsd.values()) == quantized_model_bytes(spec, fmt, 32)
    back = dequantize_state_dict(qsd, cfg, {k: tuple(v.shape) for k, v in sd.items()})
    assert all(back[k].shape == v.shape for k, v in sd.items())
    # expert 3's restored rows are expert 3's: each within half a step (int8: absmax / 127) of its group's value,
    # or, int4 as Q4_0 (scale = the signed extreme / -8, codes -8..7), one step of absmax / 8 on the clipped side
    w, r = sd["layers.1.moe.experts.w2"], back["layers.1.moe.experts.w2"]
    absmax = w[3].reshape(w.shape[1], -1, 32).abs().amax(-1, keepdim=True)
    bound = absmax / 127 * 0.51 if fmt == "int8" else absmax / 8 * 1.01
    assert ((w[3] - r[3]).reshape(w.shape[1], -1, 32).abs() <= bound + 1e-6).all()
    assert weight_error(sd, back)["relative_frobenius"] < (0.01 if fmt == "int8" else 0.15)
