#!/bin/bash
# Heads on demo-target-v2: stage 1 (E3 cold + P cold, 20 min each side by side), stage 2 (E3 --init, P warm from E3 stage 1).
set -x
cd .
T=models/demo-target-v2; PY=.venv/bin/python; R=runs/heads-v2; D=$R/data
COMMON="--target $T --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16"
S1=${S1:-20}; S2=${S2:-45}
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --data $D --draft-vocab 4096 --lr 1.5e-3 --epochs 4 --max-minutes $S1 --out $R/e3 $COMMON > $R/e3.log 2>&1 &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --data $D --draft-vocab 4096 --lr 1.5e-3 --epochs 4 --max-minutes $S1 --out $R/pe-cold $COMMON > $R/pe-cold.log 2>&1 &
wait
$PY -m peagle.cli train --method eagle3 --ttt-steps 7 --init $R/e3 --data $D --lr 1e-3 --warmup 20 --epochs 20 --max-minutes $S2 --out $R/e3b $COMMON > $R/e3b.log 2>&1 &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.8 --init-from-eagle3 $R/e3 --data $D --lr 1e-3 --warmup 20 --epochs 20 --max-minutes $S2 --out $R/pe-warm $COMMON > $R/pe-warm.log 2>&1 &
wait
echo DONE
