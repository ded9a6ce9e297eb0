"""generate's decode against transformers' ``model.generate`` on the same Llama folder: greedy, same prompt, same
number of new tokens; checks the tokens are equal and prints tokens per second of each (median of REPEATS runs).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_generate.py [--layers 4] [--d-model 256] [--new 128]

The folder is a random transformers Llama saved here (nothing downloaded). transformers runs with its default
dynamic cache and with ``cache_implementation="static"`` (its preallocated cache, as ours is).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.load import load_for_inference

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=3 * args.d_model,
                                   num_hidden_layers=args.layers, num_attention_heads=args.d_model // 64,
                                   num_key_value_heads=max(1, args.d_model // 128), max_position_embeddings=1024,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours, _, _ = load_for_inference(d)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)).tolist()[0]
    greedy = Sampling(temperature=0)

    def run_ours() -> list[int]:
        return generate_ids(ours, prompt, args.new, greedy).new_ids

    def run_hf(static: bool) -> list[int]:
        kw = {"cache_implementation": "static"} if static else {}
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=args.new,
                              min_new_tokens=args.new, pad_token_id=0, **kw)
        return out[0, len(prompt):].tolist()

    runs = {"trainscale generate": run_ours, "transformers (dynamic cache)": lambda: run_hf(False),
            "transformers (static cache)": lambda: run_hf(True)}
    tokens = {}
    print(f"Llama d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; prompt {args.prompt} tokens, "
          f"{args.new} new (greedy), {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    for name, fn in runs.items():
        tokens[name] = fn()  # warm-up (and the tokens compared)
        secs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        s = statistics.median(secs)
        print(f"  {name:30s} {args.new / s:8.1f} tokens/s  ({s * 1e3 / args.new:.2f} ms/token, median of "
              f"{args.repeats})")
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"  same greedy tokens: {same}")


if __name__ == "__main__":
    main()
