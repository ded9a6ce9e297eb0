"""A run's report names the run by its folder (not "run run") and shows one unigram baseline: the held-out loss
of the unigram model, the figure the held-out loss is compared with and train prints beside it (issue 35: the
page printed 6.38 and 6.29). The oracle for the number is runtime/data/loader.unigram_loss itself."""

from __future__ import annotations

import json

import numpy as np
import torch

from trainscale.report.build import build_report
from trainscale.runtime.data.loader import unigram_loss
from trainscale.runtime.measure import unigram_entropy


def test_one_baseline_and_the_folder_as_the_runs_name(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.zipf(1.3, 5000) % 300
    held = torch.as_tensor(rng.zipf(1.3, 800) % 300)
    uni = unigram_loss(train, held, 300)
    ent = unigram_entropy(np.bincount(train, minlength=300))
    assert abs(uni - ent) > 0.01  # the two figures differ, as on the page
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    rows = [{"step": s, "loss": 7.0 - 0.1 * s, "tokens_per_s": 100.0} for s in range(1, 6)]
    rows.append({"step": 5, "val_loss": 6.0, "unigram_loss": uni})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "run.json").write_text(json.dumps({"unigram_entropy": ent, "unigram_loss": uni, "layout": "dp1"}))
    out = build_report(tmp_path / "page", run_dir=run, walkthrough=False)
    report = json.loads((out.parent / "report.json").read_text() if out.is_file() else
                        (out / "report.json").read_text())
    page = (out if out.is_file() else out / "index.html").read_text()
    baselines = [v for k, v in report["summary"].items() if "unigram" in k]
    assert baselines == [f"{uni:.4f} nats/token (held-out loss of the unigram model)"]
    assert f"{ent:.4f}" not in page and "run run" not in page.lower()
    assert f"the run in {run}" in page
