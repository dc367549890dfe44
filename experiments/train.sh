#!/usr/bin/env bash
# Retrain every checkpoint behind experiments/RESULTS.md: 9 decoders of ~42 min and 6 encoders of ~15 min,
# about 7.5 h one run at a time on one core (they were trained two side by side, --threads 1 each). Each run
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
lm lm-vanilla-wd0.5 --weight-decay 0.5        # Gu et al.'s strongest sink lever (the 'targets' section)
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
