"""DPO under dp2, fsdp2 and tp2 (real processes, torchrun, gloo) equals one process: the first step's gradients,
and the losses and rewards of three AdamW steps, within 1e-5 relative (tests/_preference_worker.py); and
`trainscale dpo --layout` on fsdp2 and tp2 gives the one-process run's steps, held-out metrics and weights."""

from __future__ import annotations

import json
import os
import sys

import pytest
from _parity import ROOT, run_job
from _pref import ROWS, llama_folder, write_jsonl
from safetensors.torch import load_file

pytestmark = [pytest.mark.dist, pytest.mark.slow]
WORKER = ROOT / "tests" / "_preference_worker.py"
LAYOUTS = ("dp2", "fsdp2", "tp2")


def _run(tmp_path, world: int, layouts: str) -> dict:
    result = tmp_path / f"world{world}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", str(world)]
    proc = run_job([*launch, str(WORKER), "--model", str(tmp_path / "m"), "--data", str(tmp_path / "pairs.jsonl"),
                    "--layouts", layouts, "--result", str(result)], env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(result.read_text())


def test_dpo_under_dp2_fsdp2_tp2_equals_one_process(tmp_path):
    llama_folder(tmp_path / "m")
    write_jsonl(tmp_path / "pairs.jsonl", ROWS * 3)
    one = _run(tmp_path, 1, "dp1")["dp1"]["rows"]
    many = _run(tmp_path, 2, ";".join(LAYOUTS))
    g1 = load_file(str(tmp_path / "world1-dp1.safetensors"))
    assert one[-1]["rewards/margins"] > one[1]["rewards/margins"] > 0  # it learns: the steps compare real numbers
    for layout in LAYOUTS:
        for a, b in zip(one, many[layout]["rows"], strict=True):
            for k, v in a.items():
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (layout, k)
        g2 = load_file(str(tmp_path / f"world2-{layout}.safetensors"))
        assert set(g2) == set(g1)
        for name, g in g1.items():
            assert ((g2[name] - g).norm() / g.norm()).item() <= 1e-5, (layout, name)


def test_dpo_command_on_fsdp2_and_tp2_equals_one_process(tmp_path):
    from infer_fixtures import cli_json

    llama_folder(tmp_path / "m")
    write_jsonl(tmp_path / "pairs.jsonl", ROWS * 4)
    common = ["dpo", str(tmp_path / "m"), "--data", str(tmp_path / "pairs.jsonl"), "--steps", "4", "--batch", "4",
              "--lr", "1e-3", "--held-out", "0.3"]
    one = cli_json(*common, "--out", str(tmp_path / "one"))
    w1 = load_file(str(tmp_path / "one" / "model.safetensors"))
    for layout in ("fsdp2", "tp2"):
        out = tmp_path / layout.replace(",", "_")
        got = cli_json(*common, "--layout", layout, "--out", str(out))
        assert got["layout"] == layout and got["pairs"] == one["pairs"]
        for a, b in zip(one["steps_log"], got["steps_log"], strict=True):
            for k, v in a.items():
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (layout, k)
        for k, v in one["held_out_after"].items():
            assert got["held_out_after"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (layout, k)
        w2 = load_file(str(out / "model.safetensors"))
        assert set(w2) == set(w1)
        for name, w in w1.items():
            assert ((w2[name] - w).norm() / w.norm()).item() <= 1e-5, (layout, name)
