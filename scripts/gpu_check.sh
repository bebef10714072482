#!/usr/bin/env bash
# Issue 14's GPU check: peagle on one CUDA GPU, <= 8 minutes on one H200. Results: docs/gpu.md (record them there).
#   bash scripts/gpu_check.sh [OUT_DIR]          (default build/gpu-check; the log is OUT_DIR/gpu_check.log)
#   GPU_CHECK_COMPILE=1 bash scripts/gpu_check.sh   also times the demo target with --compile (a few minutes more)
# 1-4 (scripts/gpu_check.py, <= 6 min): parity vs transformers on CUDA (fp32, bf16); greedy identity of EAGLE-3 and
# P-EAGLE vs plain decoding (fp32, bf16); host synchronisations per decode step (expected 1); plain / EAGLE-3 /
# P-EAGLE tokens/s at c=1 and c=32 on the demo target and on a random ~1B Llama with random heads.
# 5 (<= 2 min): a small datagen run on the GPU, then 50 drafter-training steps on CUDA for each method.
# Exits 1 when a part failed (gpu_check.py's verdict, datagen, training). Python: $PY, else .venv's where it has
# CUDA, else python3 (a GPU machine's image: the checkout's .venv is neither carried nor built for CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-check}
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PY=.venv/bin/python
  fi
fi
fail=0
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec > >(tee "$OUT/gpu_check.log") 2>&1
start=$(date +%s)
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1
timeout 360 $PY scripts/gpu_check.py --out "$OUT" ${GPU_CHECK_COMPILE:+--compile}
rc=$?
echo "parts 1-4 exit $rc after $(( $(date +%s) - start )) s"
[ $rc -eq 0 ] || fail=1

echo; echo "### training on CUDA (50 steps per method)"
# SmolLM2 where converted, else the tracked demo target; code prompts only (ShareGPT's package may be missing)
TARGET=models/smollm2-135m-instruct
[ -f "$TARGET/config.json" ] || TARGET=models/demo-target
DATA="$OUT/datagen"
timeout 90 $PY -m peagle.cli datagen --model "$TARGET" --device cuda --out "$DATA" --num-prompts 64 \
  --code-fraction 1 --max-new-tokens 64 --batch 64 --shard-size 64 || { echo "datagen exit $?"; fail=1; }
for m in peagle eagle3; do
  timeout 60 $PY -m peagle.cli train --method "$m" --target "$TARGET" --device cuda --data "$DATA" \
    --out "$OUT/head-$m" --steps 50 --max-tokens 512 --log-every 10 --ckpt-every 1000 || { echo "train $m exit $?"; fail=1; }
done
echo "gpu_check.sh: done in $(( $(date +%s) - start )) s -> $OUT (exit $fail)"
exit $fail
