"""The four messages that pointed the wrong way (issue 35): each mistake now gets the sentence that names it.

A wrong data path in a folder that holds a run is named as a data path (the config is checked before the run
folder); tp3 on 4 heads / 2 KV heads lists tp2, which trains; chat data with ``[model] init`` on a folder without a
tokenizer names that folder; a misspelt key names itself, the key it was meant to be and the file."""

from __future__ import annotations

import json

import pytest
from _cli import run_cli

MODEL = ('[model]\nname = "t"\nn_layers = 2\nd_model = 64\nn_heads = 4\nn_kv_heads = 2\nd_ff = 128\n'
         'vocab_size = 512\nmax_seq_len = 64\n')
TRAIN = "[train]\nsteps = 2\nseq_len = 32\nglobal_batch = 4\n"


def _train(tmp_path, monkeypatch, capsys, text: str, *args: str) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(text)
    return run_cli(monkeypatch, capsys, "train", "--config", "c.toml", *args)


def test_a_wrong_data_path_in_a_folder_with_a_run_is_named_as_a_data_path(tmp_path, monkeypatch, capsys):
    run = tmp_path / "runs" / "x"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "identity.json").write_text(json.dumps({"run_id": "r1", "config_sha256": "ab"}))
    text = MODEL + TRAIN + '[data]\nfiles = ["nope.txt"]\n[run]\nout = "runs/x"\n'
    code, out = _train(tmp_path, monkeypatch, capsys, text)
    assert code == 2
    assert "data file nope.txt does not exist" in out and "--resume" not in out


def test_the_tp_suggestion_lists_every_degree_that_trains(tmp_path, monkeypatch, capsys):
    code, out = _train(tmp_path, monkeypatch, capsys, MODEL + TRAIN, "--layout", "tp3", "--dry-run")
    assert code == 2 and "tp3 must divide t's 4 attention heads; use tp in [1, 2]" in out
    code, out = _train(tmp_path, monkeypatch, capsys, MODEL + TRAIN, "--layout", "tp2", "--dry-run")
    assert code == 0, out  # the degree it names does train


@pytest.mark.slow  # builds a transformers model
def test_chat_data_with_an_init_folder_without_a_tokenizer_names_the_folder(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    m.config.save_pretrained(hf)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, hf / "model.safetensors")
    (tmp_path / "chat.jsonl").write_text('{"prompt": "hi", "response": "there"}\n')
    code, out = _train(tmp_path, monkeypatch, capsys, f'[model]\ninit = "{hf}"\n' + TRAIN +
                       '[data]\nformat = "chat"\nfiles = ["chat.jsonl"]\n', "--dry-run")
    assert code == 2
    # the init folder is named, with the way out ([data] tokenizer), never "set [model] init" (it is set)
    assert f"[model] init {hf} holds no tokenizer" in out and "[data] tokenizer" in out and "or [model] init" not in out


@pytest.mark.parametrize(("section", "typo", "meant"), [("model", "d_modle", "d_model"),
                                                         ("train", "seq_lne", "seq_len")])
def test_a_misspelt_key_names_itself_its_nearest_key_and_the_file(tmp_path, monkeypatch, capsys, section, typo, meant):
    text = (MODEL + TRAIN).replace(f"\n{meant} =", f"\n{typo} =")
    code, out = _train(tmp_path, monkeypatch, capsys, text, "--dry-run")
    assert code == 2
    assert f"config c.toml: [{section}] has no key '{typo}'; did you mean {meant}?" in out
