"""Markers for a fast inner loop: ``pytest -m "not dist and not service"`` runs in about two minutes.

- ``dist``: the test starts real training processes (torchrun / the train CLI / multi-process workers);
- ``service``: the test needs a real service started for it (Slurm's daemons, headless Chromium).

The marks are given here, by test file and test name, so that one table says what the fast loop leaves out; a
name in the table that no longer exists fails the collection (a renamed test cannot drop out silently).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WHOLE_FILE = {
    "test_runtime_parallel_parity.py": "dist",
    "test_runtime_job_elastic.py": "dist",
    "test_runtime_job_faults.py": "dist",
    "test_runtime_job_chaos.py": "dist",
    "test_runtime_job_multinode.py": "dist",
    "test_runtime_precision.py": "dist",
    "test_runtime_job_tblog.py": "dist",
    "test_runtime_job_goodput.py": "dist",
    "test_runtime_parallel_zero1.py": "dist",
    "test_runtime_chat_train.py": "dist",
    "test_infer_from_checkpoint.py": "dist",
    "test_runtime_job_slurm.py": "service",
}
OPTIONAL_FILES: set[str] = set()  # files marked before they exist (none now)
BY_TEST = {
    "dist": {
        "test_runtime_moe.py": [
            "test_moe_loss_matches_single_process", "test_moe_learns_and_experts_split",
            "test_ep_checkpoint_resumes_at_another_ep_size_and_metrics_count_experts",
            "test_compare_plan_moe_state_flops_and_all_to_all"],
        "test_runtime_probe_compare.py": [
            "test_model_state_bytes_exact", "test_activations_and_flops", "test_sharding_shrinks_what_it_should",
            "test_tensor_parallel_flops_convention", "test_compare_plan_cli"],
        "test_runtime_probe_calibrate.py": [
            "test_profile_has_every_figure", "test_bus_bandwidth_from_raw_times", "test_profile_round_trip",
            "test_cli_writes_a_profile"],
        "test_runtime_hf_init.py": ["test_layouts_read_their_shards_train_and_round_trip"],
        "test_hf_families.py": ["test_families_train_under_dp_tp_pp_like_one_process_and_export",
                                "test_tied_embedding_under_deeper_pipelines_and_with_tp_fsdp_zero1"],
        "test_runtime_data_shards.py": [
            "test_jsonl_corpus_trains_below_the_unigram_baseline",
            "test_parquet_folder_with_a_loaded_tokenizer_trains_below_the_unigram_baseline"],
        "test_runtime_data_loader.py": ["test_resume_under_another_dp_and_pp_continues_on_the_same_sequences"],
        "test_commands_train.py": ["test_train_writes_the_run_folder_and_a_loadable_model",
                                   "test_a_refused_resume_is_one_sentence_and_changes_nothing_in_the_run_folder",
                                   "test_set_overrides_are_the_runs_config_and_resume_sees_them"],
        "test_infer_export_moe.py": ["test_cli_refuses_moe_tiny_in_one_line"],
        "test_estimate_flops.py": ["test_a_real_run_logs_the_planners_mfu"],
        "test_runtime_host_syncs.py": ["test_dp2_reads_nothing_on_a_step_that_does_not_log"],
        "test_runtime_resume.py": [
            "test_resume_with_fewer_steps_or_none_keeps_the_uninterrupted_schedule",
            "test_going_past_the_total_is_explicit_and_a_refusal_writes_nothing",
            "test_wsd_extended_in_its_stable_phase_is_the_longer_run"],
    },
    "service": {
        "test_report.py": ["test_seed_report_in_chromium", "test_report_of_a_real_tiny_run_in_chromium"],
    },
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        file, name = item.path.name, getattr(item, "originalname", item.name)
        if file in WHOLE_FILE:
            item.add_marker(getattr(pytest.mark, WHOLE_FILE[file]))
        for mark, files in BY_TEST.items():
            if name in files.get(file, ()):
                item.add_marker(getattr(pytest.mark, mark))


def pytest_configure(config: pytest.Config) -> None:
    """Every name in the table must be a test function of its file (read from the source, whatever is selected)."""
    here = Path(__file__).parent
    missing = []
    for files in BY_TEST.values():
        for file, names in files.items():
            tree = ast.parse((here / file).read_text())
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            missing += [f"{file}::{n}" for n in names if n not in defined]
    missing += [f for f in WHOLE_FILE if not (here / f).exists() and f not in OPTIONAL_FILES]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py marks tests that do not exist: {', '.join(missing)}")
