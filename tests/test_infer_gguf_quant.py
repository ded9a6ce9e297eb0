"""quantize --to gguf: llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) on our f16 GGUF.

The oracle is llama.cpp: it writes the K-quant file, gguf-py reads its types back, llama.cpp loads it and computes
the perplexities. The model is trained a little (not random weights) with every row a multiple of 256 weights, so
the K-quant blocks are really used; a d_model = 128 model shows llama.cpp's fallbacks, named in the report.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
from infer_fixtures import cli_error, cli_json, train_small_model

from trainscale.estimate.inference import GGML_BLOCK, bits_per_weight, gguf_tensor_bytes, gguf_tensor_types
from trainscale.infer.gguf_quant import GGUF_QUANT_TYPES, GgufQuantSettings, default_prompt, quantize_gguf
from trainscale.specs import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")

# every matrix row a multiple of QK_K = 256: d_model 256, d_ff 768, 4 heads of 64 (K/V: 2 heads, 128 rows of 256)
KQ = {"name": "kquant-small", "n_layers": 2, "d_model": 256, "n_heads": 4, "n_kv_heads": 2, "d_ff": 768,
      "vocab_size": 512, "max_seq_len": 128}
TINY = load_model({"n_layers": 2, "d_model": 128, "n_heads": 2, "n_kv_heads": 1, "d_ff": 256, "vocab_size": 300,
                   "max_seq_len": 64})


@pytest.fixture(scope="module")
def kq_dir(tmp_path_factory):
    return train_small_model(tmp_path_factory.mktemp("kq") / "m", steps=150, spec_fields=KQ, batch=8, seq_len=128,
                             text_chars=200_000)


@pytest.fixture(scope="module")
def reports(kq_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kq-out")
    return {k: quantize_gguf(str(kq_dir), GgufQuantSettings(type=k, out=out / f"{k}.gguf", eval_tokens=4096,
                                                            max_new_tokens=8, threads=2)).report
            for k in GGUF_QUANT_TYPES}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(GGUF_QUANT_TYPES))
def test_kquant_types_size_and_perplexity(reports, kq_dir, kind):
    import llama_cpp

    from trainscale.infer.evaluate import eval_ids, perplexity
    from trainscale.infer.load import load_for_inference, load_tokenizer_for

    rep = reports[kind]
    ftype, base, const = GGUF_QUANT_TYPES[kind]
    assert rep["file_type"] == getattr(llama_cpp, const)  # general.file_type: llama.cpp's LLAMA_FTYPE_MOSTLY_*
    # the types llama.cpp chose are llama_tensor_get_type's mix as estimate/inference predicts it, the base type
    # on most matrices, no fallback (every row is whole super-blocks)
    model, spec, _ = load_for_inference(kq_dir)
    assert rep["tensor_types"] == gguf_tensor_types(spec, ftype) and rep["types_as_predicted"]
    assert rep["fallbacks"] == {}
    assert rep["type_counts"][base] >= 9
    # tensor bytes are the block layouts' (Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625, Q8_0 8.5 bpw) exactly; the file within 3 %
    assert rep["file"]["tensor_bytes"] == gguf_tensor_bytes(spec, ftype) and rep["file"]["tensor_bytes_equal"]
    assert abs(rep["file"]["file_bytes"] / gguf_tensor_bytes(spec, ftype) - 1) < 0.03
    assert bits_per_weight(base) <= rep["file"]["bits_per_weight"] < 8.6  # the F32 norms add a little
    # llama.cpp's f16 perplexity is trainscale's on the same ids and windows (f16-rounded weights, fp32 math)
    p = rep["perplexity"]
    tok = load_tokenizer_for(kq_dir)
    ids = eval_ids(tok, None, 4096)
    assert p["tokens"] == len(ids) == 4096 and p["scored"] == 4095 and p["by"] == "llama.cpp"
    ours = perplexity(model.half().float(), ids)
    assert abs(p["f16"] / ours - 1) < 1e-4, (p["f16"], ours)  # measured: 3e-6
    # the quantized perplexity within the published range of its type: at most llama.cpp's published ratio to f16
    # on Llama 3 8B (tools/perplexity/README.md; Q8_0 1.0004, Q6_K 1.0035, Q5_K_M 1.0091, Q4_K_M 1.0282). Measured
    # here (150 steps, perplexity ~51): Q8_0 1.00001, Q6_K 1.0005, Q5_K_M 1.0002, Q4_K_M 1.0031
    print(f"{kind}: {rep['file']['file_bytes']:,} B, {rep['file']['bits_per_weight']:.3f} bpw, ppl f16 {p['f16']:.3f}"
          f" {kind} {p[kind]:.3f} ({p['change_vs_f16']:+.3%}; published {rep['published']['ppl_ratio'] - 1:+.3%})")
    assert 1 - 1e-3 < p["ratio_vs_f16"] <= rep["published"]["ppl_ratio"]
    assert math.isclose(p["ratio_vs_f16"], p[kind] / p["f16"])
    assert rep["sample"]["prompt_default"] and rep["sample"]["prompt"] == default_prompt(tok, ids)


@pytest.mark.slow
def test_kquant_fewer_bits_cost_more(reports):
    """Q4_K_M, the fewest bits, moves the perplexity most and Q8_0 least (as in llama.cpp's table; Q6_K and Q5_K_M
    are within noise of each other on this model); the files grow with the bits."""
    change = {k: reports[k]["perplexity"]["ratio_vs_f16"] for k in GGUF_QUANT_TYPES}
    assert max(change, key=change.get) == "Q4_K_M" and min(change, key=change.get) == "Q8_0"
    sizes = [reports[k]["file"]["file_bytes"] for k in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """An untrained model folder whose rows (d_model 128) are no whole 256-weight super-block; d_ff 256."""
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model

    d = tmp_path_factory.mktemp("tiny")
    tok = train_bpe([corpus_text("train", max_chars=20000)], 300)
    tok.save(str(d / "tok.json"))
    return save_model_dir(d / "m", build_model(TINY, seed=3).state_dict(), TINY, d / "tok.json")


@pytest.mark.slow
def test_rows_not_whole_super_blocks_fall_back_as_llama_cpp_does(tiny_dir, tmp_path):
    """d_model 128: a row of 128 weights is no whole 256-weight super-block, so llama.cpp's tensor_type_fallback
    writes Q4_K's matrices as Q5_0 and Q6_K's as Q8_0; ffn_down's rows (d_ff = 256) are one super-block and stay
    K-quants (Q6_K in layer 1, a use_more_bits layer). The estimator predicts exactly those types and bytes, and the
    report names every tensor whose rows are not whole super-blocks."""
    spec = TINY
    rep = quantize_gguf(str(tiny_dir), GgufQuantSettings(out=tmp_path / "m.gguf", eval_tokens=0,
                                                               max_new_tokens=0, prompt="x", threads=1)).report
    types = rep["tensor_types"]
    assert types == gguf_tensor_types(spec, "q4_k_m")
    assert "must be a .gguf file" in cli_error("quantize", str(tiny_dir), "--to", "gguf", "--out",
                                               str(tmp_path / "x.bin"))
    assert types["blk.0.ffn_up.weight"] == types["blk.0.attn_v.weight"] == "Q5_0"  # Q4_K's fallback
    assert types["blk.1.attn_v.weight"] == types["output.weight"] == "Q8_0"  # Q6_K's (the mix's choice there)
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert rep["file"]["tensor_bytes"] == gguf_tensor_bytes(spec, "q4_k_m")
    assert set(rep["fallbacks"]) == {n for n, t in types.items() if t != "F32" and "ffn_down" not in n}
    assert GGML_BLOCK["Q5_0"] == (22, 32)


def test_bad_type_and_target_are_one_sentence(tmp_path):
    """Refused before any folder is read."""
    assert "--type must be one of Q4_K_M, Q5_K_M, Q6_K, Q8_0" in cli_error(
        "quantize", str(tmp_path), "--to", "gguf", "--type", "Q2_K")
    assert "--to must be gguf" in cli_error("quantize", str(tmp_path), "--to", "hf")


@pytest.mark.slow
def test_cli_quantize_to_gguf(kq_dir, tmp_path):
    got = cli_json("quantize", str(kq_dir), "--to", "gguf", "--type", "q6_k", "--out", str(tmp_path / "m.gguf"),
                   "--eval-tokens", "1024", "--max-new-tokens", "4", "--threads", "2")
    assert got["type"] == "Q6_K" and got["type_counts"]["Q6_K"] >= 9 and got["file"]["tensor_bytes_equal"]
    assert got["perplexity"]["tokens"] == 1024 and got["perplexity"]["Q6_K"] > 1


@pytest.mark.slow
def test_quantize_prompt_defaults_to_the_start_of_the_held_out_text(tiny_dir, tmp_path):
    """No silent trap: without --prompt, `quantize` samples from the start of the model's own held-out text (here
    the held-out plays, the default for a folder not from a run), cut at a line or word end, not a fixed line."""
    from trainscale.infer.evaluate import evaluation_text
    from trainscale.infer.load import load_tokenizer_for
    from trainscale.infer.quantize_check import QuantSettings, quantize_and_check

    rep = quantize_and_check(str(tiny_dir), QuantSettings(format="int8", out=tmp_path / "q", eval_tokens=0,
                                                          max_new_tokens=2)).report
    tok = load_tokenizer_for(tiny_dir)
    held = evaluation_text(tiny_dir, tok, max_tokens=64, default_plays=True)
    assert rep["sample"]["prompt_default"] and rep["sample"]["prompt"] == default_prompt(tok, held.ids)
    assert tok.decode(held.ids).startswith(rep["sample"]["prompt"]) and len(rep["sample"]["prompt"]) > 10
    given = quantize_and_check(str(tiny_dir), QuantSettings(format="int8", out=tmp_path / "q2", eval_tokens=0,
                                                            max_new_tokens=2, prompt="To be")).report
    assert given["sample"]["prompt"] == "To be" and not given["sample"]["prompt_default"]


@pytest.mark.slow
def test_a_model_with_a_long_window_is_scored_and_sampled_within_what_its_text_needs(tmp_path):
    """The Llama-3.2-shaped folder of `make demo` has a 131,072-token window: llama.cpp's context is sized by the
    evaluation's longest window and the sample, not by the model's window (a KV cache of 128K positions failed to be
    made: 'Failed to create llama_context'). Its perplexity equals trainscale's own on the same ids."""
    import subprocess
    import sys
    from pathlib import Path

    from trainscale.infer.evaluate import evaluation_text, perplexity
    from trainscale.infer.load import load_for_inference, load_tokenizer_for

    root = Path(__file__).resolve().parents[1]

    folder = tmp_path / "llama32"
    subprocess.run([sys.executable, str(root / "scripts" / "tiny_llama32.py"), str(folder), "--chat",
                    str(root / "examples" / "chat.jsonl")], check=True, capture_output=True)
    rep = quantize_gguf(str(folder), GgufQuantSettings(out=tmp_path / "m.gguf", eval_tokens=300, max_new_tokens=4,
                                                       threads=1)).report
    model, spec, _ = load_for_inference(str(folder))
    assert spec.max_seq_len == 131072 and rep["perplexity"]["tokens"] <= 300 and rep["sample"]["completion"] != ""
    tok = load_tokenizer_for(folder)
    ids = evaluation_text(folder, tok, max_tokens=300, default_plays=True).ids[:300]
    assert rep["perplexity"]["f16"] == pytest.approx(perplexity(model, ids), rel=2e-3)  # f16 weights vs fp32


def test_the_default_prompt_leaves_room_for_the_tokens_to_generate():
    """A 64-token model asked for 48 new tokens gets a prompt of at most 16 (make demo's quantize sample did not fit
    with the 24-token default); without ``room`` the first 24 tokens, cut at a line or word end."""
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    text = corpus_text("val", max_chars=20000)
    tok = train_bpe([text], 300)
    ids = tok.encode(text).ids
    for room in (16, 5, 1):
        got = default_prompt(tok, ids, room=room)
        assert got and len(tok.encode(got).ids) <= room and text.startswith(got)
    free = default_prompt(tok, ids)
    assert text.startswith(free) and len(tok.encode(free).ids) <= 24
