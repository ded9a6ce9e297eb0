"""Your own data, measured: what `prepare-data` costs over tokenising alone, and what reading the shards
costs a training step.

1. Throughput. A JSONL corpus (the Shakespeare plays' paragraphs, repeated with a line number to reach
   ``--mb`` megabytes) and a byte-level BPE loaded from a file (trained once, beforehand: tokenizer
   training is not part of either figure). The baseline is the tokenizer's own batch encode alone
   (``encode_batch_fast`` on every document, already in memory, in the pipeline's batches, with as many
   threads as the pipeline has worker processes, reading each encoding's ids); the pipeline is
   ``prepare`` from scratch with that many workers: hashing the inputs, starting the workers, reading
   and parsing the JSONL, splitting by document, encoding, packing, writing the shards, counting
   unigrams, the index. Each runs in a fresh process with as many tokenizer threads as workers. The
   two alternate ``--repeats`` times, best of each, in wall time and in CPU time (all threads and
   worker processes: steadier on a shared machine); the pipeline's overhead is
   time(pipeline) / time(encode alone) - 1 (target <= 20 %).
2. The loader's share of a step. configs/small.toml's model trained single-process on those shards: the
   median step time (train_step, loader included) against the median time of the loader's
   ``next_batch`` alone for the same batches (target <= 1 %).

    .venv/bin/python benchmarks/bench_data.py [--mb 32] [--workers 2] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_corpus(folder: Path, mb: float) -> tuple[Path, list[str]]:
    from trainscale.runtime.data.sources import corpus_text

    paragraphs = [p for split in ("train", "val") for p in corpus_text(split).split("\n\n") if p.strip()]
    docs, size, i = [], 0, 0
    while size < mb * 1e6:
        doc = f"{i}. {paragraphs[i % len(paragraphs)]}"
        docs.append(doc)
        size += len(doc.encode()) + 12
        i += 1
    path = folder / "corpus.jsonl"
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return path, docs


def encode_alone(tok_path: Path, docs: list[str], threads: int, repeats: int) -> tuple[float, float, int]:
    """Best time of the tokenizer's batch encode over all documents, in the batches the pipeline uses
    (runtime/data/tokenizer.py BATCH_CHARS / BATCH_DOCS), in a fresh process with ``threads`` rayon threads (the
    setting is read once per process); the documents are in memory before the clock starts."""
    import subprocess

    from trainscale.runtime.data.tokenizer import BATCH_CHARS, BATCH_DOCS

    code = f"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file({str(tok_path)!r})
docs = [json.loads(x)["text"] for x in open(sys.argv[1])]
batches, cur, size = [], [], 0
for d in docs:
    cur.append(d)
    size += len(d)
    if size >= {BATCH_CHARS} or len(cur) >= {BATCH_DOCS}:
        batches.append(cur)
        cur, size = [], 0
batches.append(cur)
best, cpu = 1e9, 1e9
for _ in range({repeats}):
    t, c = time.perf_counter(), time.process_time()
    n = 0
    for b in batches:
        n += sum(len(e.ids) for e in tok.encode_batch_fast(b, add_special_tokens=False))
    best, cpu = min(best, time.perf_counter() - t), min(cpu, time.process_time() - c)
print(json.dumps([best, cpu, n]))
"""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    docs_file = tok_path.parent / "docs.jsonl"
    with open(docs_file, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    out = subprocess.run([sys.executable, "-c", code, str(docs_file)], env=env, capture_output=True, text=True,
                         check=True).stdout
    best, cpu, tokens = json.loads(out)
    return best, cpu, tokens


def pipeline(jsonl: Path, tok_path: Path, workers: int, folder: Path) -> tuple[float, float, dict]:
    """One prepare from scratch in a fresh process whose tokenizer gets ``workers`` threads (as the encode
    alone does; with one worker the work runs in that process): -> (wall s, CPU s of the process, its
    threads and its worker processes, index)."""
    import subprocess

    shutil.rmtree(folder, ignore_errors=True)
    code = f"""
import json, resource, time
from pathlib import Path
from trainscale.runtime.data import shards, sources

def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

req = shards.DataRequest(files=({str(jsonl)!r},), tokenizer={str(tok_path)!r}, folder={str(folder)!r},
                         workers={workers}, settings=sources.Settings(unit_bytes=4 << 20))
t, c = time.perf_counter(), cpu()
shards.prepare(req, 1 << 16, Path({str(folder.parent)!r}))
print(json.dumps([time.perf_counter() - t, cpu() - c]))
"""
    env = dict(os.environ, RAYON_NUM_THREADS=str(workers))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    wall, cpu = json.loads(out)
    return wall, cpu, json.loads((folder / "index.json").read_text())


def loader_share(prepared: Path, steps: int) -> dict:
    import torch

    from trainscale.runtime.config import load_config
    from trainscale.runtime.data.loader import TokenLoader
    from trainscale.runtime.train import Trainer
    from trainscale.specs import Layout

    index = json.loads((prepared / "index.json").read_text())
    cfg = load_config(ROOT / "configs" / "small.toml", {
        "train": {"steps": steps}, "model": {"vocab_size": max(2048, index["vocab_size"])},
        "data": {"files": [index["sources"][0]["path"]], "tokenizer": str(prepared / "tokenizer.json"),
                 "prepared": str(prepared), "shard_mb": 4.0}})
    trainer = Trainer(cfg, Layout(), out=None, log=lambda _m: None)
    times = [trainer.train_step()["step_time_s"] for _ in range(steps)][2:]
    loader = TokenLoader(trainer.corpus.tokens("train"), cfg.train.seq_len, cfg.train.global_batch, seed=1)
    reads = []
    for _ in range(200):
        t = time.perf_counter()
        loader.next_batch()
        reads.append(time.perf_counter() - t)
    step, read = statistics.median(times), statistics.median(reads)
    return {"step_s": step, "loader_s": read, "share": read / step, "threads": torch.get_num_threads(),
            "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=32.0, help="corpus size (MB of JSONL)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12, help="training steps timed for the loader's share")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from trainscale.runtime.data import tokenizer
    from trainscale.runtime.data.sources import corpus_text

    tmp = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        jsonl, docs = make_corpus(tmp, args.mb)
        tok_path = tmp / "tokenizer.json"
        tokenizer.train_bpe(iter([corpus_text("train")]), args.vocab).save(str(tok_path))
        rows = []
        for w in sorted({1, args.workers}):
            # alternately, so that the machine's load hits both alike; the best of each
            enc, pipe = [], []
            for _ in range(args.repeats):
                enc.append(encode_alone(tok_path, docs, w, 1))
                pipe.append(pipeline(jsonl, tok_path, w, tmp / "prepared"))
            t_encode, c_encode, n_tokens = min(e[0] for e in enc), min(e[1] for e in enc), enc[0][2]
            t_pipe, c_pipe, index = min(p[0] for p in pipe), min(p[1] for p in pipe), pipe[0][2]
            tokens = index["splits"]["train"]["tokens"] + index["splits"]["val"]["tokens"]
            assert tokens == n_tokens + len(docs), (tokens, n_tokens, len(docs))  # + an end-of-text per document
            rows.append({"workers": w, "encode_alone_s": t_encode, "pipeline_s": t_pipe,
                         "encode_alone_cpu_s": c_encode, "pipeline_cpu_s": c_pipe,
                         "encode_alone_tokens_per_s": n_tokens / t_encode, "pipeline_tokens_per_s": tokens / t_pipe,
                         "pipeline_overhead": t_pipe / t_encode - 1, "pipeline_cpu_overhead": c_pipe / c_encode - 1})
        share = loader_share(tmp / "prepared", args.steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res = {"corpus_mb": args.mb, "documents": len(docs), "tokens": tokens, "vocab": args.vocab, "rows": rows,
           "loader": share, "load_average": load}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load:.1f}; "
          f"corpus {args.mb:.0f} MB JSONL, {len(docs):,} documents, {tokens:,} tokens, BPE vocab {args.vocab:,}")
    print(f"| processes / threads | encode alone: wall s, CPU s (best of {args.repeats}) | tokens/s | prepare-data: "
          "wall s, CPU s | tokens/s | overhead, wall | overhead, CPU (target <= +20 %) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['encode_alone_s']:.2f}, {r['encode_alone_cpu_s']:.2f} | "
              f"{r['encode_alone_tokens_per_s']:,.0f} | {r['pipeline_s']:.2f}, {r['pipeline_cpu_s']:.2f} | "
              f"{r['pipeline_tokens_per_s']:,.0f} | {r['pipeline_overhead']:+.1%} | "
              f"{r['pipeline_cpu_overhead']:+.1%} |")
    print(f"loader: {share['loader_s'] * 1e6:,.0f} us per batch of {share['tokens_per_step']:,} tokens against a "
          f"{share['step_s'] * 1e3:,.1f} ms step (configs/small.toml, 1 process): {share['share']:.3%} of step time "
          "(target <= 1 %)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
