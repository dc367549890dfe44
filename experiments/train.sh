#!/usr/bin/env bash
# Retrain every checkpoint behind experiments/RESULTS.md: 16 decoders of 35-50 min and 6 encoders of ~15 min,
# about 12.5 h one run at a time on one core (they were trained two side by side, --threads 1 each). Each run
# is resumable: if it stops, run this script again and finished runs are skipped, unfinished ones continue
# from their last checkpoint.
#
#   bash experiments/train.sh [RUNS_DIR]      # default: runs/
#   python experiments/evidence.py --runs runs --out experiments/out    # then the tables and figures
set -euo pipefail
RUNS=${1:-runs}
TOKENIZER=hf_attnscale/assets/tiny-llama-stdlib   # the shipped tokenizer (4096-token byte-level BPE)

# Decoders: 4.2M-parameter Llamas (4 layers, hidden 256, 8 heads of 32), BOS + 127 tokens per window,
# 2000 steps x 32 windows (8.2M tokens), weight decay 0.1, seed 0; they differ only in the patch they train
# under (and the last five in weight decay or seed).
LM="--tokenizer $TOKENIZER --bos --context 128 --heads 8 --batch-size 32 --steps 2000 --snapshot-every 250
    --save-every 250 --threads 1 --eval-lengths 128 512 2048 4096"
lm() { [ -f "$RUNS/$1/training_info.json" ] || python -m hf_attnscale.training.lm --out "$RUNS/$1" $LM "${@:2}"; }
lm lm-vanilla
lm lm-zerokv --zero-kv
lm lm-sink --sink-logit learnable
lm lm-logn --scale logn --no-clamp            # Attention-E: log_128(n)/sqrt(d) in training and after
lm lm-vanilla-wd0.5 --weight-decay 0.5        # Gu et al.'s strongest sink levers (the 'targets' section):
lm lm-vanilla-wd1.0 --weight-decay 1.0        #   weight decay and the learning rate
lm lm-vanilla-lr4e-3 --lr 4e-3
lm lm-vanilla-lr6e-3 --lr 6e-3
# Deeper and longer-trained recipes, same tokens (the 'targets' section): depth and training length are the
# levers Barbero et al. (2025) find strengthen sinks.
lm lm-deep12 --layers 12 --hidden 128 --heads 4 --intermediate 344
lm lm-deep16 --layers 16 --hidden 96 --heads 3 --intermediate 256
lm lm-ctx512 --context 512 --batch-size 8 --eval-lengths 512 2048 8192
lm lm-ctx1024 --context 1024 --batch-size 4 --eval-lengths 1024 4096 8192
for seed in 1 2; do                           # two more seeds of O and E for the decoder table
    lm "lm-vanilla-s$seed" --seed "$seed"
    lm "lm-logn-s$seed" --seed "$seed" --scale logn --no-clamp
done

# Encoders (Su's setting): RoFormer MLMs trained at 64 tokens, O and E (log_512(n), unclamped), 3 seeds.
mlm() { [ -f "$RUNS/$1/training_info.json" ] || python -m hf_attnscale.training.mlm --out "$RUNS/$1" --threads 1 "${@:2}"; }
for seed in 0 1 2; do
    mlm "mlm-o-s$seed" --seed "$seed"
    mlm "mlm-e-s$seed" --seed "$seed" --scale logn --scale-length 512 --no-clamp
done
