"""Your own data (issue 13): `trainscale prepare-data` turns JSONL / Parquet / text into token shards
(runtime/data/shards.py); `trainscale train` learns from them (held-out loss below the unigram baseline);
re-running is a no-op, an interrupted run resumes, bad input is one line and exit code 2 with nothing
half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _tiny import TINY_MODEL

from trainscale.runtime.config import load_config
from trainscale.runtime.data import shards, sources, tokenizer
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.sources import corpus_text

ROOT = Path(__file__).resolve().parents[1]
MODEL = TINY_MODEL + """
[train]
steps = {steps}
lr = 3e-3
warmup = 5
seq_len = 32
global_batch = 8

[run]
log_every = 20
eval_sequences = 32
"""


def ts(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscale", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def write_config(path: Path, data: str, steps: int = 60) -> Path:
    path.write_text(MODEL.format(steps=steps) + "\n[data]\n" + data)
    return path


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """A user's documents: the paragraphs of the first 300,000 characters of the training plays."""
    return [p.strip("\n") for p in corpus_text("train", 300_000).split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, docs) -> Path:
    path = tmp_path_factory.mktemp("user") / "corpus.jsonl"
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "content": d, "lang": "en"}) + "\n")
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, docs) -> Path:
    """A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json naming eos_token)."""
    folder = tmp_path_factory.mktemp("hf-tok")
    tok = tokenizer.train_bpe(iter(docs), 384, eot="</s>")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "model_max_length": 64}))
    return folder


def train(cfg: Path, out: Path, layout: str = "", world: int = 1) -> dict:
    """A real training job (torchrun), -> its run.json."""
    from trainscale.runtime.job.launch import torchrun_command

    p = subprocess.run(torchrun_command(cfg, layout, out, world), capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads((out / "run.json").read_text())


@pytest.mark.dist
def test_jsonl_corpus_trains_below_the_unigram_baseline(tmp_path, jsonl, docs):
    prepared = tmp_path / "prepared"
    cfg = write_config(tmp_path / "jsonl.toml", f'files = ["{jsonl}"]\ntext_field = "content"\nshard_mb = 0.05\n'
                       f'workers = 2\nprepared = "{prepared}"\n')
    p = ts("prepare-data", "--config", str(cfg))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "held-out" in p.stdout and "tokens/s" in p.stdout
    index = json.loads((prepared / "index.json").read_text())
    tr, val = index["splits"]["train"], index["splits"]["val"]
    assert tr["documents"] + val["documents"] == len(docs) and 0 < val["documents"] < len(docs) // 10
    assert len(tr["shards"]) >= 5 and index["dtype"] == "uint16" and index["vocab_size"] == 512
    corpus = corpus_for(load_config(cfg))
    stream = corpus.tokens("train")
    ids = stream[0:len(stream)]
    assert ids.dtype == np.uint16 and len(ids) == tr["tokens"]
    # documents packed, each followed by the end-of-text token: one per document, decoding to the document
    assert int((ids == index["eot_id"]).sum()) == tr["documents"] and ids[-1] == index["eot_id"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    first = ids[: int(np.argmax(ids == index["eot_id"]))]
    first_train = docs[int(np.argmin(sources.Settings().held_mask("0:0", 50)))]  # unit 0 of file 0, from byte 0
    assert tok.decode(first.tolist()) == first_train
    assert np.array_equal(corpus.unigram_counts(), np.bincount(ids, minlength=512))

    # the run reads the shards; its held-out loss beats the unigram baseline
    out = tmp_path / "run"
    info = train(cfg, out)
    print(f"JSONL: held-out loss {info['eval_loss']:.4f}, unigram baseline {info['unigram_loss']:.4f}")
    assert info["eval_loss"] < info["unigram_loss"] - 0.1, info
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()


@pytest.mark.dist
def test_parquet_folder_with_a_loaded_tokenizer_trains_below_the_unigram_baseline(tmp_path, docs, hf_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "parquet"
    folder.mkdir()
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        pq.write_table(pa.table({"text": part, "n": list(range(len(part)))}), folder / f"part-{i}.parquet",
                       row_group_size=300)
    cfg = write_config(tmp_path / "pq.toml", f'files = ["{folder}"]\ntokenizer = "{hf_tokenizer}"\n'
                       f'shard_mb = 0.02\nprepared = "{tmp_path / "prepared"}"\n')
    info = train(cfg, tmp_path / "run")  # rank 0 prepares the shards first
    index = json.loads((tmp_path / "prepared" / "index.json").read_text())
    assert index["eot"] == "</s>" and index["vocab_size"] == 384  # the loaded tokenizer, its eos_token
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == len(docs)
    assert len(index["sources"]) == 2 and len(index["splits"]["train"]["shards"]) >= 4  # row groups -> shards
    print(f"Parquet: held-out loss {info['eval_loss']:.4f}, unigram baseline {info['unigram_loss']:.4f}")
    assert info["eval_loss"] < info["unigram_loss"] - 0.1, info


def test_rerun_is_a_noop_interrupted_run_resumes_and_workers_do_not_matter(tmp_path, jsonl, monkeypatch):
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(jsonl.read_bytes())

    def request(folder: Path, workers: int) -> shards.DataRequest:
        return shards.DataRequest(files=(str(mine),), settings=sources.Settings(text_field="content",
                                                                                unit_bytes=40_000),
                                  folder=str(folder), workers=workers)

    said: list[str] = []
    one = shards.prepare(request(tmp_path / "one", 1), 512, tmp_path, log=said.append)
    mtime = (one.folder / "index.json").stat().st_mtime_ns
    shards.prepare(request(tmp_path / "one", 1), 512, tmp_path, log=said.append)
    assert "already prepared" in said[-1] and (one.folder / "index.json").stat().st_mtime_ns == mtime

    # interrupted after 3 shards (Ctrl-C): those are kept, the rerun does only the rest
    real, calls = shards.tokenize_unit, []

    def interrupted(*a):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(a[2].index)
        return real(*a)

    monkeypatch.setattr(shards, "tokenize_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shards.prepare(request(tmp_path / "two", 1), 512, tmp_path)
    assert not (tmp_path / "two").exists()  # no half-written folder under the final name
    partial = next(tmp_path.glob(".two.partial-*"))
    assert sorted(p.name for p in partial.glob("unit-*.json")) == ["unit-00000.json", "unit-00001.json",
                                                                  "unit-00002.json"]
    monkeypatch.setattr(shards, "tokenize_unit", real)
    said.clear()
    two = shards.prepare(request(tmp_path / "two", 2), 512, tmp_path, log=said.append)  # 2 worker processes
    n_units = len(two.index["splits"]["train"]["shards"])
    assert any(m.startswith(f"resuming: 3 of {n_units} shards") for m in said), said
    assert not partial.exists()
    names = {p.name for p in two.folder.iterdir()}
    assert {"index.json", "tokenizer.json", "unigram.npy"} <= names
    assert all(n.endswith((".npy", ".json")) and not n.startswith(("worker-", "jobs")) for n in names), names
    # the same shards, whatever the worker count and interruptions
    assert one.index["hash"] == two.index["hash"]
    for split in ("train", "val"):
        a, b = one.tokens(split), two.tokens(split)
        assert np.array_equal(a[0:len(a)], b[0:len(b)])

    # changed content, same path: rebuilt, and swapped into place whole
    before, tokens = one.index["hash"], len(one.tokens("train"))
    lines = mine.read_text().splitlines()
    mine.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    three = shards.prepare(request(tmp_path / "one", 1), 512, tmp_path)
    assert three.folder == one.folder and three.index["hash"] != before
    assert 0.4 * tokens < three.index["splits"]["train"]["tokens"] < 0.6 * tokens
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no leftovers


def test_plain_text_files_and_globs(tmp_path):
    text = corpus_text("train", 60_000)
    for i in range(5):
        (tmp_path / f"book-{i}.txt").write_text(text[i * 12_000:(i + 1) * 12_000])
    req = shards.DataRequest(files=(str(tmp_path / "book-*.txt"),), settings=sources.Settings(held_out=0.1),
                             tokenizer_vocab=300, folder=str(tmp_path / "p"))
    c = shards.prepare(req, 512, tmp_path)
    paragraphs = sum(len([p for p in (tmp_path / f"book-{i}.txt").read_text().split("\n\n") if p.strip()])
                     for i in range(5))
    idx = c.index
    assert idx["splits"]["train"]["documents"] + idx["splits"]["val"]["documents"] == paragraphs
    assert idx["vocab_size"] == 300 and len(idx["sources"]) == 5
    # cut into many small units (at blank lines): the same paragraphs, none split
    small = shards.DataRequest(**{**req.__dict__, "settings": sources.Settings(held_out=0.1, unit_bytes=2000),
                                  "folder": str(tmp_path / "small")})
    small_idx = shards.prepare(small, 512, tmp_path).index
    assert len(small_idx["splits"]["train"]["shards"]) > 25
    assert small_idx["splits"]["train"]["documents"] + small_idx["splits"]["val"]["documents"] == paragraphs
    # a whole file as one document: five documents, one of them (book-1, by its hash) held out
    req = shards.DataRequest(**{**req.__dict__, "settings": sources.Settings(documents="file", held_out=0.1),
                                "folder": str(tmp_path / "f")})
    c = shards.prepare(req, 512, tmp_path)
    idx = c.index
    assert (idx["splits"]["train"]["documents"], idx["splits"]["val"]["documents"]) == (4, 1)
    from tokenizers import Tokenizer

    val = c.tokens("val")
    tok = Tokenizer.from_file(str(c.tokenizer_path))
    assert tok.decode(val[0:len(val) - 1].tolist()) == (tmp_path / "book-1.txt").read_text()


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, hf_tokenizer, capsys, monkeypatch):
    from trainscale import cli

    def run(data: str, name: str) -> str:
        cfg = write_config(tmp_path / f"{name}.toml", data + f'prepared = "{tmp_path / name}"\n')
        monkeypatch.setattr(sys, "argv", ["trainscale", "prepare-data", "--config", str(cfg), "--json"])
        with pytest.raises(SystemExit) as e:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0, err
        assert not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}.*")), name
        return err

    assert "does not exist" in run(f'files = ["{tmp_path / "missing.jsonl"}"]\n', "missing")
    assert "matches no files" in run(f'files = ["{tmp_path / "nothing-*.txt"}"]\n', "noglob")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert "the corpus is empty" in run(f'files = ["{tmp_path / "empty.txt"}"]\n', "empty")
    assert "the corpus is empty" in run(f'files = ["{tmp_path / "blank.jsonl"}"]\n', "blank")
    good = [json.dumps({"text": f"line {i} of a corpus"}) for i in range(50)]
    (tmp_path / "nofield.jsonl").write_text("\n".join(good[:7] + ['{"body": "no text here"}'] + good[7:]) + "\n")
    err = run(f'files = ["{tmp_path / "nofield.jsonl"}"]\n', "nofield")
    assert "nofield.jsonl line 8 has no 'text' field" in err
    rng = np.random.default_rng(0)
    (tmp_path / "garbage.txt").write_bytes(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    assert "is binary, not text" in run(f'files = ["{tmp_path / "garbage.txt"}"]\n', "garbage")
    (tmp_path / "garbage.jsonl").write_bytes(b"\xff\xfe" + rng.integers(1, 256, 500, dtype=np.uint8).tobytes())
    assert "line 1 is not JSON" in run(f'files = ["{tmp_path / "garbage.jsonl"}"]\n', "garbagej")
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1" + b"\x00" * 100)
    assert "is not a Parquet file" in run(f'files = ["{tmp_path / "garbage.parquet"}"]\n', "garbagep")
    big = tmp_path / "big-tokenizer.json"
    tokenizer.train_bpe(iter([corpus_text("train", 200_000)]), 1024).save(str(big))
    (tmp_path / "ok.jsonl").write_text("\n".join(good) + "\n")
    err = run(f'files = ["{tmp_path / "ok.jsonl"}"]\ntokenizer = "{big}"\n', "bigtok")
    assert "has 1,024 tokens, more than the model's vocab_size 512" in err
    err = run(f'files = ["{tmp_path / "ok.jsonl"}"]\ntokenizer = "{tmp_path / "no-tokenizer"}"\n', "notok")
    assert "does not exist" in err
