"""`trainscale evaluate --tasks`: multiple-choice accuracy as lm-evaluation-harness computes it.

- the oracle: lm-eval 0.4 itself (``lm_eval.simple_evaluate``, model "hf") on the Hugging Face export of the same
  tiny model, with a local task YAML over the same JSONL: every example's log-likelihoods, choice and normalised
  choice, and acc / acc_norm with their standard errors, equal ours (a context longer than the window included:
  both cut it from the left);
- a task file is bounded and checked before anything is scored: one sentence naming the line of a bad row;
- evaluate's windows are bounded: --seq-len past the model's window is refused, --seq-len 1 batches its windows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from infer_fixtures import cli_error as fails
from infer_fixtures import cli_json as cli

VOCAB = 300
SPEC = {"name": "tasks", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
        "vocab_size": VOCAB, "max_seq_len": 64}
LONG = " ".join(["Now is the winter of our discontent made glorious summer by this sun of York;"] * 5)
ROWS = [
    {"context": "ROMEO: What light through yonder", "choices": ["window breaks", "door", "king of Denmark"], "gold": 0},
    {"context": "Question: who speaks? Answer: ", "choices": ["the king", "a queen of hearts", "no one"], "gold": 1},
    {"context": "To be, or not to", "choices": ["be", "see", "flee away"], "gold": 0},
    {"context": "The café sold", "choices": ["crème brûlée", "bread", "naïve résumés"], "gold": 2},  # chars != bytes
    {"context": "JULIET:\n", "choices": ["O Romeo, Romeo!", "Good night.", "Ay me!", "What?"], "gold": 3},
    {"context": LONG, "choices": ["and all the clouds", "that lour'd upon our house"], "gold": 1},  # > the window
    {"context": "First Citizen:  Before we proceed", "choices": ["any further", "hear me speak"], "gold": 1},
    {"context": "HAMLET: Alas, poor", "choices": ["Yorick", "Horatio", "Ophelia"], "gold": 0},
    {"context": "1 + 1 =", "choices": ["2", "3", "11"], "gold": 0},
    {"context": "Friends, Romans,", "choices": ["countrymen", "lend me your ears", "enemies"], "gold": 0},
    {"context": "All the world's a", "choices": ["stage", "play", "globe"], "gold": 0},
    {"context": "Double, double toil and", "choices": ["trouble", "bubble", "rubble"], "gold": 0},
]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A random model folder of ours (vocabulary: a BPE trained on the plays), and a task file."""
    from trainscale.runtime.artifact import save_model_dir
    from trainscale.runtime.data.sources import corpus_text
    from trainscale.runtime.data.tokenizer import train_bpe
    from trainscale.runtime.model import build_model
    from trainscale.specs import load_model

    d = tmp_path_factory.mktemp("tasks")
    train_bpe([corpus_text("train", max_chars=80_000)], VOCAB).save(str(d / "tokenizer.json"))
    spec = load_model(SPEC)
    model = save_model_dir(d / "m", build_model(spec, seed=0).state_dict(), spec, d / "tokenizer.json")
    (d / "tasks.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    return {"dir": d, "model": model, "tasks": d / "tasks.jsonl"}


TASK_YAML = """task: trainscale_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
def test_accuracy_equals_lm_evaluation_harness_per_example(world, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from trainscale.infer.export import export_hf

    export_hf(world["model"], tmp_path / "hf")
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "trainscale_mc.yaml").write_text(TASK_YAML.format(data=world["tasks"],
                                                                           cache=tmp_path / "cache"))
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
                                     tasks=["trainscale_mc"], device="cpu", batch_size=4, log_samples=True,
                                     task_manager=TaskManager(include_path=str(tmp_path / "yaml")))
    ours = cli("evaluate", str(world["model"]), "--tasks", str(world["tasks"]))
    assert ours["examples"] == len(ROWS) and ours["requests"] == sum(len(r["choices"]) for r in ROWS)
    assert ours["truncated_requests"] == 2  # the LONG context's two choices, cut from the left by both
    samples = sorted(theirs["samples"]["trainscale_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ROWS)
    for s, p in zip(samples, ours["predictions"], strict=True):
        lls = [ll for ll, _ in s["filtered_resps"]]
        assert p["loglikelihoods"] == pytest.approx(lls, rel=1e-4, abs=1e-4)
        assert (p["acc"], p["acc_norm"]) == (s["acc"], s["acc_norm"]), (p, s)
        assert p["pred"] == max(range(len(lls)), key=lambda k: lls[k])
    res = theirs["results"]["trainscale_mc"]
    assert ours["acc"] == pytest.approx(res["acc,none"], abs=1e-12)
    assert ours["acc_norm"] == pytest.approx(res["acc_norm,none"], abs=1e-12)
    assert ours["acc_stderr"] == pytest.approx(res["acc_stderr,none"], rel=1e-9)
    assert ours["acc_norm_stderr"] == pytest.approx(res["acc_norm_stderr,none"], rel=1e-9)
    assert ours["acc"] != ours["acc_norm"]  # the normalisation decided some example (by characters, not bytes)
    print(f"acc {ours['acc']:.4f} ± {ours['acc_stderr']:.4f}, acc_norm {ours['acc_norm']:.4f}: equal to lm-eval")


def test_pair_encoding_moves_trailing_space_and_counts_boundary_merges(world):
    from trainscale.infer.tasks import encode_pair
    from trainscale.runtime.data.tokenizer import load_tokenizer

    tok = load_tokenizer(world["dir"] / "tokenizer.json")
    ctx, cont = encode_pair(tok, "Answer: ", " the king")
    assert ctx == tok.encode("Answer:").ids and ctx + cont == tok.encode("Answer:  the king").ids
    ctx, cont = encode_pair(tok, "To be, or not to", " be")
    assert ctx + cont == tok.encode("To be, or not to be").ids and cont == tok.encode(" be").ids


def test_stderr_is_lm_evals(world):
    metrics = pytest.importorskip("lm_eval.api.metrics")
    from trainscale.infer.tasks import mean_stderr

    xs = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert mean_stderr(xs) == pytest.approx(metrics.mean_stderr(xs), rel=1e-12)
    assert mean_stderr([1.0]) is None


def test_lm_eval_field_names_are_read(world, tmp_path):
    from trainscale.infer.tasks import read_tasks

    p = tmp_path / "t.jsonl"
    p.write_text('\n{"query": "a b", "choices": ["c", "d"], "label": 1}\n\n')
    (row,) = read_tasks(p)
    assert (row.context, row.choices, row.gold, row.line) == ("a b", ("c", "d"), 1, 2)


@pytest.mark.parametrize("line, says", [
    ('{"context": "x", "choices": ["a", "b"], "gold": 2}', "gold must be the index of the right choice, 0 to 1"),
    ('{"context": "x", "choices": ["a", "b"], "gold": true}', "gold must be the index"),
    ('{"context": "  ", "choices": ["a", "b"], "gold": 0}', "the context must be a string with text"),
    ('{"context": "x", "choices": ["a"], "gold": 0}', "choices must be a list of 2 to 64 non-empty strings"),
    ('{"context": "x", "choices": ["a", ""], "gold": 0}', "non-empty strings"),
    ('{"context": "x", "query": "y", "choices": ["a", "b"], "gold": 0}', "needs only one of 'context' or 'query'"),
    ('{"choices": ["a", "b"], "gold": 0}', "needs one of 'context' or 'query'"),
    ('["x"]', "is not a JSON object"),
    ('{"context": "x",', "is not valid JSON"),
])
def test_a_bad_row_is_one_sentence_naming_its_line(world, tmp_path, line, says):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    msg = fails("evaluate", str(world["model"]), "--tasks", str(p))
    assert says in msg and f"{p} line 2" in msg


def test_task_files_are_bounded(world, tmp_path, monkeypatch):
    from trainscale.infer import tasks

    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({**ROWS[0], "context": "x" * (2 << 20)}) + "\n")
    assert "line 1 is 2,097,2" in fails("evaluate", str(world["model"]), "--tasks", str(long))
    assert "more than an example's 1,048,576" in fails("evaluate", str(world["model"]), "--tasks", str(long))
    monkeypatch.setattr(tasks, "MAX_TASK_FILE_BYTES", 100)
    assert "larger than any such file (100)" in fails("evaluate", str(world["model"]), "--tasks",
                                                      str(world["tasks"]))
    monkeypatch.setattr(tasks, "MAX_TASK_FILE_BYTES", 1 << 20)
    monkeypatch.setattr(tasks, "MAX_TASK_ROWS", 3)
    assert "holds more than 3 examples" in fails("evaluate", str(world["model"]), "--tasks", str(world["tasks"]))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert "holds no example" in fails("evaluate", str(world["model"]), "--tasks", str(tmp_path / "empty.jsonl"))
    assert "is a folder, not a file" in fails("evaluate", str(world["model"]), "--tasks", str(tmp_path))
    (tmp_path / "bin.jsonl").write_bytes(b'{"context": "\xff"}\n')
    assert "line 1 is not UTF-8" in fails("evaluate", str(world["model"]), "--tasks", str(tmp_path / "bin.jsonl"))
    assert "--data, --split and --seq-len belong to a perplexity" in fails(
        "evaluate", str(world["model"]), "--tasks", str(world["tasks"]), "--data", "corpus:val")


@pytest.mark.slow
def test_batched_scores_equal_one_by_one(world):
    """Requests of mixed lengths in right-padded batches give what each alone gives."""
    from trainscale.infer.load import load_for_inference, load_tokenizer_for
    from trainscale.infer.tasks import read_tasks, score_tasks

    model, spec, folder = load_for_inference(world["model"])
    rows = read_tasks(world["tasks"])[:5]  # 15 requests of mixed lengths (every new shape is slow on a first pass)
    batched = score_tasks(model, load_tokenizer_for(folder), rows, spec.max_seq_len, VOCAB)
    alone = score_tasks(model, load_tokenizer_for(folder), rows, spec.max_seq_len, VOCAB, batch_tokens=1)
    for a, b in zip(batched["predictions"], alone["predictions"], strict=True):
        assert a["loglikelihoods"] == pytest.approx(b["loglikelihoods"], rel=1e-5, abs=1e-5)
        assert (a["pred"], a["pred_norm"]) == (b["pred"], b["pred_norm"])


def test_evaluate_windows_are_bounded(world, tmp_path):
    from trainscale.runtime.data.sources import corpus_text

    text = tmp_path / "val.txt"
    text.write_text(corpus_text("val", max_chars=2000))
    msg = fails("evaluate", str(world["model"]), "--data", str(text), "--seq-len", "65")
    assert msg == "--seq-len must be 1 to the model's window, 64 tokens (its max_seq_len), not 65"
    assert "must be a positive integer" in fails("evaluate", str(world["model"]), "--data", str(text),
                                                 "--seq-len", "0")
    one = cli("evaluate", str(world["model"]), "--data", str(text), "--seq-len", "1", "--max-tokens", "500")
    assert (one["seq_len"], one["scored_tokens"]) == (1, 499)  # 499 windows of 2 tokens, in one forward pass


def test_evaluate_data_lines_are_bounded_before_tokenising(world, tmp_path, monkeypatch):
    """A 10 MB chat message or JSONL line is refused in one sentence naming its line, before any tokenising
    (it was tokenised whole: tens of seconds, gigabytes); the scan streams, so a line across read chunks counts."""
    from trainscale.infer import evaluate as ev

    big = tmp_path / "chat.jsonl"
    msg = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 2_000_000}]}
    big.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                   + "\n" + json.dumps(msg) + "\n")
    said = fails("evaluate", str(world["model"]), "--data", str(big), "--format", "chat")
    assert said.startswith(f"data file {big} line 2 is longer than 1,048,576 bytes") and said.endswith("split it")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("short\n" * 10)
    (folder / "b.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "y" * 300}) + "\n")
    monkeypatch.setattr(ev, "MAX_EVAL_LINE_BYTES", 200)
    assert f"{folder / 'b.jsonl'} line 2 is longer than 200 bytes" in fails("evaluate", str(world["model"]),
                                                                            "--data", str(folder))
    ev.check_lines(str(folder), limit=320)  # the longest line, 314 bytes, passes a limit above it
    one = tmp_path / "one.txt"
    one.write_bytes(b"z" * ((1 << 20) + 5))  # one line across two read chunks
    with pytest.raises(ev.TrainscaleError, match="line 1 is longer than 1,048,580"):
        ev.check_lines(str(one), limit=(1 << 20) + 4)
    ev.check_lines(str(one), limit=(1 << 20) + 5)


def test_an_adapters_own_data_is_bounded_too(tmp_path, monkeypatch):
    """Without --data a LoRA folder is evaluated on the file its adapter.json names: its lines are bounded the same."""
    from trainscale.infer import evaluate as ev

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b" * 100}) + "\n")
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter.json").write_text(json.dumps({"data": str(data), "text_field": "text",
                                                               "held_out": 0.1}))
    monkeypatch.setattr(ev, "MAX_EVAL_LINE_BYTES", 50)
    with pytest.raises(ev.TrainscaleError, match=f"data file {data} line 2 is longer than 50 bytes"):
        ev.evaluation_text(tmp_path / "ad", None)
