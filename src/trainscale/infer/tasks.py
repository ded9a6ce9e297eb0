"""Multiple-choice log-likelihood tasks from a local JSONL file, scored as lm-evaluation-harness scores them.

A task file holds one example per line: ``{"context": str, "choices": [str, ...], "gold": int}`` (``query`` is
read as ``context`` and ``label`` as ``gold``, the names lm-eval's own multiple-choice datasets use). Each choice is
scored as lm-eval 0.4's ``multiple_choice`` output type scores it (Gao et al. 2024, "The Language Model Evaluation
Harness"; code: lm_eval/api/task.py ``construct_requests`` and ``process_results``, lm_eval/api/model.py
``_encode_pair``, lm_eval/models/huggingface.py ``_loglikelihood_tokens``):

- the continuation is the target delimiter (" ") and the choice; trailing whitespace of the context moves to the
  front of the continuation; context + continuation is tokenised whole, the context alone, and the continuation's
  tokens are the whole's past the context's (so a merge across the boundary counts for the choice);
- its log-likelihood is the sum of the log-probabilities of those tokens given everything before them, the input
  left-truncated to the model's last ``max_seq_len`` + 1 tokens;
- ``acc``: the choice of highest log-likelihood is the gold one (the first on a tie, numpy's argmax);
  ``acc_norm``: the same with each log-likelihood divided by its choice's length in characters (len of the
  Python string, without the delimiter: lm-eval's ``completion_len``; bytes are its separate ``acc_bytes``);
- each metric's standard error is the sample standard deviation over the examples / sqrt(n) (lm_eval/api/metrics.py
  ``mean_stderr``).

Every input is bounded before it is processed: the file (``MAX_TASK_FILE_BYTES``), a line (``MAX_TASK_LINE_BYTES``),
the rows (``MAX_TASK_ROWS``) and the choices of a row (``MAX_CHOICES``); a bad row is one sentence naming its line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import TrainscaleError
from trainscale.safeio import parse_json, read_bytes

MAX_TASK_FILE_BYTES = 64 << 20  # a benchmark's test split (HellaSwag's 10k rows: 10 MB) many times over
MAX_TASK_LINE_BYTES = 1 << 20  # one example: a context and its choices, kilobytes
MAX_TASK_ROWS = 100_000
MAX_CHOICES = 64
TARGET_DELIMITER = " "  # lm-eval's TaskConfig.target_delimiter default
BATCH_TOKENS = 8192  # tokens per forward pass (padded); at least one request per pass


@dataclass(frozen=True)
class TaskRow:
    """One example: its context, its choices and the index of the right one; ``line``: where the file holds it."""

    context: str
    choices: tuple[str, ...]
    gold: int
    line: int


def read_tasks(path: str | Path) -> list[TaskRow]:
    """The examples of a task file (JSONL), every row checked; one sentence naming the line of a bad one."""
    data = read_bytes(path, "task file", MAX_TASK_FILE_BYTES)
    rows = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(raw) > MAX_TASK_LINE_BYTES:
            raise TrainscaleError(f"task file {path} line {n} is {len(raw):,} bytes, more than an example's "
                                  f"{MAX_TASK_LINE_BYTES:,}")
        if len(rows) == MAX_TASK_ROWS:
            raise TrainscaleError(f"task file {path} holds more than {MAX_TASK_ROWS:,} examples; split it")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TrainscaleError(f"task file {path} line {n} is not UTF-8 text (byte {e.start})") from None
        rows.append(task_row(parse_json(text, f"task file {path} line {n}"), f"task file {path} line {n}", n))
    if not rows:
        raise TrainscaleError(f"task file {path} holds no example (one JSON object a line: context, choices, gold)")
    return rows


def _field(obj: dict[str, Any], names: tuple[str, ...], where: str) -> Any:
    got = [k for k in names if k in obj]
    if len(got) != 1:
        which = " or ".join(repr(k) for k in names)
        raise TrainscaleError(f"{where} needs {'one' if not got else 'only one'} of {which}")
    return obj[got[0]]


def task_row(obj: Any, where: str, line: int = 0) -> TaskRow:
    """One example from its JSON value: a non-blank context, 2 to MAX_CHOICES non-empty choices, a gold index."""
    if not isinstance(obj, dict):
        raise TrainscaleError(f"{where} is not a JSON object (it holds a {type(obj).__name__})")
    context = _field(obj, ("context", "query"), where)
    choices = _field(obj, ("choices",), where)
    gold = _field(obj, ("gold", "label"), where)
    if not isinstance(context, str) or not context.strip():
        raise TrainscaleError(f"{where}: the context must be a string with text (not blank), not {context!r:.60}")
    if not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES \
            or not all(isinstance(c, str) and c for c in choices):
        raise TrainscaleError(f"{where}: choices must be a list of 2 to {MAX_CHOICES} non-empty strings")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise TrainscaleError(f"{where}: gold must be the index of the right choice, 0 to {len(choices) - 1}, "
                              f"not {gold!r:.60}")
    return TaskRow(context, tuple(choices), gold, line)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's ``_encode_pair`` makes them for a causal model: trailing
    whitespace of the context moved to the continuation, the whole encoded, the continuation the tokens past the
    context's own encoding. ``tok``: a ``tokenizers.Tokenizer`` (special tokens added as its post-processor says,
    as transformers' ``encode`` does by default)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation).ids
    ctx = tok.encode(context).ids
    return ctx, whole[len(ctx):]


@dataclass(frozen=True)
class Request:
    row: int
    choice: int
    ids: list[int]  # context + continuation, left-truncated to max_seq_len + 1 tokens
    n_cont: int
    truncated: bool


def requests_of(rows: list[TaskRow], tok, max_seq_len: int, vocab: int) -> list[Request]:
    """One request per (example, choice), encoded and left-truncated as lm-eval does."""
    out = []
    for i, r in enumerate(rows):
        for j, c in enumerate(r.choices):
            ctx, cont = encode_pair(tok, r.context, TARGET_DELIMITER + c)
            if not ctx or not cont:
                raise TrainscaleError(f"task line {r.line}: choice {j} encodes to no token of its own")
            if len(cont) > max_seq_len:
                raise TrainscaleError(f"task line {r.line}: choice {j} is {len(cont):,} tokens, longer than the "
                                      f"model's {max_seq_len:,}-token window")
            if max(ctx + cont) >= vocab:
                raise TrainscaleError(f"task line {r.line}: the tokenizer gives ids past the model's vocabulary "
                                      f"({vocab:,}); the tokenizer is not the model's")
            ids = ctx + cont
            out.append(Request(i, j, ids[-(max_seq_len + 1):], len(cont), len(ids) > max_seq_len + 1))
    return out


def loglikelihoods(model, requests: list[Request], batch_tokens: int = BATCH_TOKENS) -> list[float]:
    """Summed log-probability of each request's continuation tokens; requests sorted longest first and run in
    right-padded batches of at most ``batch_tokens`` tokens (a causal model's earlier positions never see the
    padding after them)."""
    import torch  # here: a bad task file is refused before torch is imported

    with torch.no_grad():
        return _loglikelihoods(model, requests, batch_tokens)


def _loglikelihoods(model, requests: list[Request], batch_tokens: int) -> list[float]:
    import torch

    device = next(model.parameters()).device
    order = sorted(range(len(requests)), key=lambda k: -len(requests[k].ids))
    out = [0.0] * len(requests)
    i = 0
    while i < len(order):
        width = len(requests[order[i]].ids) - 1
        group = order[i:i + max(1, batch_tokens // max(width, 1))]
        i += len(group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        for b, k in enumerate(group):
            inp = requests[k].ids[:-1]
            x[b, :len(inp)] = torch.tensor(inp)
        logp = torch.log_softmax(model(x.to(device)).float(), dim=-1)
        for b, k in enumerate(group):
            r = requests[k]
            n_in = len(r.ids) - 1
            cont = torch.tensor(r.ids[-r.n_cont:], device=device)
            out[k] = float(logp[b, n_in - r.n_cont:n_in].gather(-1, cont[:, None]).sum())
    return out


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda k: (xs[k], -k))  # the first of equal maxima, as numpy's argmax


def mean_stderr(xs: list[float]) -> float | None:
    """lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n); None for fewer than two values."""
    if len(xs) < 2:
        return None
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) / math.sqrt(len(xs))


def score_tasks(model, tok, rows: list[TaskRow], max_seq_len: int, vocab: int,
                batch_tokens: int = BATCH_TOKENS) -> dict[str, Any]:
    """acc and acc_norm (with their standard errors) of ``model`` on ``rows``, and each example's prediction."""
    reqs = requests_of(rows, tok, max_seq_len, vocab)
    lls = loglikelihoods(model, reqs, batch_tokens)
    per: list[list[float]] = [[0.0] * len(r.choices) for r in rows]
    for q, ll in zip(reqs, lls, strict=True):
        per[q.row][q.choice] = ll
    preds = []
    for r, ll in zip(rows, per, strict=True):
        pred, pred_norm = _argmax(ll), _argmax([v / len(c) for v, c in zip(ll, r.choices, strict=True)])
        preds.append({"line": r.line, "gold": r.gold, "pred": pred, "pred_norm": pred_norm,
                      "acc": float(pred == r.gold), "acc_norm": float(pred_norm == r.gold), "loglikelihoods": ll})
    acc = [p["acc"] for p in preds]
    norm = [p["acc_norm"] for p in preds]
    return {"examples": len(rows), "requests": len(reqs), "truncated_requests": sum(q.truncated for q in reqs),
            "acc": sum(acc) / len(acc), "acc_stderr": mean_stderr(acc),
            "acc_norm": sum(norm) / len(norm), "acc_norm_stderr": mean_stderr(norm), "predictions": preds}


def evaluate_tasks(checkpoint: str | Path, path: str | Path, batch_tokens: int = BATCH_TOKENS) -> dict[str, Any]:
    """``score_tasks`` of any model folder infer/ loads on the task file ``path`` (read and checked first, before
    the model's folder is looked at), with what was scored: the model, the file, the window, the seconds."""
    import time

    rows = read_tasks(path)
    from trainscale.infer.load import folder_kind, load_for_inference, load_tokenizer_for, source_folder, spec_of

    folder = source_folder(checkpoint)
    spec = spec_of(folder)
    tok = load_tokenizer_for(folder)
    model, spec, folder = load_for_inference(folder)
    t0 = time.perf_counter()
    got = score_tasks(model, tok, rows, spec.max_seq_len, spec.vocab_size, batch_tokens)
    return {"model": str(folder), "model_kind": folder_kind(folder), "name": spec.name, "tasks": str(path),
            "max_seq_len": spec.max_seq_len, "target_delimiter": TARGET_DELIMITER, **got,
            "seconds": time.perf_counter() - t0,
            "metrics": "acc: the highest summed log-likelihood is the gold choice; acc_norm: the same per character "
                       "of the choice (lm-evaluation-harness's multiple_choice); stderr: sample std / sqrt(n)"}
