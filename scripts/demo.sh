#!/usr/bin/env bash
# `make demo`: the whole system as far as it exists, in a few minutes on a laptop CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
TS=.venv/bin/trainscale
export COLUMNS=${COLUMNS:-140}
step() { printf '\n\033[1m== %s ==\033[0m\n' "$*"; }

step "1. Why training takes a data center (the seed's running example, recomputed)"
$TS explain

step "1b. A mixture of experts: DeepSeek-V3's 671B parameters, 37B of them active per token"
$TS explain --model deepseek-v3 --tokens 14.8e12 --seq 4096 --gpu h800 --gpus 2048  # pre-trained at 4K (arXiv 2412.19437 Sec. 4.2)

mkdir -p runs
step "2. Plan: the best 4D layout for Llama 3.1 405B on 16,384 H100s (seq 8192, 16M-token batches)"
$TS plan --model llama3.1-405b --gpu h100-sxm --gpus 16384 --seq 8192 --global-batch-tokens 16777216 \
  --tokens 15.6e12 --top 3
$TS plan --model llama3.1-405b --gpu h100-sxm --gpus 16384 --seq 8192 --global-batch-tokens 16777216 \
  --json > runs/plan-405b.json

step "2b. Validate: the planner against published training runs (Llama 3, torchtitan, llm-foundry, BLOOM, OPT)"
$TS validate

step "2c. Plan a mixture of experts: Mixtral 8x7B on 64 H100s, expert parallelism placed by its all-to-all"
$TS plan --model mixtral-8x7b --gpu h100-sxm --gpus 64 --seq 4096 --global-batch-tokens 4194304 --tokens 1e12 --top 3

step "3. Failures and checkpoints: the Llama 3-like run"
$TS reliability --trials 300

step "4. Train the tiny model on 4 processes (dp2 x tp2), checkpoint every 5 steps, one injected crash"
rm -rf runs/demo runs/demo-int4 runs/own-data runs/demo-report runs/moe-tiny runs/demo-hf-step25 runs/demo-lora \
  runs/demo-peft runs/llama32 runs/llama32-lora runs/llama32-peft runs/llama32.gguf \
  runs/chat-llama32 runs/chat-llama32-dpo runs/llama32-q4_k_m.gguf  # a fresh run folder each time
$TS train --config configs/demo.toml --layout dp2,tp2 --inject crash@step=12,rank=3 --max-restarts 6

step "4b. Your own data: a JSONL file (made here), tokenised once into shards, trained on for 60 steps"
mkdir -p runs/own-data
.venv/bin/python - <<'PY'
import json
from trainscale.runtime.data.sources import corpus_text
with open("runs/own-data/corpus.jsonl", "w") as f:  # a document per paragraph, text in "text"
    for p in corpus_text("train", 400_000).split("\n\n"):
        if p.strip():
            f.write(json.dumps({"text": p.strip()}) + "\n")
PY
$TS prepare-data --config configs/own-data.toml
$TS prepare-data --config configs/own-data.toml   # the same inputs again: nothing to do
$TS train --config configs/own-data.toml --layout dp2

step "4c. Train a small mixture of experts (8 experts, top-2, a shared expert) with expert parallelism: dp2 x ep2"
$TS train --config configs/moe-tiny.toml --layout dp2,ep2

step "5. Quantize what it trained to int4 (groups of 32) and generate from it"
$TS quantize runs/demo --format int4 --group-size 32 --out runs/demo-int4
$TS generate runs/demo-int4 --prompt "ROMEO:" --max-new-tokens 40 --seed 1

step "5b. A checkpoint is a model; LoRA on the JSONL corpus, exported for peft"
$TS export runs/demo/checkpoints/step-00000025 runs/demo-hf-step25 --to hf
$TS lora runs/demo --data runs/own-data/corpus.jsonl --text-field text --rank 4 --steps 20 --out runs/demo-lora
$TS export runs/demo-lora runs/demo-peft --to peft

step "5c. Scores people compare: multiple-choice accuracy on a local task file, as lm-evaluation-harness computes it"
$TS evaluate runs/demo --tasks examples/tasks-plays.jsonl

step "6. Calibrate this machine, then check the plan against the runtime, rank by rank"
$TS calibrate --config configs/small.toml --processes 1,2
$TS compare --config configs/small.toml --layouts "dp2,zero1,mb8;dp2,zero3,mb8;tp2,mb16;pp2,mb4"

step "7. Fine-tune a model you have: a Llama-3.2-shaped Hugging Face folder (llama3 RoPE, tied embeddings, chat template)"
.venv/bin/python scripts/tiny_llama32.py runs/llama32 --chat examples/chat.jsonl 2>/dev/null  # built by transformers
# full fine-tuning on the chat file (assistant tokens learned, conversations masked from each other), dp2
$TS train --config configs/chat-llama32.toml --layout dp2
# preference tuning of that run, fsdp2 on 2 processes: its answers chosen over the same answers shouted (DPO,
# reference log-probs computed once; the same numbers as one process)
$TS dpo runs/chat-llama32/run --data examples/preference.jsonl --steps 30 --batch 8 --lr 1e-4 --layout fsdp2 \
  --out runs/chat-llama32-dpo
# LoRA on the folder itself, the adapter merged into a copy of the weights too
$TS lora runs/llama32 --data examples/chat.jsonl --rank 8 --steps 60 --merge --out runs/llama32-lora
$TS export runs/llama32-lora runs/llama32-peft --to peft
$TS export runs/llama32-lora runs/llama32.gguf --to gguf
.venv/bin/python - <<'PY' 2>/dev/null
# the exports carry the chat: transformers renders the question with the PEFT folder's own tokenizer files and puts
# the adapter on the base; llama.cpp answers the merged GGUF through its own chat completion (the file's template
# and end-of-turn id): the same reply, stopped at the end of the turn
import torch
from llama_cpp import Llama
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("runs/llama32-peft")
question = [{"role": "user", "content": "What is a good way to learn to cook?"}]
ids = tok.apply_chat_template(question, add_generation_prompt=True, return_dict=True)["input_ids"]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("runs/llama32"), "runs/llama32-peft").eval()
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id)
print("transformers + peft (adapter):", repr(tok.decode(out[0, len(ids):], skip_special_tokens=True)))
llm = Llama(model_path="runs/llama32.gguf", n_ctx=256, verbose=False)
reply = llm.create_chat_completion(question, max_tokens=24, temperature=0.0)["choices"][0]["message"]["content"]
print("llama.cpp (merged GGUF, its own chat template):", repr(reply))
PY
$TS generate runs/llama32-lora --chat --prompt "What is a good way to learn to cook?" --temperature 0 \
  --max-new-tokens 24   # trainscale's own generate, the prompt rendered with the folder's chat template

step "8. The report of the plan, the reliability model and this run"
$TS report --out runs/demo-report --plan runs/plan-405b.json --run runs/demo
echo "open runs/demo-report/index.html"

step "9. Run it at home: the fine-tuned chat model behind an OpenAI-compatible server on 127.0.0.1"
PORT=${SERVE_PORT:-8765}
$TS serve runs/llama32-lora --port "$PORT" --name llama32-chat &   # binds 127.0.0.1 unless --host says otherwise
SERVE_PID=$!
trap 'kill $SERVE_PID 2>/dev/null || true' EXIT
.venv/bin/python - "$PORT" <<'PY'
# the official openai client, pointed at the local server: the reply is generate --chat's (greedy), streamed too
import sys
import time

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="not-needed")
for _ in range(600):  # the server loads the model first
    try:
        model = client.models.list().data[0].id
        break
    except openai.APIConnectionError:
        time.sleep(0.2)
question = [{"role": "user", "content": "What is a good way to learn to cook?"}]
reply = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=24)
print(f"openai client -> {model}:", repr(reply.choices[0].message.content), f"({reply.choices[0].finish_reason},",
      f"{reply.usage.completion_tokens} tokens)")
stream = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=24, stream=True)
print("streamed:", repr("".join(c.choices[0].delta.content or "" for c in stream if c.choices)))
PY
kill "$SERVE_PID"; wait "$SERVE_PID" 2>/dev/null || true
trap - EXIT

step "10. The quantization people download: Q4_K_M by llama.cpp's own quantizer, its size and perplexity vs f16"
$TS quantize runs/llama32-lora --to gguf --type Q4_K_M --out runs/llama32-q4_k_m.gguf
