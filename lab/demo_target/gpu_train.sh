#!/usr/bin/env bash
# Train the demo target on one GPU (issue 12's GPU path), <= 8 minutes on one H200.
#   bash lab/demo_target/gpu_train.sh [OUT_DIR]          (default build/demo-target-gpu)
# Same recipe as the CPU path (models/demo-target/README.md), larger batch, a 6-minute time budget; the cosine
# schedule is sized to the budget from the measured step time. Builds the corpus and token memmaps under
# data/target first if they are missing (a few minutes of CPU). fp32 weights, bf16 is not used for the target.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/demo-target-gpu}
PY=${PY:-python3}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
$PY -m lab.demo_target.train --device cuda --out "$OUT" --data-dir data/target --run-dir runs/target-gpu \
  --layers 8 --hidden 256 --intermediate 688 --heads 4 --kv-heads 2 \
  --batch-size 64 --seq-len 512 --lr 2e-3 --warmup-steps 50 --time-budget-min 6 --ckpt-min 2 --threads 8
$PY -m lab.demo_target.evaluate_target "$OUT" --reuse-heldout --batch-size 64
