"""`trainscale prepare-data` on hostile input, through the real CLI (no torchrun; issue 23): a `**` glob over a
whole file system, an output folder holding a user's own files, a FIFO or a tokenizer with one enormous token.
Each is one sentence and exit 2 within seconds, and nothing the user owns is written or deleted."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tiny import TINY_MODEL

from trainscale.errors import TrainscaleError
from trainscale.runtime.data import sources, tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = TINY_MODEL + """
[train]
steps = 10
seq_len = 32
global_batch = 8

[data]
"""
TEXT = "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, number {i * 7919 % 1000}."
                   for i in range(400))


def prepare(tmp_path: Path, data: str, timeout: int = 60) -> tuple[subprocess.CompletedProcess, float]:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(MODEL + data)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "trainscale", "prepare-data", "--config", str(cfg), "--json"],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "TRAINSCALE_CRASH_LOG": str(tmp_path / "crash.log")})
    return p, time.monotonic() - t0


def refused(p: subprocess.CompletedProcess, seconds: float, *words: str) -> str:
    """Exit 2, one line on stderr, no traceback and not the "unexpected" safety net, within seconds."""
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(lines) == 1, p.stderr
    assert "unexpected" not in p.stderr and "please report it" not in p.stderr and "Traceback" not in p.stderr
    assert seconds < 30, seconds
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else "dir"
            for f in sorted(folder.rglob("*"))}


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.slow
def test_a_double_star_glob_over_the_root_is_refused_at_once(tmp_path):
    for pattern in ("/**/*.txt", "/../**/*.jsonl", "/**"):
        p, seconds = prepare(tmp_path, f'files = ["{pattern}"]\n')
        line = refused(p, seconds, pattern, "whole file system")
        assert seconds < 10, (pattern, seconds, line)


@pytest.mark.slow
def test_a_whole_file_system_as_the_data_folder_is_refused(tmp_path):
    p, seconds = prepare(tmp_path, 'files = ["/"]\n')
    refused(p, seconds, "whole file system")


def test_glob_expansion_is_bounded_by_entries_and_time(tmp_path):
    for i in range(20):
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "a.txt").write_text("x")
    pattern = f"{tmp_path}/**/*.txt"
    assert len(sources.expand_pattern(pattern)) == 20  # within the budget: the 20 files, as glob finds them
    with pytest.raises(TrainscaleError, match="visits more than 10 files and folders") as e:
        sources.expand_pattern(pattern, max_entries=10)
    assert pattern in str(e.value)
    with pytest.raises(TrainscaleError, match=r"took more than 0 s to expand"):
        sources.expand_pattern(pattern, seconds=0)


def test_glob_expansion_matches_glob(tmp_path):
    import glob

    for rel in ("x.txt", "a/y.txt", "a/b/z.md", ".h/q.txt", "a/.p.txt", "a/b/c/w.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    for pat in ("**", "**/*.txt", "*/*", "a/**/*.md", "a/*/*", ".*/*", "?.txt", "a/[b]/*.md"):
        full = f"{tmp_path}/{pat}"
        want = sorted(Path(p) for p in glob.glob(full, recursive=True) if os.path.isfile(p))
        assert sources.expand_pattern(full) == want, pat


@pytest.mark.slow
def test_an_output_folder_of_the_users_own_files_is_left_alone(tmp_path, corpus):
    victim = tmp_path / "thesis"
    victim.mkdir()
    (victim / "chapter1.txt").write_text("my thesis, years of work\n")
    (victim / "index.json").write_text(json.dumps({"version": 1, "hash": "x", "splits": {}}))
    (victim / "figures").mkdir()
    (victim / "figures" / "plot.png").write_bytes(bytes(range(256)) * 10)
    before = snapshot(victim)
    p, seconds = prepare(tmp_path, f'files = ["{corpus}"]\nprepared = "{victim}"\nworkers = 1\n')
    line = refused(p, seconds, str(victim), "which prepare-data did not write")
    assert "chapter1.txt" in line or "figures" in line
    assert snapshot(victim) == before
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".thesis")] == []  # no work folder left


@pytest.mark.slow
def test_an_output_folder_with_a_foreign_index_is_refused(tmp_path, corpus):
    victim = tmp_path / "out"
    victim.mkdir()
    (victim / "index.json").write_text("{}")
    (victim / "train-00000.npy").write_bytes(b"not a shard")
    before = snapshot(victim)
    p, seconds = prepare(tmp_path, f'files = ["{corpus}"]\nprepared = "{victim}"\nworkers = 1\n')
    refused(p, seconds, "index.json that prepare-data did not write")
    assert snapshot(victim) == before


@pytest.mark.slow
def test_an_empty_output_folder_is_filled_and_a_rerun_is_a_no_op(tmp_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    p, _ = prepare(tmp_path, f'files = ["{corpus}"]\nprepared = "{out}"\nworkers = 1\nheld_out = 0.2\n')
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    index = json.loads((out / "index.json").read_text())
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 400
    p, _ = prepare(tmp_path, f'files = ["{corpus}"]\nprepared = "{out}"\nworkers = 1\nheld_out = 0.2\n')
    assert p.returncode == 0 and json.loads(p.stdout)["already_prepared"] is True, p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_as_tokenizer_or_data_file_is_refused(tmp_path, corpus):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    p, seconds = prepare(tmp_path, f'files = ["{corpus}"]\ntokenizer = "{fifo}"\n')
    refused(p, seconds, str(fifo), "not a regular file")
    folder = tmp_path / "tok"
    folder.mkdir()
    os.mkfifo(folder / "tokenizer.json")
    p, seconds = prepare(tmp_path, f'files = ["{corpus}"]\ntokenizer = "{folder}"\n')
    refused(p, seconds, "not a regular file")
    p, seconds = prepare(tmp_path, f'files = ["{fifo}"]\n')
    refused(p, seconds, str(fifo), "not a regular file")


@pytest.mark.slow
def test_a_tokenizer_with_one_enormous_token_is_refused(tmp_path, corpus):
    tok = tokenizer.train_bpe(iter([TEXT]), 300)
    data = json.loads(tok.to_str())
    data["model"]["vocab"]["a" * (4 << 20)] = len(data["model"]["vocab"])  # one 4 MiB token
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    p, seconds = prepare(tmp_path, f'files = ["{corpus}"]\ntokenizer = "{path}"\n')
    refused(p, seconds, "a token of 4,194,304 characters")
    data = json.loads(tok.to_str())
    data["added_tokens"].append({"id": 299, "content": "b" * 5000, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(data))
    p, seconds = prepare(tmp_path, f'files = ["{corpus}"]\ntokenizer = "{path}"\n')
    refused(p, seconds, "a token of 5,000 characters")
