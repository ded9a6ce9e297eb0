"""The loader's position is global (sequences consumed by the whole job), so a run saved under one layout resumes
under another on exactly the sequences the uninterrupted run would have read; real processes (torchrun) train on a
user's JSONL shards (issue 13)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _tiny import TINY_MODEL

from trainscale.errors import TrainscaleError
from trainscale.runtime.data import shards
from trainscale.runtime.data.sources import corpus_text
from trainscale.runtime.job.checkpoint import committed_steps, step_dir_name
from trainscale.runtime.job.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]


def test_loader_state_is_a_global_sequence_position():
    from trainscale.runtime.data.loader import TokenLoader

    tokens = np.arange(20_000, dtype=np.uint16) % 500
    whole = TokenLoader(tokens, 16, 8, seed=5)
    for _ in range(3):
        whole.next_batch()
    state = whole.state_dict()
    assert state["sequences"] == 24 and all(isinstance(v, int) for v in state.values())
    want = whole.next_batch()[0]
    for dp in (2, 4):  # the same next global batch, whatever the data-parallel degree that resumes it
        ranks = [TokenLoader(tokens, 16, 8, dp_rank=r, dp=dp, seed=5) for r in range(dp)]
        for r in ranks:
            r.load_state_dict(state)
        got = [r.next_batch()[0] for r in ranks]
        assert np.array_equal(np.concatenate([g.numpy() for g in got]), want.numpy())
    # a larger global batch after resume continues on the very next sequences
    bigger = TokenLoader(tokens, 16, 16, seed=5)
    bigger.load_state_dict(state)
    assert np.array_equal(bigger.next_batch()[0][:8].numpy(), want.numpy())
    with pytest.raises(TrainscaleError, match="corpus windows"):
        TokenLoader(tokens[:10_000], 16, 8, seed=5).load_state_dict(state)


def test_token_stream_reads_across_shards():
    parts = [np.arange(0, 5), np.arange(5, 12), np.arange(12, 13), np.arange(13, 20)]
    s = shards.TokenStream(parts)
    whole = np.arange(20)
    assert len(s) == 20
    for a, b in ((0, 20), (3, 9), (4, 5), (11, 14), (12, 13), (19, 20), (7, 7)):
        assert np.array_equal(s[a:b], whole[a:b]), (a, b)


CONFIG = TINY_MODEL + """
[train]
steps = 8
lr = 3e-3
warmup = 2
seq_len = 32
global_batch = 8

[data]
files = ["{jsonl}"]
shard_mb = 0.03
prepared = "{prepared}"

[run]
eval_sequences = 0
save_final = false

[checkpoint]
every_steps = 4
keep = 3
"""


def _run(cfg: Path, layout: str, world: int, out: Path, resume: bool = False) -> str:
    p = subprocess.run(torchrun_command(cfg, layout, out, world, resume=resume), capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r and "step_time_s" in r}


@pytest.mark.dist
def test_resume_under_another_dp_and_pp_continues_on_the_same_sequences(tmp_path):
    jsonl = tmp_path / "user.jsonl"
    paragraphs = [p for p in corpus_text("train", 120_000).split("\n\n") if p.strip()]
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(jsonl=jsonl, prepared=tmp_path / "prepared"))
    ref = tmp_path / "dp2"
    _run(cfg, "dp2", 2, ref)  # uninterrupted, checkpoints at steps 4 and 8
    assert committed_steps(ref / "checkpoints") == [4, 8]
    assert len(json.loads((tmp_path / "prepared" / "index.json").read_text())["splits"]["train"]["shards"]) >= 3
    want = _losses(ref)
    for layout, world in (("dp4", 4), ("pp2,dp2", 4)):
        out = tmp_path / layout.replace(",", "-")
        shutil.copytree(ref, out)
        shutil.rmtree(out / "checkpoints" / step_dir_name(8))  # as if the dp2 job had stopped after step 4
        (out / "metrics.jsonl").unlink()  # only the resumed job's steps are read below
        log = _run(cfg, layout, world, out, resume=True)
        assert "at step 4" in log, log[-2000:]
        got = _losses(out)
        assert sorted(got) == [5, 6, 7, 8], layout
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-4), (layout, step)
