"""What training reads from a tokenised corpus: deterministic batches of windows sharded over data-parallel
ranks (``TokenLoader``), the held-out windows of an evaluation, and the unigram baseline loss to beat."""

from __future__ import annotations

import torch

from trainscale.errors import TrainscaleError


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
