"""`trainscale export`: a Hugging Face Llama (MoE: Mixtral) folder or a llama.cpp GGUF file, sizes vs the
estimator."""

from __future__ import annotations

from pathlib import Path

import typer

from trainscale.commands._common import console, emit_json
from trainscale.errors import TrainscaleError
from trainscale.safeio import check_output


def register(app: typer.Typer) -> None:
    app.command()(export)


def export(
    checkpoint: str = typer.Argument(..., help="model folder, run folder (its final/, else its newest checkpoint), "
                                      "checkpoint RUN/checkpoints/step-N, quantized or LoRA folder, or a Hugging "
                                      "Face model folder"),
    out: Path = typer.Argument(..., help="HF, PEFT: output folder; GGUF: output .gguf file"),
    to: str = typer.Option(..., "--to", help="hf, gguf, or peft (a LoRA folder's adapters alone, for peft's "
                           "PeftModel.from_pretrained on the base exported with --to hf: megabytes, and the base "
                           "stays shared; hf or gguf of a LoRA folder write the merged model)"),
    ftype: str = typer.Option("f16", "--type", "-t", help="GGUF tensor type: f32, f16, q8_0 or q4_0"),
    dtype: str = typer.Option("float32", help="HF weights dtype: float32, bfloat16 or float16"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Export to Hugging Face (config.json, model.safetensors, tokenizer files) or to GGUF for llama.cpp.
    A mixture of experts exports if it is Mixtral-shaped (every layer MoE, no shared expert, top-k renormalised)."""
    from trainscale.commands._infer import check_table, kv_table, print_tables
    from trainscale.infer.load import source_folder, spec_of
    from trainscale.runtime.artifact import checkpoint_source, model_inputs

    to = to.lower()
    if to not in ("hf", "gguf", "peft"):
        raise TrainscaleError(f"--to must be hf, gguf or peft, not {to!r}")
    src = source_folder(checkpoint)  # a Hugging Face folder too
    check_output(out, "the output", folder=to != "gguf", inputs=model_inputs(src), not_at=(checkpoint,))
    spec = spec_of(src)
    if to == "peft":
        from trainscale.estimate.lora import lora_trainable_params
        from trainscale.infer.export import HF_DTYPES
        from trainscale.infer.peft import export_peft

        rep = export_peft(src, out, dtype)
        predicted = lora_trainable_params(spec, rep["rank"], rep["targets"]) * HF_DTYPES[dtype].itemsize
        check = ("tensor bytes (trainable params x bytes)", rep["tensor_bytes"], predicted)
        title = f"PEFT LoRA adapter (r={rep['rank']}, alpha={rep['alpha']:g}, {', '.join(rep['target_modules'])})"
    elif to == "hf":
        from trainscale.estimate.inference import weights_bytes
        from trainscale.estimate.params import param_count
        from trainscale.infer.export import HF_DTYPES, export_hf

        rep = export_hf(src, out, dtype)
        bits = 8 * HF_DTYPES[dtype].itemsize
        predicted = weights_bytes(param_count(spec), bits)
        check = ("tensor bytes (params x bytes)", rep["tensor_bytes"], predicted)
        from trainscale.hf import export_family

        title = f"Hugging Face {export_family(spec).architecture} folder ({dtype})"
    else:
        from trainscale.estimate.inference import gguf_tensor_bytes
        from trainscale.infer.gguf import GGUF_TYPES, export_gguf

        if ftype not in GGUF_TYPES:
            raise TrainscaleError(f"--type must be one of {', '.join(GGUF_TYPES)}, not {ftype!r}")
        if out.suffix.lower() != ".gguf":
            raise TrainscaleError(f"the GGUF output must be a .gguf file, not {out}")
        rep = export_gguf(src, out, ftype)
        predicted = gguf_tensor_bytes(spec, ftype, llama_cpp_mix=False)
        check = ("tensor bytes (gguf_tensor_bytes)", rep["tensor_bytes"], predicted)
        moe = f", {spec.n_experts} experts, top-{spec.experts_per_token}" if spec.is_moe else ""
        title = f"GGUF {ftype} (llama.cpp, architecture {rep['architecture']}{moe})"
    rep = {**rep, "to": to, "predicted_tensor_bytes": predicted, "equal": rep["tensor_bytes"] == predicted}
    if (origin := checkpoint_source(src)) is not None:
        rep["from_checkpoint"] = origin
    if as_json:
        emit_json(rep)
        return
    console.print(f"[bold]{title}[/bold]: {rep['source']} -> {rep['out']}")
    rows = {"file on disk": f"{rep['file_bytes']:,} B", "header + metadata": f"{rep['header_bytes']:,} B"}
    if to == "peft":
        rows["base (peft loads OUT onto it exported --to hf)"] = rep["base"]
    if rep.get("padding_bytes"):
        rows["alignment padding"] = f"{rep['padding_bytes']:,} B"
    print_tables(kv_table(rows), check_table("size vs the estimator", [check]))
