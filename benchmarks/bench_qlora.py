"""QLoRA-style LoRA against LoRA on the full-precision base: the frozen base's projections held as int8 / int4 groups
(``lora --base-bits``), adapters in fp32 on top; bytes of the quantized projections against bf16, and held-out loss
before and after the same training (same data, seed, steps) as on the fp32 base.

    python benchmarks/bench_qlora.py MODEL_FOLDER   # any model folder (a run's final/, an HF folder)
    python benchmarks/bench_qlora.py                # no folder: trains tests/infer_fixtures.py's small model first

The data: the held-out Shakespeare plays (never in the small model's training text) as a JSONL file of paragraphs;
``lora``'s own held-out documents (the trainer's hash rule, 10 %) measure it. Prints a markdown table (the figures
recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from typer.testing import CliRunner

    from trainscale.cli import app
    from trainscale.runtime.data.sources import corpus_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="model folder (default: train the small test model first)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--chars", type=int, default=300_000, help="characters of the held-out plays to fine-tune on")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-qlora-"))
    model = Path(args.model) if args.model else None
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from infer_fixtures import train_small_model

        model = train_small_model(tmp / "small", log=print)
    paras = [p for p in corpus_text("val", max_chars=args.chars).split("\n\n") if p.strip()]
    data = tmp / "plays-val.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    rows = []
    for bits, group in ((None, None), (8, 64), (4, 64), (4, 32), (4, 128)):
        extra = ["--base-bits", str(bits), "--base-group-size", str(group)] if bits else []
        t0 = time.perf_counter()
        res = CliRunner().invoke(app, ["lora", str(model), "--data", str(data), "--steps", str(args.steps),
                                       "--rank", str(args.rank), "--batch", "8", "--seq-len", str(args.seq_len),
                                       "--lr", "2e-3", "--out", str(tmp / f"ad-{bits}-{group}"), "--json", *extra])
        if res.exit_code:
            raise SystemExit(res.output)
        rep = json.loads(res.stdout)
        q = rep.get("quantized_base")
        h = rep["held_out"]
        rows.append((f"int{bits} g{group}" if bits else "fp32 (LoRA)", q, h, time.perf_counter() - t0))
    first = rows[0][2]
    print(f"\nmodel {model}, data {len(paras)} paragraphs of the held-out plays; {first['text']}; "
          f"rank {args.rank}, {args.steps} steps x 8 x {args.seq_len} tokens\n")
    print("| base | projection bytes | of bf16 | held-out loss: base | after LoRA | vs fp32-base LoRA | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, q, h, secs in rows:
        size = f"{q['bytes']:,} B" if q else f"{2 * rows[1][1]['weights']:,} B (bf16)"
        ratio = f"{q['ratio_to_bf16']:.4f}" if q else "1"
        print(f"| {name} | {size} | {ratio} | {h['loss_before']:.4f} | {h['loss_after']:.4f} | "
              f"{h['loss_after'] - first['loss_after']:+.4f} | {secs:.0f} |")


if __name__ == "__main__":
    main()
