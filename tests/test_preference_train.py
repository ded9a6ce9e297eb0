"""`trainscale dpo` in one process: on pairs where a rule decides the preferred answer (the chosen answer ends in
'!', the rejected one in '.', the words random), a few steps move the held-out preference accuracy up, for DPO
full-parameter and LoRA and for the reference-free losses; the saved folder loads and scores what was reported."""

from __future__ import annotations

import json
import random

import pytest
from _pref import llama_folder, write_jsonl
from infer_fixtures import cli_error, cli_json

pytestmark = pytest.mark.slow
WORDS = "the sea wind rain hills fox dog poem river day nice brief capital spider legs four nine".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    rng = random.Random(0)
    rows = [{"prompt": f"Write about the {rng.choice(WORDS)}.",
             "chosen": " ".join(rng.sample(WORDS, 3)).capitalize() + "!",
             "rejected": " ".join(rng.sample(WORDS, 3)).capitalize() + "."} for _ in range(64)]
    return llama_folder(root / "m"), write_jsonl(root / "pairs.jsonl", rows), root


@pytest.mark.parametrize(("loss", "extra"), [("dpo", []), ("dpo", ["--lora-rank", "8", "--lr", "1e-2"]),
                                             ("ipo", []), ("simpo", ["--beta", "2"]), ("orpo", ["--beta", "1"])])
def test_a_rule_decided_pair_set_moves_held_out_accuracy_up(setup, loss, extra):
    model, data, root = setup
    out = root / f"out-{loss}-{len(extra)}"
    r = cli_json("dpo", str(model), "--data", str(data), "--loss", loss, "--steps", "20", "--batch", "8",
                 "--lr", "1e-3", "--held-out", "0.25", "--out", str(out), *extra)
    assert r["pairs"] == {"train": 47, "held_out": 17, "rule": "runtime/data/sources.py Settings.held_mask"}
    before, after = r["held_out_before"], r["held_out_after"]
    # DPO / IPO: every reward 0 at the start (0%); SimPO / ORPO: the random model's chance, 9 of 17
    assert before["rewards/accuracies"] <= 0.53
    assert after["rewards/accuracies"] >= 0.9 and after["rewards/margins"] > before["rewards/margins"]
    assert after["loss"] < before["loss"]
    assert (r["reference"] is None) == (loss in ("simpo", "orpo"))
    if r["reference"] is not None:
        assert r["reference"]["cached_pairs"] == 64
        assert before["rewards/chosen"] == 0.0 and before["rewards/rejected"] == 0.0  # policy == reference
    assert len(r["steps_log"]) == 20 and r["last"]["step"] == 20
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == r["steps_log"] and set(logged[0]) >= {"loss", "rewards/chosen", "rewards/rejected",
                                                           "rewards/margins", "rewards/accuracies"}
    assert (out / ("adapter.json" if "--lora-rank" in extra else "model.json")).is_file()


def test_the_saved_model_scores_what_was_reported(setup):
    """The tuned folder (full-parameter DPO) reloads; its held-out rewards against the original model equal the
    report's."""
    import torch

    from trainscale.infer.load import load_for_inference
    from trainscale.infer.preference import evaluate_pairs, reference_logps, split_pairs
    from trainscale.runtime.data.chat import load_chat_tokenizer
    from trainscale.runtime.data.preference import load_pairs
    from trainscale.runtime.preference import PreferenceSettings

    model, data, root = setup
    out = root / "saved"
    r = cli_json("dpo", str(model), "--data", str(data), "--steps", "5", "--batch", "8", "--lr", "1e-3",
                 "--held-out", "0.25", "--out", str(out))
    pairs = load_pairs(data, load_chat_tokenizer(out), 384)
    _, held = split_pairs(str(data), pairs, 0.25)
    ref = reference_logps(load_for_inference(model)[0], held, 256)
    with torch.no_grad():
        got = evaluate_pairs(load_for_inference(out)[0], PreferenceSettings(), held, ref, 256)
    for k, v in r["held_out_after"].items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_bad_input_is_one_sentence(setup, tmp_path):
    model, data, _ = setup
    assert "must be one of dpo, ipo, simpo, orpo" in cli_error("dpo", str(model), "--data", str(data),
                                                               "--loss", "kto")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Hi", "chosen": "A"}])
    assert f"preference data file {bad} line 1 has no 'rejected'" in cli_error("dpo", str(model), "--data", str(bad))
    assert "LoRA target 'zz' is not one of" in cli_error("dpo", str(model), "--data", str(data), "--lora-rank", "4",
                                                        "--targets", "zz")
    assert "not pp, cp or ep" in cli_error("dpo", str(model), "--data", str(data), "--layout", "pp2")
    assert "LoRA (--lora-rank) runs in one process" in cli_error("dpo", str(model), "--data", str(data),
                                                                "--layout", "fsdp2", "--lora-rank", "4")
    assert "label smoothing applies to the dpo and simpo losses" in cli_error(
        "dpo", str(model), "--data", str(data), "--loss", "ipo", "--label-smoothing", "0.1")


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "4", "--lr", "1e-2"]])
def test_resume_from_a_checkpoint_equals_the_straight_run(setup, extra):
    """Ten steps straight, and five then five more resumed from OUT/checkpoint (weights, AdamW state, the batch
    generator, the cached reference log-probs), give the same steps and the same weights."""
    from safetensors.torch import load_file

    model, data, root = setup
    common = ["dpo", str(model), "--data", str(data), "--batch", "4", "--lr", "1e-3", "--save-every", "5", *extra]
    a, b = root / f"straight{len(extra)}", root / f"resumed{len(extra)}"
    straight = cli_json(*common, "--steps", "10", "--out", str(a))
    cli_json(*common, "--steps", "5", "--out", str(b))
    resumed = cli_json(*common, "--steps", "10", "--out", str(b), "--resume")
    assert resumed["resumed_from_step"] == 5 and resumed["reference"]["from_checkpoint"]
    assert resumed["steps_log"] == straight["steps_log"] and resumed["held_out_after"] == straight["held_out_after"]
    name = "adapter.safetensors" if extra else "model.safetensors"
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert all(torch_equal(wa[k], wb[k]) for k in wa)
    assert "was made by another run" in cli_error(*common, "--steps", "10", "--out", str(b), "--resume",
                                                  "--beta", "0.2")


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))
