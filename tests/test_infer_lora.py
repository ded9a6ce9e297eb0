"""LoRA: only the adapters train; trainable params and Adam bytes equal estimate/lora.py; merge is exact."""

from __future__ import annotations

import pytest
import torch
from infer_fixtures import small_model_dir  # noqa: F401  (session fixture)

from trainscale.errors import TrainscaleError
from trainscale.estimate.lora import lora_optimizer_bytes, lora_targets, lora_trainable_params
from trainscale.infer.lora import apply_lora, merge_lora, save_adapter_folder, train_lora, trainable_params
from trainscale.runtime.model import build_model
from trainscale.specs import load_model

SPEC = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 160, "vocab_size": 101, "max_seq_len": 64}


def test_estimator_counts_by_hand():
    spec = load_model(SPEC)  # q 64, kv 32, d_ff 160
    # per layer, r = 4: wq 4(64+64) + wk 4(64+32) + wv 4(64+32) + wo 4(64+64) = 1792; MLP 3 x 4(64+160) = 2688
    assert lora_trainable_params(spec, 4, "attn") == 2 * 1792
    assert lora_trainable_params(spec, 4, "mlp") == 2 * 2688
    assert lora_trainable_params(spec, 4, "all") == 2 * (1792 + 2688)
    assert lora_optimizer_bytes(spec, 4, "all") == 8 * 2 * (1792 + 2688)
    assert lora_optimizer_bytes(spec, 4, "all", mixed_precision=True) == 12 * 2 * (1792 + 2688)
    assert lora_targets(load_model({**SPEC, "mlp": "gelu"}), "mlp") == ("w1", "w2")
    with pytest.raises(ValueError, match="not one of"):
        lora_targets(spec, "wx")


@pytest.mark.parametrize("targets,rank", [("all", 4), ("attn", 8), ("mlp", 2), ("wq,wv", 16)])
def test_measured_params_and_adam_bytes_equal_estimator(targets, rank):
    spec = load_model(SPEC)
    model = build_model(spec, seed=0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    names = lora_targets(spec, targets)
    x = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model.eval()(x)
    apply_lora(model, rank, 2.0 * rank, names)
    with torch.no_grad():
        assert torch.equal(model(x), before)  # B starts at zero: the adapted model starts as the base
    ids = torch.randint(0, spec.vocab_size, (2000,), generator=torch.Generator().manual_seed(1)).tolist()
    res = train_lora(model, ids, steps=5, batch=4, seq_len=32, lr=1e-2)
    assert res["trainable_params"] == trainable_params(model) == lora_trainable_params(spec, rank, names)
    assert res["optimizer_bytes"]["moments"] == lora_optimizer_bytes(spec, rank, names)
    for name, p in model.named_parameters():  # the base weights did not move and have no gradient
        if ".lora_" not in name:
            assert not p.requires_grad and p.grad is None
            assert torch.equal(p, base[name.replace(".base.", ".")])
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)(x)
    assert not torch.equal(adapted, before)
    assert set(model.state_dict()) == set(base)  # merged names are the base model's again
    assert torch.allclose(merged, adapted, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_on_the_small_model_learns_and_round_trips(small_model_dir, tmp_path):  # noqa: F811
    from trainscale.infer.evaluate import perplexity
    from trainscale.infer.load import load_for_inference, load_tokenizer_for
    from trainscale.infer.lora import read_data

    model, spec, folder = load_for_inference(small_model_dir)
    tok = load_tokenizer_for(folder)
    text = "\n".join(["FIRST CITIZEN.\nBefore we proceed any further, hear me speak."] * 40)
    (tmp_path / "data.txt").write_text(text)
    ids = read_data(str(tmp_path / "data.txt"), tok)
    ppl0 = perplexity(model, ids, 64)
    apply_lora(model, 4, 8.0, lora_targets(spec, "all"))
    res = train_lora(model, ids, steps=30, batch=4, seq_len=64, lr=3e-3)
    assert res["losses"][-1] < res["losses"][0] - 0.5
    assert perplexity(model, ids, 64) < ppl0 / 2
    save_adapter_folder(tmp_path / "ad", model, spec, folder, {"rank": 4, "alpha": 8.0, "targets": ["all"]})
    x = torch.tensor([ids[:50]])
    with torch.no_grad():
        adapted = model(x)
    from trainscale.runtime.artifact import read_spec

    assert read_spec(tmp_path / "ad") == spec
    loaded, _, _ = load_for_inference(tmp_path / "ad")  # base + adapters, folded in on load
    with torch.no_grad():
        assert torch.allclose(loaded(x), adapted, atol=1e-4, rtol=0)
    with pytest.raises(TrainscaleError, match="rank"):
        apply_lora(build_model(spec), 0, 1.0, ("wq",))


def test_lora_on_a_mixture_of_experts_adapts_attention_and_merges():
    """A MoE's routed experts are stacked tensors, not nn.Linear: LoRA adapts its attention (and says so when
    asked for the MLP); merging folds the adapters into the attention weights and leaves the logits."""
    from trainscale.runtime.config import load_config

    spec = load_config("configs/moe-tiny.toml").model
    with pytest.raises(ValueError, match="attention projections only"):
        lora_targets(spec, "all")
    model = build_model(spec, "cpu", seed=0)
    paths = apply_lora(model, 4, 8.0, lora_targets(spec, "attn"), seed=1)
    assert len(paths) == 4 * spec.n_layers and trainable_params(model) == lora_trainable_params(spec, 4, "attn")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b" in name:
                p.normal_()  # a non-zero update (B starts at zero)
    x = torch.randint(0, spec.vocab_size, (2, 16))
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)(x)
    assert not any(".lora_" in k for k in model.state_dict())
    assert torch.allclose(adapted, merged, atol=1e-5)


def test_lora_data_reads_documents_as_train_does(tmp_path):
    """``lora --data`` goes through runtime/data/sources.py: a JSONL file's documents are its text fields, a
    Parquet file's its column, a text file's its paragraphs; each document's tokens, then the end-of-text token."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainscale.infer.lora import read_data
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe

    docs = [p.strip("\n") for p in corpus_text("train", max_chars=20_000).split("\n\n") if p.strip()]
    tok = train_bpe(docs, 300)
    eot = tok.token_to_id("<|endoftext|>")
    (tmp_path / "a.txt").write_text("\n\n".join(docs) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"body": docs}), tmp_path / "a.parquet", row_group_size=7)
    expected = [i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, eot]]
    assert read_data(str(tmp_path / "a.txt"), tok) == expected
    assert read_data(str(tmp_path / "a.jsonl"), tok, text_field="body") == expected
    assert read_data(str(tmp_path / "a.parquet"), tok, text_field="body") == expected
    assert len(expected) > 1000 and "{" not in tok.decode(expected)  # no JSON syntax trained on
    with pytest.raises(TrainscaleError, match="has no 'text' field"):
        read_data(str(tmp_path / "a.jsonl"), tok)
    with pytest.raises(TrainscaleError, match="has no column 'text'"):
        read_data(str(tmp_path / "a.parquet"), tok)


@pytest.mark.slow
def test_lora_holds_out_the_documents_the_trainer_would(small_model_dir, tmp_path):  # noqa: F811
    """``lora --held-out 0.1`` holds out the documents the trainer's prepare (runtime/data/shards.py, [data]
    held_out = 0.1, the same tokenizer) writes to val.npy, token for token, and says so; training lowers the
    held-out perplexity; ``evaluate`` of the adapter folder, with no --data, measures that same held-out text
    (adapter.json records it) to the same perplexity."""
    import json

    from typer.testing import CliRunner

    from trainscale.cli import app
    from trainscale.runtime.config import config_from_dict
    from trainscale.runtime.data.corpus import corpus_for
    from trainscale.runtime.data.sources import corpus_text

    paras = [p for p in corpus_text("val", max_chars=60_000).split("\n\n") if p.strip()]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"body": p}) + "\n" for p in paras))

    def cli(*args):
        res = CliRunner().invoke(app, [*args, "--json"])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    rep = cli("lora", str(small_model_dir), "--data", str(data), "--text-field", "body", "--held-out", "0.1",
              "--steps", "25", "--batch", "4", "--seq-len", "64", "--lr", "3e-3", "--out", str(tmp_path / "ad"))
    held = rep["held_out"]
    assert 0 < held["documents"] < held["of_documents"] == len(paras)
    assert f"the held-out documents ({held['documents']:,} of {len(paras):,}" in held["text"]
    assert held["perplexity_after"] < held["perplexity_before"]

    cfg = config_from_dict({"name": "same-rule", "model": json.loads((small_model_dir / "model.json").read_text()),
                            "train": {"seq_len": 64},
                            "data": {"files": [str(data)], "text_field": "body", "held_out": 0.1, "workers": 1,
                                     "tokenizer": str(small_model_dir / "tokenizer.json"),
                                     "prepared": str(tmp_path / "prepared")}})
    stream = corpus_for(cfg).tokens("val")
    assert held["tokens"] == len(stream) and rep["train_tokens"] == len(corpus_for(cfg).tokens("train"))

    ev = cli("evaluate", str(tmp_path / "ad"), "--seq-len", "64")
    assert ev["text_kind"] == "adapter-data" and ev["tokens"] == held["tokens"] and ev["split"] == "held-out"
    assert ev["perplexity"] == pytest.approx(held["perplexity_after"], rel=1e-4)


def test_lora_loss_counts_only_the_targets_it_is_given():
    """lora_loss: the summed cross-entropy of the targets that are not -100, and their count; with none masked, the
    trainer's lm_loss times the token count."""
    from trainscale.infer.lora import IGNORE, lora_loss
    from trainscale.runtime.model import lm_loss

    spec = load_model(SPEC)
    model = build_model(spec, seed=0).eval()
    x = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, n = lora_loss(model, x[:, :-1], x[:, 1:])
        assert n == 32 and float(full) / n == pytest.approx(float(lm_loss(model(x[:, :-1]), x[:, 1:])), rel=1e-6)
        t = x[:, 1:].clone()
        t[0, :5] = IGNORE
        part, m = lora_loss(model, x[:, :-1], t)
        per_token = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(),
                                                      reduction="none")
    assert m == 27 and float(part) == pytest.approx(float(per_token.sum() - per_token[:5].sum()), rel=1e-5)


def test_quantized_base_holds_int4_groups_and_the_adapters_fold_into_it(tmp_path):
    """QLoRA's base: every layer projection a QuantizedLinear (codes + fp16 scales, no parameters), whose bytes are
    (1/2 + 2/64) per weight for int4 in groups of 64 (0.265625 of bf16) and (1 + 2/64) for int8; its forward is
    F.linear with the dequantized weight; adapters on it train, merge into the dequantized weight, and an adapter
    folder that records base_bits loads (base quantized again, adapters folded) to the same logits."""
    from trainscale.infer.lora import quantize_base
    from trainscale.infer.quantize import QuantizedLinear, dequantize_matrix

    spec = load_model({**SPEC, "d_ff": 192})  # every row a whole number of groups of 64
    weights = 2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 192 * 64)  # wq wk wv wo, w1 w2 w3; 2 layers
    for bits, per_weight in ((4, 0.5 + 2 / 64), (8, 1 + 2 / 64)):
        model = build_model(spec, seed=0)
        w1 = model.layers["0"].feed_forward.w1.weight.detach().clone()
        got = quantize_base(model, bits, 64)
        assert got["weights"] == weights and got["bytes"] == weights * per_weight
        assert got["bytes"] / got["bf16_bytes"] == per_weight / 2  # int4: 0.265625, int8: 0.515625
        q = model.layers["0"].feed_forward.w1
        assert isinstance(q, QuantizedLinear) and not list(q.parameters())
        assert q.qweight.dtype == (torch.uint8 if bits == 4 else torch.int8) and q.scales.dtype == torch.float16
        deq = dequantize_matrix(q.parts(), q.cfg, (192, 64))
        assert 0 < (deq - w1).abs().max() < w1.abs().max() / (4 if bits == 4 else 60)
        x = torch.randn(3, 64)
        assert torch.equal(q(x), torch.nn.functional.linear(x, deq))

    # int4 base: LoRA trains on it; merge folds into the dequantized weights; the adapter folder loads back
    from trainscale.infer.load import load_for_inference
    from trainscale.runtime.artifact import save_model_dir

    base = build_model(spec, seed=0)
    save_model_dir(tmp_path / "base", base.state_dict(), spec, None)
    apply_lora(base, 4, 8.0, lora_targets(spec, "attn"), seed=1)  # the MLP stays quantized and unadapted
    model = build_model(spec, seed=0)
    quantize_base(model, 4, 64)
    apply_lora(model, 4, 8.0, lora_targets(spec, "attn"), seed=1)
    ids = torch.randint(0, spec.vocab_size, (3000,), generator=torch.Generator().manual_seed(1)).tolist()
    res = train_lora(model, ids, steps=5, batch=4, seq_len=32, lr=1e-2)
    assert res["trainable_params"] == lora_trainable_params(spec, 4, "attn")
    x = torch.tensor([ids[:40]])
    with torch.no_grad():
        adapted = model(x)
        fp_base = base(x)  # same adapters' init, full-precision base: another model
    assert (adapted - fp_base).abs().max() > 1e-3
    save_adapter_folder(tmp_path / "ad", model, spec, tmp_path / "base",
                        {"rank": 4, "alpha": 8.0, "targets": ["wq", "wk", "wv", "wo"], "base_bits": 4,
                         "base_group_size": 64})
    loaded, _, _ = load_for_inference(tmp_path / "ad")
    with torch.no_grad():
        assert torch.allclose(loaded(x), adapted, atol=1e-4, rtol=0)
        merged = merge_lora(model)
        assert not any(isinstance(m, QuantizedLinear) for m in merged.modules())
        assert set(merged.state_dict()) == set(build_model(spec, "meta").state_dict())
        assert torch.allclose(merged(x), adapted, atol=1e-4, rtol=0)
    from trainscale.infer.peft import export_peft

    with pytest.raises(TrainscaleError, match="quantized to int4"):
        export_peft(tmp_path / "ad", tmp_path / "peft")


@pytest.mark.slow
def test_qlora_on_the_small_model_ends_near_lora_on_the_fp32_base(small_model_dir, tmp_path):  # noqa: F811
    """``lora --base-bits 4`` (groups of 64) on the trained small model: the base's projections in 0.27 of their bf16
    bytes (scales included; bytes equal estimate/inference.group_quant_bytes row by row), and the held-out loss after
    the same training within 0.02 nats of LoRA on the fp32 base (benchmarks/bench_qlora.py measures more)."""
    import json

    from typer.testing import CliRunner

    from trainscale.cli import app
    from trainscale.runtime.data.sources import corpus_text

    paras = [p for p in corpus_text("val", max_chars=40_000).split("\n\n") if p.strip()]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    reps = {}
    for bits in (None, 4):
        extra = ["--base-bits", str(bits), "--merge"] if bits else []
        res = CliRunner().invoke(app, ["lora", str(small_model_dir), "--data", str(data), "--steps", "20", "--batch",
                                       "4", "--seq-len", "64", "--lr", "3e-3", "--out", str(tmp_path / f"ad{bits}"),
                                       "--json", *extra])
        assert res.exit_code == 0, res.output
        reps[bits] = json.loads(res.stdout)
    q = reps[4]["quantized_base"]
    assert q["equal"] and q["bytes"] == q["predicted_bytes"] and 0.265 < q["ratio_to_bf16"] < 0.27
    assert q["held_out_perplexity_full_precision"] == reps[None]["held_out"]["perplexity_before"]
    fp, q4 = reps[None]["held_out"], reps[4]["held_out"]
    print(f"held-out loss: fp32 base {fp['loss_before']:.4f} -> {fp['loss_after']:.4f}; int4 base "
          f"{q4['loss_before']:.4f} -> {q4['loss_after']:.4f}")
    assert q4["loss_after"] < q4["loss_before"] - 0.05 and abs(q4["loss_after"] - fp["loss_after"]) < 0.02
    ev = CliRunner().invoke(app, ["evaluate", str(tmp_path / "ad4"), "--data", str(data), "--split", "held-out",
                                  "--seq-len", "64", "--json"])  # the merged folder: dequantized base + adapters
    assert ev.exit_code == 0, ev.output
    assert json.loads(ev.stdout)["perplexity"] == pytest.approx(q4["perplexity_after"], rel=1e-4)
