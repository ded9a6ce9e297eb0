"""The four infer sub-commands end to end: JSON output, estimator checks, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from infer_fixtures import small_model_dir  # noqa: F401  (session fixture)


def ts(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_quantize_then_generate(small_model_dir, tmp_path):  # noqa: F811
    r = ts("quantize", str(small_model_dir), "--format", "int4", "--group-size", "32", "--out", str(tmp_path / "q4"),
           "--eval-tokens", "4096", "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["file"]["equal"] and rep["file"]["tensor_bytes"] == rep["file"]["predicted_tensor_bytes"]
    assert rep["file"]["file_bytes"] == rep["file"]["header_bytes"] + rep["file"]["tensor_bytes"]
    assert rep["perplexity"]["change_vs_bf16"] < 0.03 and 0 < rep["weight_error"]["relative_frobenius"] < 0.2
    assert rep["sample"]["completion"]
    r = ts("generate", str(tmp_path / "q4"), "--prompt", "ROMEO:", "-n", "12", "--temperature", "0.7", "--top-k", "40",
           "--top-p", "0.9", "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr
    g = json.loads(r.stdout)
    assert g["kv_cache"]["equal"] and g["kv_cache"]["measured_bytes"] == g["kv_cache"]["predicted_bytes"]
    assert g["new_tokens"] <= 12 and g["kv_cache"]["positions"] == g["prompt_tokens"] + 12
    human = ts("generate", str(small_model_dir), "-p", "ROMEO:", "-n", "4")
    assert human.returncode == 0 and "KV cache bytes" in human.stdout
    # no --prompt: the start of the model's own held-out text (infer/evaluate.held_out_prompt), as quantize's sample
    from trainscale.infer.evaluate import default_prompt, evaluation_text
    from trainscale.infer.load import load_tokenizer_for
    from trainscale.runtime.find_model import find_model_folder

    r = ts("generate", str(small_model_dir), "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    folder = find_model_folder(str(small_model_dir))
    tok = load_tokenizer_for(folder)
    held = evaluation_text(folder, tok, max_tokens=64, default_plays=True)
    assert json.loads(r.stdout)["prompt"] == default_prompt(tok, held.ids) != ""
    r = ts("generate", str(small_model_dir), "--chat")
    assert r.returncode == 2 and "--chat needs --prompt" in r.stderr


@pytest.mark.slow
def test_lora_merge_and_export(small_model_dir, tmp_path):  # noqa: F811
    r = ts("lora", str(small_model_dir), "--rank", "4", "--data", "corpus:val", "--steps", "6", "--batch", "4",
           "--seq-len", "64", "--merge", "--out", str(tmp_path / "lora"), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["trainable_params"]["equal"] and rep["optimizer_bytes"]["equal"]
    assert (tmp_path / "lora" / "model.safetensors").exists() and (tmp_path / "lora" / "adapter.safetensors").exists()
    r = ts("export", str(tmp_path / "lora"), "--to", "gguf", str(tmp_path / "m.gguf"), "--type", "q8_0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["equal"]
    r = ts("export", str(tmp_path / "lora"), "--to", "hf", str(tmp_path / "hf"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["equal"] and (tmp_path / "hf" / "config.json").exists()


@pytest.mark.slow
def test_errors_are_one_line_exit_2(small_model_dir, tmp_path):  # noqa: F811
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.json").write_text((small_model_dir / "model.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    cases = [
        (("generate", str(bad), "-p", "hi"), "corrupt"),
        (("quantize", str(small_model_dir), "--format", "int3"), "int8 or int4"),
        (("quantize", str(small_model_dir), "--group-size", "48"), "group size"),
        (("export", str(small_model_dir), "--to", "onnx", str(tmp_path / "x")), "hf, gguf or peft"),
    ]
    for args, words in cases:
        r = ts(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("trainscale: error:") and words in lines[0], r.stderr


@pytest.mark.slow
def test_infer_modules_import_each_other_without_a_cycle():
    """infer/'s own imports (at module level or inside a function: a function-local import that dodges a cycle is
    still one) form a graph without cycles, and each module imports alone in a fresh interpreter."""
    import ast
    from graphlib import CycleError, TopologicalSorter
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "src" / "trainscale" / "infer"
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainscale.infer."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("trainscale.infer.")}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"infer/ imports go round: {e.args[1]}") from None
    # the folder formats sit lowest: quantize imports nothing of infer/, lora only quantize (QLoRA's base)
    assert {"load", "lora", "quantize"} <= set(order) and graph["quantize"] == set() and graph["lora"] == {"quantize"}
    for name in ("lora", "quantize", "load", "export", "generate", "evaluate", "peft"):
        r = subprocess.run([sys.executable, "-c", f"import trainscale.infer.{name}"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_quantize_perplexity_is_on_the_runs_own_held_out_split(tmp_path):
    """A run trained on the user's data (a prepared corpus): quantize's default perplexity text is that corpus's
    held-out split, token for token (the perplexity equals one computed here on those ids), and it says so; a model
    folder from no run uses the held-out plays and says that it is the default."""
    from trainscale.infer.evaluate import perplexity
    from trainscale.infer.quantize import model_from_state_dict
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.config import config_from_dict
    from trainscale.runtime.data.corpus import corpus_for
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.find_model import load_model_dir
    from trainscale.runtime.model import build_model

    text = tmp_path / "mine.txt"
    text.write_text(corpus_text("train", max_chars=120_000)[60_000:], encoding="utf-8")
    spec = {"name": "held-out", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 192,
            "vocab_size": 512, "max_seq_len": 64}  # untrained: the perplexity only has to be computed on the right ids
    cfg = config_from_dict({"name": "own", "model": spec, "train": {"seq_len": 64},
                            "data": {"files": [str(text)], "prepared": str(tmp_path / "prepared"), "workers": 1}})
    corpus = corpus_for(cfg)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    (run / "tokenizer.json").write_bytes(corpus.tokenizer_path.read_bytes())
    save_model_dir(run / "final", build_model(cfg.model, seed=1).state_dict(), cfg.model, corpus.tokenizer_path)
    r = ts("quantize", str(run), "--eval-tokens", "600", "-n", "0", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["perplexity"]
    assert p["text_kind"] == "run-prepared" and str(tmp_path / "prepared") in p["text"]
    val = [int(i) for i in corpus.tokens("val")[0:600]]
    model, _, _ = load_model_dir(run / "final")
    assert p["tokens"] == len(val) == 600
    assert p["source"] == pytest.approx(perplexity(model_from_state_dict(cfg.model, model.state_dict()), val),
                                        rel=1e-6)
    plain = save_model_dir(tmp_path / "plain", model.state_dict(), cfg.model, corpus.tokenizer_path)  # from no run
    human = ts("quantize", str(plain), "--eval-tokens", "256", "-n", "0", "--out", str(tmp_path / "q"))
    assert human.returncode == 0, human.stderr
    flat = " ".join(human.stdout.split())
    assert "perplexity text" in flat and "held-out Shakespeare plays (default:" in flat
