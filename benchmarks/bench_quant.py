"""Quantization fidelity and sizes: held-out perplexity of int8 / int4 (groups of 32, 64, 128, symmetric and
asymmetric) against bf16, file and tensor bytes on disk against the estimator, GGUF sizes, KV-cache bytes.

    python benchmarks/bench_quant.py runs/small   # a trained run (trainscale train --config configs/small.toml)
    python benchmarks/bench_quant.py              # no run: trains the small config's model in-process first

Prints markdown tables (the figures recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def small_model(out: Path) -> Path:
    """configs/small.toml's model, trained in-process for a couple of minutes (tests/infer_fixtures.py's loop)."""
    import tomllib

    sys.path.insert(0, str(ROOT / "tests"))
    from infer_fixtures import train_small_model

    fields = tomllib.loads((ROOT / "configs" / "small.toml").read_text())["model"]
    return train_small_model(out, steps=600, spec_fields=fields, text_chars=None, log=print)


def main() -> None:
    from trainscale.estimate.inference import gguf_tensor_bytes, quantized_model_bytes
    from trainscale.estimate.memory import kv_cache_bytes
    from trainscale.estimate.params import param_count
    from trainscale.infer.evaluate import eval_ids, perplexity
    from trainscale.infer.generate import Sampling, generate_ids
    from trainscale.infer.gguf import export_gguf
    from trainscale.infer.load import load_for_inference, load_tokenizer_for
    from trainscale.infer.quantize import (
        QuantConfig,
        model_from_state_dict,
        safetensors_layout,
        save_quantized,
        weight_error,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model or run folder (default: train the small model in-process)")
    ap.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens for perplexity")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tmp = Path(tempfile.mkdtemp(prefix="bench-quant-"))
    src = Path(args.model) if args.model else small_model(tmp / "small")
    model, spec, folder = load_for_inference(src)
    tok = load_tokenizer_for(folder)
    ids = eval_ids(tok, max_tokens=args.eval_tokens)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    print(f"model {spec.name} from {folder}: {param_count(spec):,} parameters, {spec.n_layers} layers, d_model "
          f"{spec.d_model}, d_ff {spec.d_ff}, vocab {spec.vocab_size}; held-out text: {len(ids):,} tokens of the "
          f"corpus's held-out plays, windows of {spec.max_seq_len}\n")

    t0 = time.time()
    base = perplexity(model_from_state_dict(spec, sd), ids)
    bf16 = perplexity(model_from_state_dict(spec, {k: v.bfloat16() for k, v in sd.items()}), ids)
    print("| weights | group | scheme | tensor bytes (measured = estimator) | file on disk | weight error "
          "(rel. Frobenius) | held-out ppl | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    src_file = safetensors_layout(folder / "model.safetensors")["file_bytes"]
    print(f"| fp32 (source) | - | - | {4 * param_count(spec):,} | {src_file:,} | - | {base:.3f} | "
          f"{base / bf16 - 1:+.2%} |")
    print(f"| bf16 | - | - | {int(quantized_model_bytes(spec, 'bf16')):,} | - | - | {bf16:.3f} | - |")
    for fmt in ("int8", "int4"):
        for g in (32, 64, 128):
            for asym in (False, True):
                cfg = QuantConfig(fmt, g, asym)
                res = save_quantized(model, spec, folder, tmp / f"{fmt}-{g}-{cfg.scheme}", cfg)
                lay = safetensors_layout(res.path)
                pred = quantized_model_bytes(spec, fmt, g, asym)
                assert lay["tensor_bytes"] == pred, (fmt, g, asym, lay, pred)
                err = weight_error(res.original, res.restored)["relative_frobenius"]
                ppl = perplexity(model_from_state_dict(spec, res.restored), ids)
                print(f"| {fmt} | {g} | {cfg.scheme} | {lay['tensor_bytes']:,} | {lay['file_bytes']:,} "
                      f"(header {lay['header_bytes']:,}) | {err:.2%} | {ppl:.3f} | {ppl / bf16 - 1:+.2%} |")
    print(f"\n({time.time() - t0:.0f} s)\n")

    print("| GGUF type | tensor bytes measured | estimator (gguf_tensor_bytes) | header + metadata | file on disk |")
    print("|---|---|---|---|---|")
    for t in ("f16", "q8_0", "q4_0"):
        rep = export_gguf(folder, tmp / f"model-{t}.gguf", t)
        pred = gguf_tensor_bytes(spec, t, llama_cpp_mix=False)
        assert rep["tensor_bytes"] == pred
        print(f"| {t} | {rep['tensor_bytes']:,} | {int(pred):,} | {rep['header_bytes']:,} | {rep['file_bytes']:,} |")

    print("\n| KV cache | positions | measured bytes | estimator (2·L·n_kv·head_dim·bytes·positions) |")
    print("|---|---|---|---|")
    prompt = tok.encode("ROMEO:\n").ids
    for dt in (torch.float32, torch.bfloat16):
        n = spec.max_seq_len - len(prompt)
        gen = generate_ids(model, prompt, n, Sampling(0.8, seed=0), kv_dtype=dt)
        pred = kv_cache_bytes(spec, gen.kv_capacity, 1, torch.empty((), dtype=dt).element_size())
        assert gen.kv_cache_bytes == pred
        print(f"| {gen.kv_dtype} | {gen.kv_capacity} | {gen.kv_cache_bytes:,} | {int(pred):,} |")


if __name__ == "__main__":
    main()
