"""What every sub-command shares (commands/_common.py): estimate/ refuses a value by its field name, and the
command line names the flag the value came from."""

from __future__ import annotations

import pytest

from trainscale.commands._common import flag, user_message
from trainscale.errors import FieldError, TrainscaleError
from trainscale.estimate.planner import plan


def test_a_field_is_its_flag_with_dashes_unless_the_table_says_otherwise():
    assert flag("max_v") == "--max-v" and flag("seq") == "--seq"
    assert flag("target_days") == "--days" and flag("gpu_hours") == "--budget-gpu-hours"


def test_the_planner_names_its_field_and_the_command_line_the_flag():
    with pytest.raises(FieldError) as e:
        plan.problem(model="llama3.1-8b", gpus=0)
    assert str(e.value) == "gpus must be positive, not 0"
    assert user_message(e.value) == "--gpus must be positive, not 0"
    assert user_message(TrainscaleError("a plain sentence")) == "a plain sentence"
