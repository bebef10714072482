#!/bin/bash
# How models/demo-target-v2-eagle3 (= e3b) and models/demo-target-v2-peagle (= pe-warm) were trained, as run:
# two stages of two single-thread jobs side by side on the 2-core CPU, 20 + 40 minutes.
# Data: peagle datagen --model models/demo-target-v2 --num-prompts 8000 --code-fraction 0.3 --max-prompt-tokens 512
#       --max-new-tokens 192 --batch 64 --shard-size 40 --threads 1 --seed 0 --out runs/heads-v2/data --part {0,1}/2
T=models/demo-target-v2; PY=.venv/bin/python; R=runs/heads-v2; D=$R/data
COMMON="--target $T --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16"
# stage 1: EAGLE-3 cold, and a cold P-EAGLE as the warm-start study's control
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --data $D --draft-vocab 4096 --lr 1.5e-3 --epochs 4 --max-minutes 20 --out $R/e3 $COMMON &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --data $D --draft-vocab 4096 --lr 1.5e-3 --epochs 4 --max-minutes 20 --out $R/pe-cold $COMMON &
wait
# stage 2: EAGLE-3 continued; P-EAGLE warm-started from the stage-1 EAGLE-3 head (equal total minutes behind each)
$PY -m peagle.cli train --method eagle3 --ttt-steps 7 --init $R/e3 --data $D --lr 1e-3 --warmup 20 --epochs 20 --max-minutes 40 --out $R/e3b $COMMON &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.8 --init-from-eagle3 $R/e3 --data $D --lr 1e-3 --warmup 20 --epochs 20 --max-minutes 40 --out $R/pe-warm $COMMON &
wait
