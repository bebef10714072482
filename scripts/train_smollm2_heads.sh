#!/bin/bash
# How the default target's heads (models/smollm2-135m-instruct-eagle3, models/smollm2-135m-instruct-peagle) were
# trained, as run on the 2-core CPU (AMD EPYC, AVX2, float32). Run from the repository root after `make setup`;
# every stage resumes when rerun (datagen shards, hidden-state files).
#  1. data: 1,100 prompts (30 % code) with the corpus' own answers (--responses original: no generation), plus the
#     first shard of a regenerated run (48 prompts answered greedily by SmolLM2; the rest of that run was stopped:
#     SmolLM2 generates at 15-30 tok/s on this CPU, hours for the whole set). The drafter loss is KL to SmolLM2's
#     own distribution at every position, so both kinds of rows teach the target's predictions.
#  2. hidden states of SmolLM2 (layers 2, 15, 27 and the final state 30), once, in speculators' format (~11 min).
#  3. both heads side by side, one thread each, the same data, schedule and wall time; both share the target's
#     embedding (a 49,152 x 576 embedding is 57 MB in bfloat16: over a head's file budget).
#  4. part 2 (a later session): 1,790 more prompts from the same list (--exclude: none of part 1's), their hidden
#     states appended to the same cache (2,510 samples), and both heads continued from part 1's weights (--init:
#     fresh optimizer, lr 1e-3, cosine by wall time), again side by side, one thread each, the same minutes.
set -e
PY=.venv/bin/python; R=runs/smol; T=models/smollm2-135m-instruct
MIN=${MIN:-55}
$PY -m peagle.cli datagen --model $T --out data/smol-orig --responses original --num-prompts 1100 --max-new-tokens 200 \
    --max-prompt-tokens 256 --shard-size 100 --code-fraction 0.3 --seed 1
DG="$PY -m peagle.cli datagen --model $T --out data/smol-gen --num-prompts 900 --max-new-tokens 160 --max-prompt-tokens 256 --batch 48 --shard-size 48 --code-fraction 0.3 --threads 1"
timeout 900 $DG --part 0/2 || true                 # as run: stopped after its first shard
rm -f data/smol-gen/shard-0000[1-9].safetensors data/smol-gen/shard-000[1-9]?.safetensors
$PY -m peagle.cli hidden-states --model $T --data data/smol-orig,data/smol-gen --out data/smol-hs --max-tokens 1024 \
    --max-batch-tokens 4096 --threads 2
COMMON="--target $T --data data/smol-hs --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16 --share-embedding --draft-vocab 8192 --lr 1.5e-3 --warmup 20 --epochs 30 --max-minutes $MIN --ckpt-every 25"
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --out $R/e3 $COMMON &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.5 --cod-rmin 0.1 --out $R/pe $COMMON &
wait
for h in e3:eagle3 pe:peagle; do
  mkdir -p models/smollm2-135m-instruct-${h#*:}
  cp $R/${h%:*}/config.json $R/${h%:*}/model.safetensors $R/${h%:*}/train_log.jsonl models/smollm2-135m-instruct-${h#*:}/
done
# part 2
$PY -m peagle.cli datagen --model $T --out data/smol-orig2 --responses original --num-prompts 2600 --max-new-tokens 200 \
    --max-prompt-tokens 256 --shard-size 100 --code-fraction 0.3 --seed 1 --exclude data/smol-orig
$PY -m peagle.cli hidden-states --model $T --data data/smol-orig,data/smol-gen,data/smol-orig2 --out data/smol-hs \
    --max-tokens 1024 --max-batch-tokens 4096 --threads 2
MIN2=${MIN2:-57}
COMMON2="--target $T --data data/smol-hs --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16 --share-embedding --lr 1e-3 --warmup 20 --epochs 30 --max-minutes $MIN2 --ckpt-every 25"
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --init models/smollm2-135m-instruct-eagle3 --out $R/e3b $COMMON2 &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.5 --cod-rmin 0.1 \
    --init models/smollm2-135m-instruct-peagle --out $R/peb $COMMON2 &
wait
for h in e3b:eagle3 peb:peagle; do
  cp $R/${h%:*}/config.json $R/${h%:*}/model.safetensors models/smollm2-135m-instruct-${h#*:}/
  cp $R/${h%:*}/train_log.jsonl models/smollm2-135m-instruct-${h#*:}/train_log_part2.jsonl
done

# part 3 (2026-12-02): SmolLM2's OWN answers, hidden states recorded while it answers (one target pass:
# `datagen --hidden-states`, peagle/train/selfgen.py), 2 workers x 1 thread, greedy, answers <= 256 tokens,
# prompts <= 256 tokens; stopped by the clock (STOP_AFTER seconds), the finished samples renumbered into
# data/smol-self-hs; both heads continued from part 2's weights on that data only, side by side, one thread
# each, the same minutes.
DG3="$PY -m peagle.cli datagen --out data/smol-self --hidden-states --num-prompts 6000 --code-fraction 0.3 --max-new-tokens 256 --max-prompt-tokens 256 --batch 64 --threads 1 --seed 1"
timeout ${STOP_AFTER:-3600} $DG3 --part 0/2 &
sleep 120; timeout ${STOP_AFTER:-3600} $DG3 --part 1/2 &
wait
$PY scripts/compact_hs.py data/smol-self data/smol-self-hs
MIN3=${MIN3:-40}
COMMON3="--target $T --data data/smol-self-hs --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16 --share-embedding --lr 1e-3 --warmup 20 --epochs 3 --max-minutes $MIN3 --ckpt-every 25"
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --init models/smollm2-135m-instruct-eagle3 --out $R/e3c $COMMON3 &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.5 --cod-rmin 0.1 \
    --init models/smollm2-135m-instruct-peagle --out $R/pec $COMMON3 &
wait
for h in e3c:eagle3 pec:peagle; do
  cp $R/${h%:*}/config.json $R/${h%:*}/model.safetensors models/smollm2-135m-instruct-${h#*:}/
  cp $R/${h%:*}/train_log.jsonl models/smollm2-135m-instruct-${h#*:}/train_log_part3.jsonl
done

# part 4 (2026-12-02): the same data (data/smol-self-hs), 3 epochs or MIN4 minutes each, whichever comes first,
# both heads from part 3's weights, side by side, one thread each. EAGLE-3 continues ~0.7^k of its anchors per
# unroll step (--ttt-keep 0.7: 2.9x less CPU per supervised token at equal accuracy,
# docs/training-study/train-cost.md); P-EAGLE's recipe is part 3's.
MIN4=${MIN4:-90}
COMMON4="--target $T --data data/smol-self-hs --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16 --share-embedding --lr 5e-4 --warmup 20 --epochs 3 --max-minutes $MIN4 --ckpt-every 25 --seed 4"
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --ttt-keep 0.7 --init models/smollm2-135m-instruct-eagle3 \
    --out runs/p4/e3 $COMMON4 &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.5 --cod-rmin 0.1 \
    --init models/smollm2-135m-instruct-peagle --out runs/p4/pe $COMMON4 &
wait
for h in e3:eagle3 pe:peagle; do
  cp runs/p4/${h%:*}/config.json runs/p4/${h%:*}/model.safetensors models/smollm2-135m-instruct-${h#*:}/
  cp runs/p4/${h%:*}/train_log.jsonl models/smollm2-135m-instruct-${h#*:}/train_log_part4.jsonl
done

# part 5 data (2026-12-03): more of SmolLM2's own answers with q4 weights (the packaged GGUF's blocks, the same
# model), prompts not in data/smol-self; two single-thread workers, stopped by the clock (STOP_AFTER seconds).
DG5="timeout ${STOP_AFTER:-5000} $PY -m peagle.cli datagen --out data/smol-self-q4 --exclude data/smol-self --hidden-states --quantization q4 --num-prompts 8000 --code-fraction 0.3 --max-new-tokens 256 --max-prompt-tokens 256 --batch 64 --threads 1 --seed 2"
$DG5 --part 0/2 &
sleep 120; $DG5 --part 1/2 &
wait
$PY scripts/compact_hs.py data/smol-self data/smol-self-q4 data/smol-self-hs2     # 6,311 samples, 1.43 M answer tokens

# part 5 (2026-12-03, a study: not shipped, the part-4 heads are issue 38's last committed version this round):
# both heads from part 4's weights on the 3x larger data/smol-self-hs2 (6,311 samples, 1.43 M answer tokens),
# part 4's recipe, side by side, one thread each, MIN5 minutes; snapshots evaluated held-out like part 4's.
# As run: the clock stopped P-EAGLE at step 1,830 and EAGLE-3 at 1,998 (docs/training-study.md, part 5).
MIN5=${MIN5:-100}
COMMON5="--target $T --data data/smol-self-hs2 --max-tokens 1024 --batch-rows 1 --threads 1 --save-dtype bf16 --share-embedding --lr 5e-4 --warmup 20 --epochs 3 --max-minutes $MIN5 --ckpt-every 25 --seed 5"
$PY -m peagle.cli train --method eagle3 --layers 1 --ttt-steps 7 --ttt-keep 0.7 --init models/smollm2-135m-instruct-eagle3 \
    --out runs/p5/e3 $COMMON5 &
$PY -m peagle.cli train --method peagle --layers 2 --depths 8 --segment-len 512 --cod-r 0.5 --cod-rmin 0.1 \
    --init models/smollm2-135m-instruct-peagle --out runs/p5/pe $COMMON5 &
wait
