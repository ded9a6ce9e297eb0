"""`trainscale generate`: sample a continuation with a KV cache, and check the cache's bytes."""

from __future__ import annotations

import time

import typer

from trainscale.commands._common import SEED, console, emit_json, number
from trainscale.errors import TrainscaleError

KV_DTYPES = ("float32", "bfloat16", "float16")


def register(app: typer.Typer) -> None:
    app.command()(generate)


def generate(
    checkpoint: str = typer.Argument(..., help="model folder, run folder (its final/, else its newest checkpoint), "
                                      "checkpoint RUN/checkpoints/step-N, quantized or LoRA folder, or a Hugging "
                                      "Face model folder"),
    prompt: str = typer.Option(None, "--prompt", "-p", help="text to continue (with --chat: the user's message); "
                               "UTF-8, at most 16 characters per position of the model's context (with --system); "
                               "default: the start of the model's own held-out text"),
    chat: bool = typer.Option(False, "--chat", help="render the prompt as a user message with the model folder's "
                              "chat template (an adapter's: its base's) and print the assistant's reply, stopping "
                              "at the end of its turn"),
    system: str = typer.Option(None, "--system", help="with --chat: a system message before the user's"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", callback=number(ge=0, le=1 << 20),
                                       help="tokens to generate"),
    temperature: float = typer.Option(0.8, callback=number(ge=0, le=100), help="softmax temperature; 0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", callback=number(ge=0, le=1 << 24),
                              help="keep the k most likely tokens (0: off)"),
    top_p: float = typer.Option(1.0, "--top-p", callback=number(gt=0, le=1),
                                help="keep the smallest set with this probability (1: off)"),
    seed: int = typer.Option(0, callback=SEED, help="sampling seed"),
    kv_dtype: str = typer.Option("float32", help="KV cache precision: float32, bfloat16 or float16"),
    stop: bool = typer.Option(True, "--stop/--no-stop", help="stop at the end-of-text token (--chat: end of turn)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Continue a prompt: temperature / top-k / top-p sampling with a KV cache sized by the estimator's formula."""
    import torch

    from trainscale.commands._infer import check_table, kv_table, print_tables
    from trainscale.estimate.memory import kv_cache_bytes
    from trainscale.infer.evaluate import held_out_prompt
    from trainscale.infer.generate import Sampling, chat_prompt, check_text, generate_ids, text_cap
    from trainscale.infer.load import load_for_inference, load_tokenizer_for, stop_token_id
    from trainscale.runtime.artifact import checkpoint_source

    if kv_dtype not in KV_DTYPES:
        raise TrainscaleError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
    if chat and prompt is None or system is not None and not chat:
        raise TrainscaleError("--chat needs --prompt: the user's message" if chat else
                              "--system is a chat message; give it with --chat")
    texts = {"--prompt": check_text("--prompt", prompt or ""), "--system": check_text("--system", system or "")}
    sampling = Sampling(temperature, top_k, top_p, seed).check()
    model, spec, folder = load_for_inference(checkpoint)
    check_text(" and ".join(k for k, v in texts.items() if v), "".join(texts.values()), *text_cap(spec.max_seq_len))
    if chat:  # a chat reply ends at any of the folder's end ids (generation_config.json may list several)
        rendered = chat_prompt(folder, prompt, system)
        tok, ids, stops = rendered.tokenizer, rendered.ids, rendered.stop_ids
    else:
        tok = load_tokenizer_for(folder)
        prompt = held_out_prompt(folder, tok, spec.max_seq_len - max_new_tokens) if prompt is None else prompt
        ids, stops = tok.encode(prompt).ids, (stop_token_id(tok, folder),)
    stops = tuple(i for i in stops if i is not None) if stop else ()
    dt = getattr(torch, kv_dtype)
    t0 = time.perf_counter()
    g = generate_ids(model, ids, max_new_tokens, sampling, kv_dtype=dt, stop_id=stops)
    secs = time.perf_counter() - t0
    predicted = kv_cache_bytes(spec, g.kv_capacity, 1, torch.empty((), dtype=dt).element_size())
    ended = bool(g.new_ids) and g.new_ids[-1] in stops
    text = tok.decode(g.new_ids[:-1] if ended else g.new_ids)
    out = {
        "checkpoint": str(folder), "prompt": prompt, "completion": text, "prompt_tokens": len(ids),
        "new_tokens": len(g.new_ids), "token_ids": g.new_ids, "seconds": secs,
        "tokens_per_s": len(g.new_ids) / secs if secs > 0 else None,
        "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed},
        "kv_cache": {"dtype": kv_dtype, "positions": g.kv_capacity, "measured_bytes": g.kv_cache_bytes,
                     "predicted_bytes": predicted, "equal": g.kv_cache_bytes == predicted,
                     "formula": "2 x n_layers x n_kv_heads x head_dim x bytes x positions"},
    }
    if chat:
        out["chat"] = {"system": system, "rendered_prompt": rendered.text, "template_folder": str(rendered.folder),
                       "reply": text, "end_of_turn": bool(ended)}
    if (origin := checkpoint_source(folder)) is not None:
        out["from_checkpoint"] = origin
    if as_json:
        emit_json(out)
        return
    from rich.text import Text

    console.print(Text(text) if chat else Text(prompt, style="bold") + Text(text))
    console.print()
    print_tables(
        kv_table({"model": f"{spec.name} ({folder})", "tokens": f"{len(ids)} prompt + {len(g.new_ids)} new",
                  "speed": f"{out['tokens_per_s'] or 0:.1f} tokens/s"}),
        check_table(f"KV cache ({kv_dtype}, {g.kv_capacity} positions)",
                    [("KV cache bytes", g.kv_cache_bytes, predicted)]),
    )
