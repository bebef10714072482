#!/usr/bin/env bash
# Issue 14's GPU check: peagle on one CUDA GPU, <= 8 minutes on one H200. Results: docs/gpu.md (record them there).
#   bash scripts/gpu_check.sh [OUT_DIR]          (default build/gpu-check; the log is OUT_DIR/gpu_check.log)
#   GPU_CHECK_COMPILE=1 bash scripts/gpu_check.sh   also times the demo target with --compile (a few minutes more)
# 1-4 (scripts/gpu_check.py, <= 6 min): parity vs transformers on CUDA (fp32, bf16); greedy identity of EAGLE-3 and
# P-EAGLE vs plain decoding (fp32, bf16); host synchronisations per decode step (expected 1); plain / EAGLE-3 /
# P-EAGLE tokens/s at c=1 and c=32 on the demo target and on a random ~1B Llama with random heads.
# 5 (<= 2 min): a small datagen run on the GPU, then 50 drafter-training steps on CUDA for each method.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-check}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec > >(tee "$OUT/gpu_check.log") 2>&1
start=$(date +%s)
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1
timeout 360 $PY scripts/gpu_check.py --out "$OUT" ${GPU_CHECK_COMPILE:+--compile}
echo "parts 1-4 exit $? after $(( $(date +%s) - start )) s"

echo; echo "### training on CUDA (50 steps per method)"
DATA="$OUT/datagen"
if $PY -m peagle.cli train --help | grep -q -- '--device'; then
  timeout 90 $PY -m peagle.cli datagen --device cuda --out "$DATA" --num-prompts 64 --max-new-tokens 64 \
    --batch 64 --shard-size 64 || echo "datagen exit $?"
  for m in peagle eagle3; do
    timeout 60 $PY -m peagle.cli train --method "$m" --device cuda --data "$DATA" --out "$OUT/head-$m" --steps 50 \
      --max-tokens 512 --log-every 10 --ckpt-every 1000 || echo "train $m exit $?"
  done
else
  echo "peagle train has no --device option in this checkout: the 50 CUDA training steps were skipped"
fi
echo "gpu_check.sh: done in $(( $(date +%s) - start )) s -> $OUT"
