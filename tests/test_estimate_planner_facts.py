"""The planner's model read from the kernels, papers and recipes it cites (issue 20): each test holds one figure
against a count made by hand from the cited source."""

from __future__ import annotations

import numpy as np
import pytest

from trainscale.estimate.planner import layer
from trainscale.estimate.planner.candidates import candidates
from trainscale.specs import Layout, load_model


def _cands(model: str, layout: str, seq: int, global_seqs: int):  # type: ignore[no-untyped-def]
    lay = Layout.parse(layout)
    cfg = {"tp": [lay.tp], "cp": [lay.cp], "pp": [lay.pp], "dp": [lay.dp], "mb": [lay.mb], "v": [lay.v],
           "schedule": [0], "recompute": [0], "zero": [lay.zero], "hsdp": [1], "sp": [True]}
    return candidates(load_model(model), {k: np.asarray(v) for k, v in cfg.items()}, seq, global_seqs)


def test_unfused_attention_moves_the_scores_beyond_its_gemms_as_megatrons_kernels_do():
    # BLOOM-176B (112 heads) at tp4, seq 2048, micro-batch 2: the score tensor on one rank is 2 x 28 x 2048 x 2048
    # bf16 = 469,762,048 bytes. Megatron's FusedScaleMaskSoftmax reads the scores and writes the probabilities
    # (2 passes); torch dropout reads them, writes the dropped ones and a 1-byte mask (2.5); the QK^T and AV
    # bmm's own reads and writes are in their GEMM rooflines. Backward: dropout (grad in, mask in, grad out: 2.5),
    # softmax backward (grad and saved probabilities in, grad out: 3).
    m = load_model("bloom-176b")
    c = _cands("bloom-176b", "tp4,pp1,dp1,mb2", 2048, 2)
    score = 2 * (112 // 4) * 2048 * 2048 * 2
    assert score == 469_762_048
    fwd, bwd = layer.unfused_score_bytes(m, c, 2048)
    assert float(fwd[0]) == pytest.approx(4.5 * score) and float(bwd[0]) == pytest.approx(5.5 * score)
