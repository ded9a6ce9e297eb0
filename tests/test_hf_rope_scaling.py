"""RoPE "yarn" in and out, exactly (transformers' modeling_rope_utils._compute_yarn_parameters): a random Llama and
Qwen2 built by transformers (nothing downloaded) with YaRN scaling load into trainscale's model with transformers'
own logits (fp32, 1e-5) on 48 tokens, longer than the original length 16 they were "pretrained" on; exported back
with ``export --to hf`` the rope_scaling is the same and transformers loads the folder with our logits. RoPE
"dynamic" stays refused in one sentence: transformers recomputes its frequencies per forward from the longest
sequence it has seen, which a fixed RoPE cannot reproduce."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _hf import logit_diff, ours

from trainscale.errors import TrainscaleError
from trainscale.runtime.hf_init import hf_folder_spec
from trainscale.runtime.model import rope_frequencies, rope_scale

transformers = pytest.importorskip("transformers")

VOCAB = 384
SEQ = 48  # > the original length 16
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}
# head_dim 16, original length L = 16. The ramp's ends are the dims turning beta_fast / beta_slow times over L,
# d ln(L / (2 pi r)) / (2 ln theta): theta 100 gives -4.4 and 1.6, rounded out to 0 and 2, so dim 0 keeps its
# frequency, dim 1 is blended half and half and dims 2-7 are divided by the factor.
FAMILIES = {
    # Llama, transformers 5's rope_type key, the defaults (beta 32 / 1, attention factor 0.1 ln 4 + 1)
    "llama_yarn": ("LlamaConfig", {"rope_theta": 100.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 16, "rope_beta_fast": 32.0,
         "rope_beta_slow": 1.0, "rope_attention_factor": None, "rope_truncate": True}),
    # Qwen2.5's long-context form (its README: {"type": "yarn", "factor": 4.0, "original_max_position_embeddings":
    # 32768}), the older "type" key
    "qwen2_yarn": ("Qwen2Config", {"rope_theta": 100.0, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        {"family": "qwen2", "rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 16}),
    # every option set: betas 8 / 2 (ramp 0.3 .. 2.8 unrounded), an explicit attention factor
    "llama_yarn_options": ("LlamaConfig", {"rope_theta": 100.0, "max_position_embeddings": 128, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
        "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False}},
        {"rope_scaling": "yarn", "rope_factor": 8.0, "rope_beta_fast": 8.0, "rope_beta_slow": 2.0,
         "rope_attention_factor": 1.3, "rope_truncate": False}),
}


def make_hf(name: str, folder: Path) -> torch.nn.Module:
    cls, fields, _ = FAMILIES[name]
    fields = json.loads(json.dumps(fields))  # transformers adds rope_theta to the rope_scaling dict it is given
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **fields})).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    d = tmp_path_factory.mktemp("yarn")
    return {n: (d / n, make_hf(n, d / n)) for n in FAMILIES}


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_yarn_frequencies_and_logits_equal_transformers(folders, name):
    folder, theirs = folders[name]
    spec = hf_folder_spec(folder)
    for field, want in FAMILIES[name][2].items():
        assert getattr(spec, field) == want, field
    # the frequencies and the cos / sin factor are transformers' own, bit for bit
    rotary = theirs.model.rotary_emb
    assert torch.equal(rope_frequencies(spec), rotary.inv_freq)
    assert rope_scale(spec) == rotary.attention_scaling
    if name == "llama_yarn":  # 0.1 ln(factor) + 1 (YaRN eq. 21) and the blend worked out in the comment above
        assert rope_scale(spec) == pytest.approx(0.1 * math.log(4.0) + 1)
        plain = 1.0 / (100.0 ** (torch.arange(0, 16, 2).float() / 16))
        got = rope_frequencies(spec)
        assert got[0] == plain[0]
        assert got[1].item() == pytest.approx((plain[1] / 4 + plain[1]).item() / 2, rel=1e-6)
        assert torch.allclose(got[2:], plain[2:] / 4, rtol=1e-6)
    diff = logit_diff(theirs, ours(folder), batch(1))
    print(f"{name}: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    # without the scaling the same weights give other logits: the parity above tests it
    assert logit_diff(theirs, ours(folder, rope_scaling="none"), batch(1)) > 1e-3


@pytest.mark.parametrize("name", ["llama_yarn", "qwen2_yarn", "llama_yarn_options"])
def test_export_writes_the_same_rope_scaling_back(folders, tmp_path, name):
    from trainscale.infer.export import export_hf
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.tokenizer import train_bpe

    folder, theirs = folders[name]
    model = ours(folder)
    tok = train_bpe(["the quick brown fox jumps over the lazy dog " * 50], VOCAB)
    tok.save(str(tmp_path / "tok.json"))
    save_model_dir(tmp_path / "m", model.state_dict(), hf_folder_spec(folder), tmp_path / "tok.json")
    export_hf(tmp_path / "m", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    given = FAMILIES[name][1]["rope_scaling"]
    written = cfg["rope_scaling"]
    assert written["rope_type"] == "yarn"
    for key, value in given.items():
        if key not in ("type", "rope_type"):
            assert written[key] == value, key
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(back) is type(theirs)
    assert torch.equal(back.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    assert back.model.rotary_emb.attention_scaling == theirs.model.rotary_emb.attention_scaling
    assert logit_diff(back, model, batch(2)) < 1e-5
    assert hf_folder_spec(tmp_path / "hf").model_dump(exclude={"name", "source"}) == \
        hf_folder_spec(folder).model_dump(exclude={"name", "source"})


def test_mscale_ratio_is_read_as_transformers_reads_it(tmp_path):
    """DeepSeek-style mscale / mscale_all_dim, no attention_factor: the ratio of their yarn_get_mscale."""
    cfg = transformers.LlamaConfig(**{**BASE, "rope_theta": 100.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 0.5}})
    theirs = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    theirs.save_pretrained(str(tmp_path))
    spec = hf_folder_spec(tmp_path)
    assert rope_scale(spec) == theirs.model.rotary_emb.attention_scaling
    assert rope_scale(spec) == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert torch.equal(rope_frequencies(spec), theirs.model.rotary_emb.inv_freq)


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "dynamic", "factor": 4.0}, "RoPE scaling 'dynamic', whose frequencies transformers recomputes"),
    ({"type": "longrope", "factor": 4.0}, "RoPE scaling 'longrope'"),
])
def test_dynamic_and_longrope_are_refused_in_one_sentence(folders, tmp_path, rope, message):
    source = folders["llama_yarn"][0]
    d = tmp_path / "f"
    d.mkdir()
    cfg = json.loads((source / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope}))
    (d / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    with pytest.raises(TrainscaleError, match=message) as e:
        hf_folder_spec(d)
    assert "\n" not in str(e.value)
