"""Data at scale (issue 22): shards decoupled from input files (5,000 files prepared and trained on under
``ulimit -n 256``), a bounded cache of shard maps, weighted mixtures that draw their weights and resume exactly,
and token ids people already have (Megatron .bin/.idx, numpy .npy) read back equal, corrupt ones refused."""

from __future__ import annotations

import json
import math
import os
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _tiny import TINY_MODEL

from trainscale.errors import TrainscaleError
from trainscale.runtime.config import load_config
from trainscale.runtime.data import pretokenized, shards, sources, tokenizer
from trainscale.runtime.data.corpus import corpus_for
from trainscale.runtime.data.loader import TokenLoader
from trainscale.runtime.data.sources import corpus_text

ROOT = Path(__file__).resolve().parents[1]
MODEL = TINY_MODEL + """
[train]
steps = 3
lr = 3e-3
warmup = 1
seq_len = 32
global_batch = 8

[run]
log_every = 1
eval_sequences = 8
save_final = false
"""


def in_ulimit(limit: int, argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` with at most ``limit`` open files (bash's ulimit -n, inherited by every child process)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(["bash", "-c", f"ulimit -n {limit} && exec {shlex.join(argv)}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=900, env=env)


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory) -> Path:
    """A byte-level BPE of 512 tokens (end-of-text id 0) trained on the plays."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.train_bpe(iter([corpus_text("train", 200_000)]), 512).save(str(path))
    return path


# --------------------------------------------------------------------------- many files, few open


@pytest.mark.dist
def test_5000_files_prepare_and_train_under_ulimit_256(tmp_path):
    """5,000 small files become a few hundred shards, and prepare-data and an 8-step training run both work with at
    most 256 open files: the run's 512 sequences and 64 held-out ones touch more shards than that limit, so
    the loader must open them on demand (with every shard kept mapped, this run fails: too many open files)."""
    from trainscale.runtime.job.launch import torchrun_command

    lines = [ln for ln in corpus_text("train", 1_500_000).split("\n") if ln.strip()]
    folder = tmp_path / "files"
    for d in range(5000):
        sub = folder / f"{d // 500:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{d:05d}.txt").write_text("\n".join(lines[(d * 6) % len(lines):(d * 6) % len(lines) + 6]))
    prepared = tmp_path / "prepared"
    cfg = tmp_path / "many.toml"
    model = MODEL.replace("global_batch = 8", "global_batch = 64").replace("eval_sequences = 8", "eval_sequences = 64")
    model = model.replace("steps = 3", "steps = 8")
    cfg.write_text(model + f'\n[data]\nfiles = ["{folder}"]\nshard_mb = 0.002\nworkers = 2\nprepared = "{prepared}"\n')
    p = in_ulimit(256, [sys.executable, "-m", "trainscale", "prepare-data", "--config", str(cfg), "--json"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    index = json.loads((prepared / "index.json").read_text())
    n_shards = len(index["splits"]["train"]["shards"])
    assert len(index["sources"]) == 5000 and 256 < n_shards < 5000 / 5, n_shards  # many files a shard
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 5000  # a file a paragraph
    out = tmp_path / "run"
    p = in_ulimit(256, torchrun_command(cfg, "", out, 1))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step_time_s" in r] == list(range(1, 9))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts open files through /proc")
def test_shards_are_opened_on_demand_through_a_bounded_cache(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, int(rng.integers(1, 300)), dtype=np.uint16) for _ in range(300)]
    files = []
    for i, a in enumerate(parts):
        files.append(tmp_path / f"train-{i:05d}.npy")
        np.save(files[-1], a)
    whole = np.concatenate(parts)
    cache = shards.MapCache(max_open=8)
    stream = shards.TokenStream(files=files, lengths=[len(a) for a in parts], dtype="uint16", cache=cache)
    before, most = _open_fds(), 0
    for _ in range(2000):
        a = int(rng.integers(0, len(whole)))
        b = min(len(whole), a + int(rng.integers(0, 700)))
        assert np.array_equal(stream[a:b], whole[a:b])
        most = max(most, _open_fds() - before)
    assert most <= 8 and cache.opened > 300  # never more than the cache's maps; reopened as they are evicted
    with pytest.raises(TrainscaleError, match="re-run prepare-data"):
        shards.TokenStream(files=files[:1], lengths=[len(parts[0]) + 1], dtype="uint16")[0:1]


def test_a_format_1_folder_is_refused_in_one_sentence_and_rewritten_by_prepare(tmp_path, tok_file):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in corpus_text("train", 40_000).split("\n\n")))
    req = shards.DataRequest(files=(str(jsonl),), tokenizer=str(tok_file), folder=str(tmp_path / "p"))
    folder = shards.prepare(req, 512, tmp_path).folder
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps({**index, "version": 1, "hash": "old"}))
    with pytest.raises(TrainscaleError, match="format 1 of an earlier trainscale.*re-run prepare-data"):
        shards.ShardCorpus(folder).tokens("train")
    again = shards.prepare(req, 512, tmp_path)  # the old folder is prepare-data's own: rewritten in place
    assert again.index["version"] == shards.FORMAT_VERSION and again.index["hash"] == index["hash"]


# --------------------------------------------------------------------------- weighted mixtures


def _mixture(weights: list[float]) -> shards.MixtureStream:
    """Three components whose tokens tell them apart: component c holds ids in [100 c, 100 c + 100)."""
    rng = np.random.default_rng(1)
    comps = [shards.TokenStream([rng.integers(100 * c, 100 * c + 100, n, dtype=np.uint16) for n in (3000, 2000)])
             for c in range(3)]
    return shards.MixtureStream(comps, weights)


def _chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p / p.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_weighted_mixture_draws_its_weights():
    weights = np.array([0.5, 0.3, 0.2])
    loader = TokenLoader(_mixture(list(weights)), 16, 16, seed=7)
    counts = np.zeros(3, dtype=np.int64)
    for _ in range(500):
        x, _ = loader.next_batch()
        comp = x[:, 0].numpy() // 100
        assert np.array_equal(x.numpy() // 100, np.repeat(comp[:, None], 16, axis=1))  # a window is one component
        counts += np.bincount(comp, minlength=3)
    assert counts.sum() == 8000 and list(loader.drawn) == list(counts)
    # chi-square with 2 degrees of freedom: its CDF is 1 - exp(-x/2), so its p-quantile is -2 ln(1 - p)
    # (Abramowitz & Stegun 26.4.4, nu = 2); the draws must sit between the 0.1 % and 99.9 % quantiles
    lo, hi = -2 * math.log(1 - 0.001), -2 * math.log(0.001)
    chi2 = _chi_square(counts, weights)
    print(f"mixture 0.5/0.3/0.2 over 8,000 sequences: counts {counts.tolist()}, chi-square {chi2:.2f} "
          f"(bounds {lo:.4f} .. {hi:.2f})")
    assert lo < chi2 < hi
    assert _chi_square(counts, np.ones(3)) > 10 * hi  # the test can tell these weights from equal ones
    # and each component's windows are visited as a permutation: no window twice before all were read
    first = loader.comp_windows[2]
    seen = [loader.window(k, 2) for k in range(first)]
    assert sorted(seen) == list(range(first))


def test_a_mixture_resumes_exactly_under_another_dp():
    mix = _mixture([0.6, 0.1, 0.3])
    whole = TokenLoader(mix, 16, 8, seed=3)
    for _ in range(7):
        whole.next_batch()
    state = json.loads(json.dumps(whole.state_dict()))  # as a checkpoint's extras hold it (JSON)
    want = [whole.next_batch()[0].numpy() for _ in range(6)]
    for dp in (1, 2, 4):
        ranks = [TokenLoader(mix, 16, 8, dp_rank=r, dp=dp, seed=3) for r in range(dp)]
        for r in ranks:
            r.load_state_dict(state)
        for step in range(6):
            got = np.concatenate([r.next_batch()[0].numpy() for r in ranks])
            assert np.array_equal(got, want[step]), (dp, step)
    fresh = TokenLoader(mix, 16, 8, seed=3)  # without the state: another position, other batches
    assert not np.array_equal(fresh.next_batch()[0].numpy(), want[0])
    with pytest.raises(TrainscaleError, match="without a mixture"):
        TokenLoader(mix, 16, 8, seed=3).load_state_dict({"sequences": 8, "seed": 3, "seq_len": 16,
                                                          "windows": whole.n_windows})


def test_data_sources_in_a_config_prepare_a_mixture(tmp_path, tok_file):
    """``[[data.sources]]`` of two .npy token files: one prepared folder, the train split drawn 0.8 / 0.2."""
    rng = np.random.default_rng(2)
    for name, lo in (("a", 10), ("b", 300)):
        docs = [np.append(rng.integers(lo, lo + 150, int(rng.integers(20, 200))), 0) for _ in range(400)]
        np.save(tmp_path / f"{name}.npy", np.concatenate(docs).astype(np.int32))
    cfg = tmp_path / "mix.toml"
    cfg.write_text(MODEL + f'\n[data]\ntokenizer = "{tok_file}"\nprepared = "{tmp_path / "p"}"\nshard_mb = 0.02\n'
                   f'[[data.sources]]\nfiles = ["{tmp_path / "a.npy"}"]\nweight = 4\nname = "low"\n'
                   f'[[data.sources]]\nfiles = "{tmp_path / "b.npy"}"\n')
    config = load_config(cfg)
    assert load_config(cfg).to_toml().count("[[data.sources]]") == 2
    corpus = corpus_for(config)
    stream = corpus.tokens("train")
    assert isinstance(stream, shards.MixtureStream) and stream.weights == [4.0, 1.0]
    assert stream.names == ["low", "source 2"] and len(corpus.index["splits"]["train"]["shards"]) > 2
    loader = TokenLoader(stream, 32, 8, seed=0)
    first = np.concatenate([loader.next_batch()[0][:, 1].numpy() for _ in range(100)])
    share = float(np.mean(first[first != 0] < 300))
    assert 0.75 < share < 0.85, share  # 800 sequences at p = 0.8: sigma 0.014, +- 3.5 sigma
    bad = tmp_path / "both.toml"
    bad.write_text(MODEL + f'\n[data]\nfiles = ["{tmp_path / "a.npy"}"]\n[[data.sources]]\nfiles = ["x"]\n')
    with pytest.raises(TrainscaleError, match="not both"):
        load_config(bad)


# --------------------------------------------------------------------------- token ids people already have


def write_megatron(prefix: Path, docs: list[list[np.ndarray]], code: int, dtype) -> None:
    """An MMIDIDX pair written from the format's description (see pretokenized.py): ``docs``, each a list of
    sequences; the .bin their tokens back to back."""
    seqs = [s for d in docs for s in d]
    sizes = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<i8") * np.dtype(dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    with open(prefix.with_suffix(".bin"), "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def _documents_of(corpus: shards.ShardCorpus, split: str) -> list[list[int]]:
    ids = corpus.tokens(split)
    ids = ids[0:len(ids)]
    ends = corpus.documents(split)
    assert len(ends) == corpus.index["splits"][split]["documents"] and (len(ends) == 0 or ends[-1] == len(ids))
    return [x.tolist() for x in np.split(ids, ends[:-1])]


@pytest.mark.parametrize(("code", "dtype"), [(4, np.int32), (8, np.uint16)])
def test_megatron_bin_idx_reads_back_the_tokens_written(tmp_path, tok_file, code, dtype):
    rng = np.random.default_rng(code)
    docs = [[rng.integers(1, 512, int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 4)))]
            for _ in range(300)]
    write_megatron(tmp_path / "corpus_text_document", docs, code, dtype)
    index = pretokenized.read_megatron(tmp_path / "corpus_text_document.bin")
    flat = np.concatenate([s for d in docs for s in d])
    assert index.dtype == np.dtype(dtype) and index.documents == 300
    assert np.array_equal(index.tokens(0, 300), flat)
    assert np.array_equal(index.tokens(17, 18), np.concatenate(docs[17]))

    req = shards.DataRequest(files=(str(tmp_path / "corpus_text_document.idx"),), tokenizer=str(tok_file),
                             settings=sources.Settings(unit_bytes=1 << 30), folder=str(tmp_path / "p"))
    corpus = shards.prepare(req, 512, tmp_path)
    held = sources.Settings().held_mask("0:0", 300)  # one piece, from document 0
    want = [np.concatenate(d).tolist() + [0] for d in docs]  # each document closed by the end-of-text id 0
    assert _documents_of(corpus, "train") == [w for w, h in zip(want, held, strict=True) if not h]
    assert _documents_of(corpus, "val") == [w for w, h in zip(want, held, strict=True) if h]


def test_a_corrupt_megatron_index_is_refused_in_one_sentence(tmp_path, tok_file, capsys, monkeypatch):
    from trainscale import cli

    docs = [[np.arange(1, 30)], [np.arange(5, 9), np.arange(2, 20)]]
    write_megatron(tmp_path / "good", docs, 4, np.int32)
    raw = bytearray((tmp_path / "good.idx").read_bytes())

    def refused(name: str, data: bytes, bin_bytes: bytes | None = None) -> str:
        (tmp_path / f"{name}.idx").write_bytes(data)
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "good.bin").read_bytes() if bin_bytes is None
                                               else bin_bytes)
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(MODEL + f'\n[data]\nfiles = ["{tmp_path / name}.bin"]\ntokenizer = "{tok_file}"\n'
                       f'prepared = "{tmp_path / ("p-" + name)}"\n')
        monkeypatch.setattr(sys, "argv", ["trainscale", "prepare-data", "--config", str(cfg), "--json"])
        with pytest.raises(SystemExit) as e:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0, err
        assert not (tmp_path / f"p-{name}").exists()
        return err

    big = bytearray(raw)
    big[34:38] = struct.pack("<i", 1000)  # the first sequence's size: far beyond the .bin
    err = refused("big", bytes(big))
    assert "has sizes totalling 1,022 int32 tokens (4,088 bytes), but big.bin holds 204 bytes" in err, err
    short = refused("short", bytes(raw), (tmp_path / "good.bin").read_bytes()[:-4])
    assert "but short.bin holds 200 bytes" in short
    floats = bytearray(raw)
    floats[17] = 7
    assert "holds float32 values (dtype code 7), not token ids" in refused("floats", bytes(floats))
    assert "does not start with the MMIDIDX magic" in refused("magic", b"NOTMAGIC\x00" + bytes(raw[9:]))
    assert "need" in refused("cut", bytes(raw[:-8]))  # the document index cut short: lengths disagree
    ids = bytearray((tmp_path / "good.bin").read_bytes())
    ids[8:12] = struct.pack("<i", 9999)
    assert "holds token id 9,999" in refused("ids", bytes(raw), bytes(ids))


def test_numpy_token_files_read_back_the_tokens_written(tmp_path, tok_file):
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(1, 512, int(rng.integers(1, 60))), 0) for _ in range(250)]
    np.save(tmp_path / "stream.npy", np.concatenate(docs).astype(np.uint16))  # 1-D: documents end with eot 0
    rows = rng.integers(1, 512, (40, 24)).astype(np.int64)
    np.save(tmp_path / "rows.npy", rows)  # 2-D: a document per row, eot added
    req = shards.DataRequest(files=(str(tmp_path / "stream.npy"), str(tmp_path / "rows.npy")),
                             tokenizer=str(tok_file), settings=sources.Settings(unit_bytes=1 << 30),
                             folder=str(tmp_path / "p"))
    corpus = shards.prepare(req, 512, tmp_path)
    held = sources.held_masks(sources.Settings(), ["0:0", "1:0"], [250, 40])
    want = [d.tolist() for d in docs] + [r.tolist() + [0] for r in rows]
    assert _documents_of(corpus, "train") == [w for w, h in zip(want, held, strict=True) if not h]
    assert _documents_of(corpus, "val") == [w for w, h in zip(want, held, strict=True) if h]
    assert corpus.index["splits"]["train"]["shards"][0]["file"] == "train-00000.npy"  # both files, one shard

    np.save(tmp_path / "objects.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(TrainscaleError, match="holds object, not integer token ids"):
        pretokenized.read_npy(tmp_path / "objects.npy")
    np.save(tmp_path / "wide.npy", np.array([1, 2, 600, 0], dtype=np.int32))
    with pytest.raises(TrainscaleError, match="holds token id 600 .* outside the tokenizer's vocabulary of 512"):
        shards.prepare(shards.DataRequest(files=(str(tmp_path / "wide.npy"),), tokenizer=str(tok_file),
                                          folder=str(tmp_path / "w")), 512, tmp_path)
    (tmp_path / "cut.npy").write_bytes((tmp_path / "stream.npy").read_bytes()[:-6])
    with pytest.raises(TrainscaleError, match="cut.npy is .* bytes, but its header's"):
        pretokenized.read_npy(tmp_path / "cut.npy")
    with pytest.raises(TrainscaleError, match="holds token ids already; name the tokenizer"):
        shards.prepare(shards.DataRequest(files=(str(tmp_path / "stream.npy"),), folder=str(tmp_path / "n")),
                       512, tmp_path)
