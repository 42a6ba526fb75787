#!/usr/bin/env bash
# The GPU check of batchinfer, on one GPU (sized for an H200) within GPU_CHECK_BUDGET_S (default 470 s):
#   1. the kernel tests, compiled on the GPU at full size          pytest tests/kernels
#   2. attention microbenchmark: our Triton kernel vs torch SDPA   bench/gpu_attention.py
#      (decode batch 64 x context 2k, Llama-3-8B heads, bf16, block 16; K/V bandwidth vs device copy bandwidth)
#   3. engine throughput: batchinfer vs transformers' continuous batching, Llama-3.1-8B shapes with random
#      weights, 256 prompts, lengths uniform in 100..1024                bench/gpu_engine.py
# Everything goes to stdout and, when $OUT is set, to $OUT/gpu_check.log (+ $OUT/gpu_attention.json,
# $OUT/gpu_engine.json). PYTHON picks the interpreter (default: .venv/bin/python when its torch sees CUDA,
# else python3). Each step has its own time limit; a failed step does not stop the next one.
set -u
cd "$(dirname "$0")/.." || exit 1
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-470}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
      2>/dev/null; then
    PYTHON=.venv/bin/python
  fi
fi
log=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && log="$OUT/gpu_check.log"; fi

left() { echo $((budget - ($(date +%s) - start))); }

step() { # title, time limit (s), command...
  local title=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo
  echo "=== $title (limit ${limit}s)"
  timeout --kill-after=15 "$limit" "$@"
  rc=$?
  echo "=== $title: exit $rc after $(($(date +%s) - t0))s"
}

{
  echo "batchinfer GPU check, $(date -u +%FT%TZ), budget ${budget}s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
  "$PYTHON" -c "import torch, triton, transformers; print('python', __import__('sys').version.split()[0], \
'| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, \
'| transformers', transformers.__version__)"

  step "1. kernel tests on the GPU" 150 "$PYTHON" -m pytest tests/kernels -q -p no:cacheprovider -p no:warnings
  step "2. attention microbenchmark" 120 "$PYTHON" bench/gpu_attention.py
  engine_limit=$(($(left) - 20))
  if [ "$engine_limit" -lt 60 ]; then
    echo; echo "=== 3. engine throughput: skipped, only ${engine_limit}s of the budget left"
  else
    step "3. engine throughput vs transformers" "$((engine_limit + 15))" \
      "$PYTHON" bench/gpu_engine.py --deadline-s "$engine_limit"
  fi
  echo
  echo "=== done in $(($(date +%s) - start))s"
} 2>&1 | tee "$log"
