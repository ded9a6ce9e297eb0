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

    A weighted mixture (``tokens`` a shards.MixtureStream: components and weights) draws the component of the
    k-th sequence from a counter-based hash of (seed, k) against the cumulative weights, and reads that
    component's next window (its own windows, permuted per epoch from (seed, component, epoch)). The position
    is then ``sequences`` and the sequences drawn so far from each component (``drawn``): every rank computes
    the draws of the whole global batch, so the state stays global and the same on every rank.

    ``documents``: packed documents are kept apart (``[data] document_mask``, chat data): a batch is then
    (inputs, targets, positions), ``document_batch``'s, with ``flags`` (chat data's per-token flags, laid out as
    ``tokens``) or else documents ending at the end-of-text token ``eot``.
    """

    def __init__(self, tokens, seq_len: int, global_batch: int, dp_rank: int = 0, dp: int = 1,
                 seed: int = 0, flags=None, eot: int | None = None, documents: bool = False) -> None:
        import numpy as np

        if global_batch % dp:
            raise TrainscaleError(f"global_batch {global_batch} is not divisible by dp {dp}")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.dp_rank, self.dp, self.seed = dp_rank, dp, seed
        self.documents, self.eot = documents or flags is not None, eot
        self.flag_streams = list(getattr(flags, "components", None) or [flags]) if flags is not None else None
        self.streams = list(getattr(tokens, "components", None) or [tokens])
        self.mixture = len(self.streams) > 1
        self.comp_windows = [(len(t) - 1) // seq_len for t in self.streams]
        self.n_windows = sum(self.comp_windows)
        if self.mixture:
            self._check_mixture(tokens)
            w = np.asarray(tokens.weights, dtype=np.float64)
            self.cum_weights = np.cumsum(w / w.sum())
        if self.n_windows < global_batch:
            raise TrainscaleError(f"the corpus has {self.n_windows} windows of {seq_len} tokens, fewer than "
                                  f"one global batch ({global_batch})")
        self.sequences = 0
        self.drawn = np.zeros(len(self.streams), dtype=np.int64)  # sequences read from each component so far
        self._perms: dict[tuple[int, int], object] = {}

    def _check_mixture(self, tokens) -> None:
        for name, n, w in zip(tokens.names, self.comp_windows, tokens.weights, strict=True):
            if n < 1 and w > 0:
                raise TrainscaleError(f"mixture source {name or '?'} has no window of {self.seq_len + 1} tokens; "
                                      "give it more text or a smaller seq_len")
        if any(not (w >= 0) for w in tokens.weights) or sum(tokens.weights) <= 0:
            raise TrainscaleError(f"mixture weights {list(tokens.weights)} must be >= 0 with a positive sum")

    def _order(self, epoch: int, comp: int = 0):
        import numpy as np

        key = (comp, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:
                self._perms.clear()
            rng = np.random.default_rng(self.seed + epoch) if not self.mixture \
                else np.random.default_rng([self.seed, comp, epoch])
            self._perms[key] = rng.permutation(self.comp_windows[comp])
        return self._perms[key]

    def window(self, k: int, comp: int = 0) -> int:
        """The window the k-th sequence read from component ``comp`` (counted from 0 over the whole job) reads."""
        n = self.comp_windows[comp]
        return int(self._order(k // n, comp)[k % n])

    def components(self, first: int, count: int):
        """The mixture component of sequences ``first .. first + count`` of the run (int64 array)."""
        import numpy as np

        from trainscale.runtime.data.sources import splitmix64

        k = np.arange(first, first + count, dtype=np.uint64)
        z = splitmix64(np.uint64(self.seed & (2**64 - 1)) ^ np.uint64(0x5DEECE66D), k)  # a seed apart from held-out's
        u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform in [0, 1), 53 bits
        return np.minimum(np.searchsorted(self.cum_weights, u, side="right"), len(self.streams) - 1)

    def _plan(self, first: int, count: int) -> list[tuple[int, int]]:
        """(component, window) of the run's sequences ``first .. first + count``, ``first`` being the position."""
        if not self.mixture:
            return [(0, self.window(k)) for k in range(first, first + count)]
        comps = self.components(first, count)
        seen = self.drawn.copy()
        out = []
        for c in comps.tolist():
            out.append((c, self.window(int(seen[c]), c)))
            seen[c] += 1
        return out

    def window_ids(self, batch: int) -> list[int]:
        """This rank's windows in global batch ``batch`` (counted in this loader's global batches; a mixture:
        the next batch only, ``batch * global_batch`` being the position)."""
        local = self.global_batch // self.dp
        if self.mixture:
            return [w for _, w in self._plan(batch * self.global_batch, self.global_batch)
                    ][self.dp_rank * local:(self.dp_rank + 1) * local]
        first = batch * self.global_batch + self.dp_rank * local
        return [self.window(k) for k in range(first, first + local)]

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """-> (inputs, targets), each [global_batch / dp, seq_len] int64; with ``documents``, (inputs, targets,
        positions) (``document_batch``)."""
        import numpy as np

        local = self.global_batch // self.dp
        plan = self._plan(self.sequences, self.global_batch)
        x = np.empty((local, self.seq_len + 1), dtype=np.int64)
        f = np.empty((local, self.seq_len + 1), dtype=np.uint8) if self.flag_streams is not None else None
        for row, (c, win) in enumerate(plan[self.dp_rank * local:(self.dp_rank + 1) * local]):
            w = win * self.seq_len
            x[row] = self.streams[c][w: w + self.seq_len + 1]
            if f is not None:
                f[row] = self.flag_streams[c][w: w + self.seq_len + 1]
        for c, _ in plan:
            self.drawn[c] += 1
        self.sequences += self.global_batch
        if self.documents:
            return document_batch(x, f, self.eot)
        t = torch.from_numpy(x)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict:
        state = {"sequences": self.sequences, "seed": self.seed, "seq_len": self.seq_len, "windows": self.n_windows}
        if self.mixture:
            state.update(drawn=[int(d) for d in self.drawn], component_windows=list(self.comp_windows),
                         weights=[float(w) for w in self.tokens.weights])
        return state

    def load_state_dict(self, state: dict) -> None:
        for k, mine in (("seed", self.seed), ("seq_len", self.seq_len), ("windows", self.n_windows)):
            if k in state and int(state[k]) != mine:
                what = "corpus windows" if k == "windows" else k
                raise TrainscaleError(f"the data position was saved with {what}={state[k]}, not {mine}: "
                                      "resume needs the same corpus, seed and seq_len")
        if self.mixture != ("drawn" in state):
            raise TrainscaleError("the data position was saved " + ("without" if self.mixture else "with")
                                  + " a mixture of sources: resume needs the same [data] sources")
        if self.mixture and list(state.get("component_windows", [])) != list(self.comp_windows):
            raise TrainscaleError(f"the data position was saved with mixture windows {state.get('component_windows')}"
                                  f", not {self.comp_windows}: resume needs the same corpus and seq_len")
        if "sequences" in state:
            self.sequences = int(state["sequences"])
        else:  # a checkpoint from before the position was global: batches of the saved global batch
            self.sequences = int(state["batches"]) * int(state.get("global_batch", self.global_batch))
        if self.mixture:  # the weights may change on resume: the counts keep every component's place
            self.drawn[:] = [int(d) for d in state["drawn"]]


def document_batch(x, f, eot: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows of packed documents, x [n, seq_len + 1] token ids and f (chat data) their flags or None ->
    (inputs, targets, positions), each [n, seq_len] int64: a target is IGNORE (-100, F.cross_entropy's
    ignore_index) where its flags lack LEARNED (chat: all but the assistant's words and end-of-turn), and
    positions restart at 0 at each document's first token (DOC_START; for text, the token after an end-of-text
    token ``eot``) and at the window's first, so the model keeps documents apart (runtime/model.document_mask)."""
    import numpy as np

    from trainscale.runtime.data.shards import DOC_START, LEARNED
    from trainscale.runtime.model import IGNORE

    inputs, targets = x[:, :-1], x[:, 1:].copy()
    n, s = inputs.shape
    if f is not None:
        targets[(f[:, 1:] & LEARNED) == 0] = IGNORE
        starts = (f[:, :-1] & DOC_START) != 0
    else:
        starts = np.zeros((n, s), dtype=bool)
        if eot is not None:
            starts[:, 1:] = inputs[:, :-1] == eot
    starts[:, 0] = True
    steps = np.arange(s, dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, steps, 0), axis=1)
    return (torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(targets),
            torch.from_numpy(steps - last_start))


def eval_windows(tokens, seq_len: int, n: int, flags=None, eot: int | None = None,
                 documents: bool = False) -> tuple[torch.Tensor, ...]:
    """The first ``n`` windows of held-out text: (inputs, targets) [n, seq_len]; with ``documents`` (or chat
    data's ``flags``), (inputs, targets, positions) as ``document_batch`` makes them."""
    import numpy as np

    n = min(n, (len(tokens) - 1) // seq_len)
    if documents or flags is not None:
        idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
        x = np.asarray(tokens[: n * seq_len + 1], dtype=np.int64)[idx]
        f = np.asarray(flags[: n * seq_len + 1], dtype=np.uint8)[idx] if flags is not None else None
        return document_batch(x, f, eot)
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
    t = targets.flatten().numpy()
    return float(-logp[t[t >= 0]].mean())  # targets not learned (IGNORE, -100) left out
