"""`trainscale serve`: an OpenAI-compatible server on this machine for a .gguf file or a model folder."""

from __future__ import annotations

import typer

from trainscale.commands._common import number


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    model: str = typer.Argument(..., help="a .gguf file (served by llama.cpp's own server, llama-cpp-python's), or a "
                                "model folder: run folder, Hugging Face folder, merged or LoRA folder, our int4/int8 "
                                "quantized folder (served over trainscale generate)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on; the default answers this machine only (the "
                             "API asks no key)"),
    port: int = typer.Option(8000, callback=number(ge=0, le=65535), help="TCP port (0: any free one)"),
    max_tokens: int = typer.Option(512, "--max-tokens", callback=number(ge=1, le=1 << 20),
                                   help="most new tokens one request may ask for (a model folder's default too when "
                                   "a request names none, within the model's context)"),
    name: str = typer.Option(None, "--name", help="the model id clients name (default: the file's or folder's name)"),
    n_ctx: int = typer.Option(4096, "--n-ctx", callback=number(ge=0, le=1 << 20),
                              help="llama.cpp's context (KV cache positions) for a .gguf; 0: the model's own, which "
                              "for a 128K-context model is a large cache"),
    threads: int = typer.Option(None, "--threads", callback=number(ge=1, le=1024),
                                help="llama.cpp's CPU threads for a .gguf (default: its own choice)"),
) -> None:
    """Serve a model with OpenAI's API (/v1/models, /v1/chat/completions, /v1/completions, streaming): the official
    openai client, pointed at http://127.0.0.1:PORT/v1, talks to it. Requests queue; Ctrl-C stops it."""
    from trainscale.commands._common import console
    from trainscale.infer.serve import serve as run

    run(model, host, port, max_tokens, name, n_ctx, threads,
        announce=lambda line: console.print(line, highlight=False, soft_wrap=True))
