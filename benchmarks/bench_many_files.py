"""A corpus of many small files, measured (issue 22): `prepare-data` on 100,000 small text files against the same
text as one JSONL file, and a few training steps on the many-file shards, everything under ``ulimit -n 1024``.

The corpus: the Shakespeare plays' paragraphs (sources.corpus_text, the training plays, repeated with a file
number to reach ``--files``), each file one document of about ``--chars`` characters (lines joined by single
newlines, so a file is one paragraph: the same documents whether read as files or as JSONL lines). A byte-level
BPE is trained once beforehand and loaded by both runs (tokenizer training is in neither figure). Each
preparation is the CLI (`python -m trainscale prepare-data --config C --json`) from scratch in a fresh process
under ``bash -c 'ulimit -n N; ...'``; its rate is all tokens written / the seconds the command reports (walking
the folders, hashing the inputs, workers, reading, encoding, writing, the index). Then `trainscale train` runs
``--steps`` steps on the many-file shards under the same limit (a small model, world size 1).

    .venv/bin/python benchmarks/bench_many_files.py [--files 100000] [--chars 600] [--workers 2] [--steps 3]
                                                    [--ulimit 1024] [--shard-mb 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = """
[model]
name = "tiny-llama"
n_layers = 2
d_model = 64
n_heads = 4
n_kv_heads = 2
d_ff = 192
vocab_size = 1024
max_seq_len = 128

[train]
steps = {steps}
lr = 3e-3
warmup = 1
seq_len = 128
global_batch = 8

[run]
log_every = 1
eval_sequences = 8
save_final = false

[data]
tokenizer = "{tokenizer}"
workers = {workers}
shard_mb = {shard_mb}
prepared = "{prepared}"
"""


def documents(n: int, chars: int) -> list[str]:
    """``n`` documents of about ``chars`` characters: the plays' lines, in order, a file number first."""
    from trainscale.runtime.data.sources import corpus_text

    lines = [ln for ln in corpus_text("train").split("\n") if ln.strip()]
    out, i = [], 0
    for d in range(n):
        doc, size = [f"file {d}"], 0
        while size < chars:
            doc.append(lines[i % len(lines)])
            size += len(lines[i % len(lines)]) + 1
            i += 1
        out.append("\n".join(doc))
    return out


def write_corpus(root: Path, docs: list[str]) -> tuple[Path, Path]:
    """The documents as files (1,000 per folder) and as one JSONL."""
    folder = root / "files"
    for d, text in enumerate(docs):
        sub = folder / f"{d // 1000:04d}"
        if d % 1000 == 0:
            sub.mkdir(parents=True)
        (sub / f"{d:06d}.txt").write_text(text)
    jsonl = root / "corpus.jsonl"
    with open(jsonl, "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    return folder, jsonl


def in_ulimit(limit: int, argv: list[str], timeout: int = 3600) -> subprocess.CompletedProcess:
    cmd = f"ulimit -n {limit} && exec {shlex.join(argv)}"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def prepare(cfg: Path, limit: int) -> dict:
    p = in_ulimit(limit, [sys.executable, "-m", "trainscale", "prepare-data", "--config", str(cfg), "--json"])
    if p.returncode:
        raise SystemExit(f"prepare-data failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout)
    tokens = sum(out["splits"][s]["tokens"] for s in ("train", "val"))
    return {"seconds": out["seconds"], "tokens": tokens, "tokens_per_s": tokens / out["seconds"],
            "shards": len(out["splits"]["train"]["shards"]) + len(out["splits"]["val"]["shards"]),
            "sources": len(out["sources"]), "documents": sum(out["splits"][s]["documents"] for s in ("train", "val"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--chars", type=int, default=600)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ulimit", type=int, default=1024)
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from trainscale.runtime.data.tokenizer import train_bpe

    with tempfile.TemporaryDirectory(prefix="bench-many-files-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        docs = documents(args.files, args.chars)
        folder, jsonl = write_corpus(root, docs)
        tok = root / "tokenizer.json"
        train_bpe(iter(docs[:5000]), 1024).save(str(tok))
        print(f"corpus: {args.files:,} files, {sum(map(len, docs)) / 1e6:.1f} M characters, written in "
              f"{time.perf_counter() - t0:.0f} s; ulimit -n {args.ulimit}, {args.workers} workers, "
              f"shard_mb {args.shard_mb:g}", flush=True)
        rows = {}
        for name, files in (("many files", folder), ("one JSONL", jsonl)):
            cfg = root / f"{name.replace(' ', '-')}.toml"
            cfg.write_text(MODEL.format(steps=args.steps, tokenizer=tok, workers=args.workers, shard_mb=args.shard_mb,
                                        prepared=root / f"prepared-{name.replace(' ', '-')}")
                           + f'files = ["{files}"]\n')
            rows[name] = prepare(cfg, args.ulimit)
            print(f"{name:>10}: {rows[name]['sources']:>7,} inputs -> {rows[name]['shards']:>3} shards, "
                  f"{rows[name]['tokens']:>11,} tokens in {rows[name]['seconds']:6.1f} s = "
                  f"{rows[name]['tokens_per_s']:>9,.0f} tokens/s", flush=True)
        ratio = rows["one JSONL"]["tokens_per_s"] / rows["many files"]["tokens_per_s"]
        print(f"one-JSONL rate / many-file rate = {ratio:.2f} (target <= 2)")
        assert rows["many files"]["tokens"] == rows["one JSONL"]["tokens"], "the same text, the same tokens"

        t1 = time.perf_counter()
        cfg = root / "many-files.toml"
        p = in_ulimit(args.ulimit, [sys.executable, "-m", "trainscale", "train", "--config", str(cfg),
                                    "--out", str(root / "run")])
        if p.returncode:
            raise SystemExit(f"train failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        metrics = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        losses = [m["loss"] for m in metrics if "loss" in m and "step_time_s" in m]
        print(f"train under ulimit -n {args.ulimit}: {len(losses)} steps, losses "
              f"{', '.join(f'{x:.3f}' for x in losses)} ({time.perf_counter() - t1:.0f} s with start-up)")
        result = {"files": args.files, "chars": args.chars, "workers": args.workers, "ulimit": args.ulimit,
                  "shard_mb": args.shard_mb, "rows": rows, "ratio": ratio, "train_losses": losses,
                  "host": platform.node(), "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                        time.gmtime())}
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
