#!/usr/bin/env bash
# Train the heads shipped in heads/shipped from scratch, on a CPU, and ship them.
#
#   bash scripts/train_default_heads.sh [RUNS_DIR]
#
# Stage 1 runs both heads side by side, one thread each (a 2-core machine), on the packaged ShareGPT (first 3000
# conversations). Stage 2 continues the EAGLE-3 head with both threads on 12000 conversations. Stage 3 continues it
# on self-distilled data (the target's own greedy replies to the first 400 ShareGPT prompts); the Medusa head's
# stage 2 continues it on the same replies. Stage 4 continues the EAGLE-3 head on the target's bf16 greedy replies
# to the first 1664 ShareGPT prompts, with the features recorded while generating them (no target pass in
# training). The Medusa head's stages 3 and 4 continue it on such a store of its own (replies to the first 1532
# prompts, the last hidden state recorded), two passes at a constant learning rate, then two more with the rate
# decaying; its static tree is then measured on the target's replies to ShareGPT prompts 16000-16127, which no stage
# trains on. Each shipped config.json records its commands and wall times; the curves and acceptance of each stage
# are in scripts/results/README.md. The configs also carry the runtime's tree defaults, chosen with
# scripts/tune_tree.py in each dtype (EAGLE-3 depth 4, top-k 16, 2 verified tokens in fp32 and 8 in bf16; Medusa 2
# in fp32 and 6 in bf16; measured on a CPU with AMX, where extra rows of a bf16 pass are cheap), the size adaptive
# tree sizing starts from.
# The DFlash head (2 drafter layers, blocks of 8) trains last, in one stage from scratch: about two passes over the
# target's bf16 greedy replies to the first 4992 ShareGPT prompts, with the features recorded while generating them
# (the shipped EAGLE-3 head drafts while generating: lossless, only faster).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-runs}
export WANDB_MODE=${WANDB_MODE:-offline}
COMMON="trainer.threads=1 trainer.warmup_steps=10 data.max_samples=3000 eval.max_samples=16 checkpoint.every=20"

timed() {  # timed SECONDS_FILE command...: runs the command, writes its wall time in seconds
  local out=$1; shift
  local start=$SECONDS
  "$@"
  echo $((SECONDS - start)) > "$out"
}

mkdir -p "$RUNS"
timed "$RUNS/eagle3.seconds" python training/train.py head=eagle3 head.ttt_steps=4 head.lr=3e-4 trainer.lr=3e-4 \
  trainer.max_steps=220 eval.at_start=false eval.every=55 $COMMON output_dir="$RUNS/smollm2-eagle3" &
EAGLE3_STAGE1=$!
timed "$RUNS/medusa.seconds" python training/train.py head=medusa \
  trainer.max_steps=100 eval.at_start=false eval.every=50 $COMMON output_dir="$RUNS/smollm2-medusa" &
MEDUSA_STAGE1=$!
# `wait` alone returns 0 whatever the jobs returned: wait for each, so that a failed stage stops the script here
# instead of later stages building on a half-trained head
wait "$EAGLE3_STAGE1"
wait "$MEDUSA_STAGE1"

# stage 2 continues stage 1 as it was shipped (bf16 weights), and the stage's record keeps its wall time
python scripts/ship_head.py "$RUNS/smollm2-eagle3" smollm2-135m-eagle3-stage1 --into "$RUNS/stages" \
  --train-seconds "$(cat "$RUNS/eagle3.seconds")"
timed "$RUNS/eagle3-long.seconds" python training/train.py head=eagle3 head.ttt_steps=4 head.lr=3e-4 trainer.lr=3e-4 \
  trainer.threads=2 trainer.max_steps=3000 trainer.stop_after=900 trainer.warmup_steps=10 trainer.seed=1 \
  data.max_samples=12000 eval.at_start=false eval.every=250 eval.max_samples=16 checkpoint.every=20 \
  init_from="$RUNS/stages/smollm2-135m-eagle3-stage1" output_dir="$RUNS/smollm2-eagle3-long"
python scripts/ship_head.py "$RUNS/smollm2-eagle3-long" smollm2-135m-eagle3-stage2 --into "$RUNS/stages" \
  --train-seconds "$(cat "$RUNS/eagle3-long.seconds")"

SELFDISTILL="python scripts/prepare_data.py selfdistill --out $RUNS/sd/sharegpt_sd.jsonl --max-new-tokens 256 \
--batch-size 16 data.max_samples=368"
timed "$RUNS/sd.seconds" $SELFDISTILL
timed "$RUNS/eagle3-sd.seconds" python training/train.py head=eagle3 head.ttt_steps=4 head.lr=2e-4 trainer.lr=2e-4 \
  trainer.threads=2 trainer.max_steps=190 trainer.warmup_steps=10 \
  data=selfdistill data.path="$RUNS/sd/sharegpt_sd.jsonl" data.val_samples=24 \
  eval.at_start=true eval.every=95 eval.max_samples=24 checkpoint.every=20 \
  init_from="$RUNS/stages/smollm2-135m-eagle3-stage2" output_dir="$RUNS/smollm2-eagle3-sd"
python scripts/ship_head.py "$RUNS/smollm2-eagle3-sd" smollm2-135m-eagle3-stage3 --into "$RUNS/stages" \
  --train-seconds "$(cat "$RUNS/eagle3-sd.seconds")" \
  --data-command "$SELFDISTILL" --data-seconds "$(cat "$RUNS/sd.seconds")"

RECORD="python scripts/prepare_data.py selfdistill --out $RUNS/sd4/sharegpt_sd.jsonl --features $RUNS/sd4/store \
--max-new-tokens 256 --batch-size 16 --dtype bfloat16 --proposer eagle3+ngram:$RUNS/stages/smollm2-135m-eagle3-stage3 \
head=eagle3 data.max_samples=1632"
timed "$RUNS/sd4.seconds" $RECORD
timed "$RUNS/eagle3-recorded.seconds" python training/train.py head=eagle3 head.ttt_steps=4 head.lr=2e-4 \
  trainer.lr=2e-4 trainer.threads=2 trainer.max_steps=760 trainer.warmup_steps=10 \
  features.mode=recorded features.dir="$RUNS/sd4/store" data.val_samples=32 \
  eval.at_start=true eval.every=95 eval.max_samples=32 checkpoint.every=50 \
  init_from="$RUNS/stages/smollm2-135m-eagle3-stage3" output_dir="$RUNS/smollm2-eagle3-recorded"
python scripts/ship_head.py "$RUNS/smollm2-eagle3-recorded" smollm2-135m-eagle3 --depth 4 --top-k 16 \
  --tree-size float32=2 --tree-size bfloat16=8 \
  --train-seconds "$(cat "$RUNS/eagle3-recorded.seconds")" \
  --data-command "$RECORD" --data-seconds "$(cat "$RUNS/sd4.seconds")"
python scripts/ship_head.py "$RUNS/smollm2-medusa" smollm2-135m-medusa-stage1 --into "$RUNS/stages" \
  --train-seconds "$(cat "$RUNS/medusa.seconds")"
timed "$RUNS/medusa-sd.seconds" python training/train.py head=medusa trainer.threads=2 trainer.max_steps=200 \
  trainer.warmup_steps=10 data=selfdistill data.path="$RUNS/sd/sharegpt_sd.jsonl" data.val_samples=24 \
  eval.at_start=true eval.every=100 eval.max_samples=24 checkpoint.every=20 \
  init_from="$RUNS/stages/smollm2-135m-medusa-stage1" output_dir="$RUNS/smollm2-medusa-sd"
python scripts/ship_head.py "$RUNS/smollm2-medusa-sd" smollm2-135m-medusa-stage2 --into "$RUNS/stages" \
  --train-seconds "$(cat "$RUNS/medusa-sd.seconds")" \
  --data-command "$SELFDISTILL" --data-seconds "$(cat "$RUNS/sd.seconds")"

RECORD_MEDUSA="python scripts/prepare_data.py selfdistill --out $RUNS/sdm/sharegpt_sd.jsonl --features $RUNS/sdm/store \
--max-new-tokens 256 --batch-size 32 --chunk 256 --dtype bfloat16 head=medusa data.max_samples=1500"
timed "$RUNS/sdm.seconds" $RECORD_MEDUSA
MEDUSA_RECORDED="head=medusa head.lr=5e-4 trainer.lr=5e-4 trainer.warmup_steps=10 trainer.precision=bf16 \
trainer.threads=2 trainer.max_steps=560 features.mode=recorded features.dir=$RUNS/sdm/store \
features.first_conversation=368 data.val_samples=32 eval.max_samples=32 checkpoint.every=70"
timed "$RUNS/medusa-recorded.seconds" python training/train.py $MEDUSA_RECORDED trainer.min_lr_ratio=1.0 \
  eval.at_start=true eval.every=140 init_from="$RUNS/stages/smollm2-135m-medusa-stage2" \
  output_dir="$RUNS/smollm2-medusa-recorded"
python scripts/ship_head.py "$RUNS/smollm2-medusa-recorded" smollm2-135m-medusa-stage3 --into "$RUNS/stages" \
  --train-seconds "$(cat "$RUNS/medusa-recorded.seconds")" \
  --data-command "$RECORD_MEDUSA" --data-seconds "$(cat "$RUNS/sdm.seconds")"
timed "$RUNS/medusa-anneal.seconds" python training/train.py $MEDUSA_RECORDED trainer.min_lr_ratio=0.05 \
  eval.at_start=false eval.every=280 init_from="$RUNS/stages/smollm2-135m-medusa-stage3" \
  output_dir="$RUNS/smollm2-medusa-anneal"
# the static tree, measured on the target's replies to ShareGPT prompts that no stage trained on
python scripts/prepare_data.py prompts --out "$RUNS/calibration_prompts.jsonl" --skip 16000 --count 200
python scripts/eval_head.py --head "$RUNS/smollm2-medusa-anneal/head" --prompts "$RUNS/calibration_prompts.jsonl" \
  --limit 128 --out "$RUNS/medusa_tree.json"
python scripts/ship_head.py "$RUNS/smollm2-medusa-anneal" smollm2-135m-medusa --rank-paths "$RUNS/medusa_tree.json" \
  --tree-size float32=2 --tree-size bfloat16=6 --train-seconds "$(cat "$RUNS/medusa-anneal.seconds")" \
  --data-command "$RECORD_MEDUSA" --data-seconds "$(cat "$RUNS/sdm.seconds")"

RECORD_DFLASH="python scripts/prepare_data.py selfdistill --out $RUNS/sdd/sharegpt_sd.jsonl --features $RUNS/sdd/store \
--max-new-tokens 256 --batch-size 16 --dtype bfloat16 --proposer eagle3+ngram head=dflash features.dtype=bfloat16"
DFLASH="head=dflash head.num_layers=2 head.block_size=8 head.loss_gamma=4 head.num_anchors=64 trainer.threads=2 \
trainer.precision=bf16 features.mode=recorded features.dir=$RUNS/sdd/store data.val_samples=32 checkpoint.every=50"
timed "$RUNS/sdd.seconds" $RECORD_DFLASH data.max_samples=4960
timed "$RUNS/dflash.seconds" python training/train.py $DFLASH trainer.max_steps=2600 trainer.warmup_steps=20 \
  eval.every=325 eval.max_samples=32 output_dir="$RUNS/smollm2-dflash"
python scripts/ship_head.py "$RUNS/smollm2-dflash" smollm2-135m-dflash --top-k 2 --tree-size bfloat16=4 \
  --train-seconds "$(cat "$RUNS/dflash.seconds")" --data-command "$RECORD_DFLASH data.max_samples=4960" \
  --data-seconds "$(cat "$RUNS/sdd.seconds")"
