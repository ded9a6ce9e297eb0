"""Every command's output path is checked where it is given, before anything is read (issue 35): /proc, a FIFO,
a file where a folder is meant (or a folder where a file is) is one sentence and exit 2; and prepare-data's shard
folder ([data] prepared, where a NUL byte can come from the TOML) the same, before any input is tokenised."""

from __future__ import annotations

import os

import pytest
from _cli import run_cli

# (command line up to the output option, the option, whether it names a folder); nothing after it is needed: the
# output's check comes first, in the order the options are given
WRITERS = [(["train"], "--out", True), (["report"], "--out", True), (["lora"], "--out", True),
           (["calibrate"], "--out", False), (["launch"], "--script", False), (["reliability"], "--plot", False)]


@pytest.mark.parametrize(("cmd", "opt", "folder"), WRITERS, ids=[w[0][0] for w in WRITERS])
def test_every_output_option_is_checked_before_anything_is_read(tmp_path, monkeypatch, capsys, cmd, opt, folder):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    wrong_kind = "file" if folder else "dir"
    cases = {"/proc/out": "/proc/out cannot be written: /proc is not writable",
             "fifo": f"fifo exists and is not a {'folder' if folder else 'regular file'}",
             wrong_kind: f"{wrong_kind} exists and is not a {'folder' if folder else 'regular file'}"}
    for path, words in cases.items():
        code, out = run_cli(monkeypatch, capsys, *cmd, opt, path)
        assert code == 2, (path, out)
        assert out.startswith("trainscale: error: ") and words in out, out
        assert "Traceback" not in out and out.count("error:") == 1


@pytest.mark.parametrize(("prepared", "words"), [("/proc/shards", "[data] prepared /proc/shards cannot be written"),
                                                 ("corpus.txt", "[data] prepared corpus.txt exists and is not a "
                                                  "folder"),
                                                 ("a\\u0000b", "[data] prepared must be a path")])
def test_prepare_data_checks_its_shard_folder_before_reading_the_corpus(tmp_path, monkeypatch, capsys, prepared,
                                                                        words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("one document.\n\nanother one.\n")
    (tmp_path / "c.toml").write_text('[model]\nn_layers = 1\nd_model = 32\nn_heads = 2\nn_kv_heads = 2\nd_ff = 64\n'
                                     'vocab_size = 300\n'
                                     'max_seq_len = 256\n[data]\nfiles = ["corpus.txt"]\n'
                                     f'prepared = "{prepared}"\n')
    code, out = run_cli(monkeypatch, capsys, "prepare-data", "--config", "c.toml")
    assert code == 2 and words in out, out
