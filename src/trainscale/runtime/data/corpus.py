"""The corpus a run trains on, composed from the pipeline's parts (sources, tokenizer, shards, loader).

A user's corpus (``[data] files``, or the plays with a loaded tokenizer) is tokenised into memory-mapped
shards by shards.py (``trainscale prepare-data``); ``corpus_for`` returns those shards, or else the default:
the Shakespeare plays (sources.corpus_text), split by play, with a byte-level BPE trained on the train split
and both splits tokenised once into a cache folder (``prepare_corpus``). Either is read by loader.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.sources import HELD_OUT_EVERY, corpus_files, corpus_text
from trainscale.runtime.data.tokenizer import load_tokenizer, train_bpe


def cache_root() -> Path:
    """Where tokenizers and token ids are cached: $TRAINSCALE_CACHE, else ~/.cache/trainscale."""
    import os

    return Path(os.environ.get("TRAINSCALE_CACHE") or Path.home() / ".cache" / "trainscale")


@dataclass(frozen=True)
class Corpus:
    """A trained tokenizer and the corpus as token ids (train and held-out), on disk."""

    folder: Path

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / "tokenizer.json"

    def tokens(self, split: str):

        from trainscale.runtime.data.pretokenized import read_npy

        return read_npy(self.folder / f"{split}.npy").array()  # a regular file: a FIFO there is refused

    @property
    def vocab_size(self) -> int:
        return load_tokenizer(self.tokenizer_path).get_vocab_size()

    def unigram_counts(self):
        import numpy as np

        return np.bincount(np.asarray(self.tokens("train")), minlength=self.vocab_size)


def check_data(cfg) -> None:
    """The config's data, checked before any run folder or shard is touched (a wrong data path must be named as
    such, not as a run folder's conflict): every file, glob and folder it names exists and holds input files, its
    tokenizer path exists, and chat data has a tokenizer folder with the chat template (``[model] init``'s, when
    that folder has one), and the folder the shards go to can be written. One sentence (TrainscaleError)
    otherwise; reads no file's contents."""
    import os

    d = cfg.data
    if d.format == "chat" and d.tokenizer is None:
        if cfg.init is not None:
            raise TrainscaleError(f"[data] format = \"chat\" needs the model's tokenizer and chat template, and "
                                  f"[model] init {cfg.init} has no tokenizer.json; copy the model's tokenizer files "
                                  "there or set [data] tokenizer = \"FOLDER\"")
        raise TrainscaleError("[data] format = \"chat\" needs the model's tokenizer folder with its chat template: "
                              "set [data] tokenizer = \"FOLDER\", or [model] init")
    if d.tokenizer is not None and not os.path.lexists(Path(d.tokenizer).expanduser()):
        raise TrainscaleError(f"[data] tokenizer {d.tokenizer} does not exist")
    from trainscale.safeio import check_output

    if d.prepared is not None:  # where the shards are written: refused before anything is read
        check_output(Path(d.prepared).expanduser(), "[data] prepared", folder=True)
    else:
        check_output(Path(d.cache) if d.cache else cache_root(), "[data] cache" if d.cache else "the cache folder "
                     "($TRAINSCALE_CACHE)", folder=True)
    req = d.request()
    if req is not None and (d.files or d.sources):
        from trainscale.runtime.data.shards import resolve_request

        resolve_request(req)


def corpus_for(cfg, progress=None, log=lambda _m: None):
    """The tokenised corpus a TrainConfig asks for: the user's shards (prepared now if they are not yet,
    a no-op if they are), or the Shakespeare plays. -> Corpus or shards.ShardCorpus (same interface)."""
    check_data(cfg)
    cache = Path(cfg.data.cache) if cfg.data.cache else None
    req = cfg.data.request()
    if req is not None:
        from trainscale.runtime.data.shards import prepare

        corpus = prepare(req, cfg.model.vocab_size, cache or cache_root(), progress=progress, log=log)
        if corpus.vocab_size > cfg.model.vocab_size:
            raise TrainscaleError(f"the prepared corpus {corpus.folder} has a vocabulary of {corpus.vocab_size:,} "
                                  f"tokens, more than the model's vocab_size {cfg.model.vocab_size:,}")
        return corpus
    return prepare_corpus(cfg.tokenizer_vocab, cfg.data.max_chars, cache)


def prepare_corpus(vocab_size: int, max_chars: int | None = None, cache: Path | None = None) -> Corpus:
    """Train the tokenizer on the train split (its first ``max_chars`` characters) and tokenise both
    splits, once: the result is cached under a folder named by its inputs, written aside and renamed
    into place, so concurrent runs never see half a cache."""
    import os
    import shutil

    import numpy as np

    names = ",".join(f.name for f in corpus_files())
    key = hashlib.sha256(f"{names}|{vocab_size}|{max_chars}|{HELD_OUT_EVERY}".encode()).hexdigest()[:12]
    folder = (cache or cache_root()) / f"corpus-v{vocab_size}-{max_chars or 'all'}-{key}"
    if (folder / "val.npy").exists():
        return Corpus(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    train_text = corpus_text("train", max_chars)
    tok = train_bpe([train_text], vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise TrainscaleError(f"the tokenizer learned {tok.get_vocab_size()} tokens, not the model's vocab_size "
                              f"{vocab_size}; use a smaller vocab_size")
    tok.save(str(tmp / "tokenizer.json"))
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    for split, text in (("train", train_text), ("val", corpus_text("val", max_chars and max_chars // 10))):
        paragraphs = text.split("\n\n")
        ids = [i for enc in tok.encode_batch([p + "\n\n" for p in paragraphs]) for i in enc.ids]
        np.save(tmp / f"{split}.npy", np.asarray(ids, dtype=dtype))
    try:
        os.rename(tmp, folder)
    except OSError:  # another process got there first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return Corpus(folder)
