"""A GPU given as a TOML file is planned with its generation's constants (and, when it repeats a catalog GPU's
datasheet, that GPU's own): a field-by-field copy of a catalog GPU predicts the same step as the catalog name."""

from __future__ import annotations

import pytest

from trainscale.estimate.planner.efficiencies import load_efficiencies
from trainscale.estimate.planner.plan import problem
from trainscale.safeio import toml_text
from trainscale.specs import Layout, catalog_names, load_gpu


def _copy(tmp_path, name: str, **changes) -> str:
    data = {k: v for k, v in load_gpu(name).model_dump().items() if k != "name"}
    data.update(changes)
    path = tmp_path / f"my-own-{name}.toml"  # a name the catalog does not know
    path.write_text(toml_text(data))
    return str(path)


@pytest.mark.parametrize("name", ["h100-sxm", "h200", "a100-sxm-80gb"])
def test_a_copy_of_a_catalog_gpu_predicts_the_same_step(tmp_path, name):
    kw = {"model": "llama3.1-8b", "gpus": 64, "seq": 8192, "global_batch_tokens": 2**22}
    ours = problem(gpu=name, **kw).evaluate_layout(Layout.parse("tp1,pp1,dp64,mb1,zero3"))
    theirs = problem(gpu=_copy(tmp_path, name), **kw).evaluate_layout(Layout.parse("tp1,pp1,dp64,mb1,zero3"))
    assert theirs["step_time_s"] == pytest.approx(ours["step_time_s"], rel=1e-12)


def test_every_catalog_gpu_copied_gets_its_constants(tmp_path):
    for name in catalog_names("gpus"):
        assert load_efficiencies(load_gpu(_copy(tmp_path, name))) == load_efficiencies(name), name


def test_a_gpu_of_ones_own_gets_its_generations_constants(tmp_path):
    """An H100 with another memory size is no catalog GPU: it keeps hopper's constants, not h200's override or
    the generic defaults."""
    own = load_gpu(_copy(tmp_path, "h100-sxm", memory_bytes=64e9, usable_bytes=0.0))
    eff = load_efficiencies(own)
    hopper = load_efficiencies("h100-sxm")
    assert eff.matmul_efficiency == hopper.matmul_efficiency == 0.801  # catalog/planner.toml [generation.hopper]
    generic = load_efficiencies(load_gpu(_copy(tmp_path, "h100-sxm", generation="", memory_bytes=64e9)))
    assert generic.matmul_efficiency == 0.75  # [defaults]: a GPU whose generation is not given
