"""One safe-IO module: an atomic write, the one "JSON object or one sentence" reader, and the one TOML writer
(tomli-w) for the run folder's config.toml and the hardware profile (issue 19 item 3)."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

import pytest

from trainscale.errors import TrainscaleError
from trainscale.estimate.profile import to_toml
from trainscale.runtime.config import config_from_dict, load_config
from trainscale.safeio import atomic_write, atomic_write_text, read_json_object, toml_text

NASTY = 'eot "\n\n" \t tab \\ back \x00 nul \x1f unit \x7f del é 漢字 🙂 \'single\' """triple"""'


def test_a_run_config_with_control_characters_reads_back_equal(tmp_path):
    cfg = config_from_dict({"name": NASTY, "model": {"name": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2,
                                                    "n_kv_heads": 2, "d_ff": 64, "vocab_size": 128, "max_seq_len": 32},
                            "train": {"seq_len": 32}, "data": {"eot": "\n\n"},
                            "run": {"out": str(tmp_path / "r\u00e9\t\"x\"")}},
                           "test config")
    text = cfg.to_toml()
    assert tomllib.loads(text)["data"]["eot"] == "\n\n"  # the old writer wrote a raw newline tomllib refuses
    (tmp_path / "config.toml").write_text(text)
    again = load_config(tmp_path / "config.toml")
    assert again == cfg and again.name == NASTY


def test_toml_text_round_trips_the_profile_types():
    data = {"machine": {"name": NASTY, "peak": 0.1 + 0.2, "gpus": 8, "ok": True, "inf": math.inf,
                        "list": [1.5, 2.5e-9]}, "processes": {"4": {"matmul_flops": 1.23456789012345e13}},
            "skipped": None}
    back = tomllib.loads(toml_text(data, header="a comment"))
    assert back == {k: v for k, v in data.items() if v is not None}
    assert to_toml({"machine": {"x": 1}}).startswith("# trainscale hardware profile")


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    p = tmp_path / "f.json"
    atomic_write_text(p, "old")

    def half(tmp: Path) -> None:
        tmp.write_text("half a fi")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(p, half)
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]  # no temporary file left behind
    atomic_write_text(p, "new é")
    assert p.read_bytes() == "new é".encode()


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"), ("[1, 2]", "is not a JSON object"), ("{bad", "is not valid JSON"),
    (b"\xff\xfe", "is not UTF-8"), ("x" * 200, "larger than any such file")])
def test_read_json_object_is_one_sentence(tmp_path, content, message):
    p = tmp_path / "x.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    with pytest.raises(TrainscaleError, match=message):
        read_json_object(p, "thing", limit=100)
    p.write_text('{"a": [1, "é"]}')
    assert read_json_object(p, "thing") == {"a": [1, "é"]}
