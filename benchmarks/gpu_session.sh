#!/usr/bin/env bash
# Issue #12's measurements on one CUDA machine, in stages that each fit one call of 10 minutes:
#
#   bash benchmarks/gpu_session.sh tests       # the gpu suite (-m gpu) and the default suite's exit tests
#   bash benchmarks/gpu_session.sh overhead    # patched/unpatched at 4k/16k/32k, Llama-3.2-1B's shapes, bf16, sdpa
#   bash benchmarks/gpu_session.sh streaming   # throughput, memory at 16k against 256k, generate() at 1k against 64k
#   bash benchmarks/gpu_session.sh training    # LoRA step time at 8k tokens
#   bash benchmarks/gpu_session.sh lmeval      # lm-eval on the held-out corpus, dense and streamed (needs lm-eval)
#
# Each writes its log and JSON to $OUT (default ./gpu-out) and prints the device, torch and CUDA versions first.
# The package runs from this checkout (PYTHONPATH); transformers, peft and accelerate are the machine's own.
# Packages the machine lacks (lm-eval and its needs, gguf) travel as wheels in .whl, ignored by git and carried
# with the call: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` for lm_eval, datasets,
# evaluate, dill, multiprocess, more-itertools, pytablewriter and its five helpers, chardet, nltk and gguf, at the
# versions of a local `pip install -e ".[all]"`; `pip wheel --no-deps` for rouge_score, sqlitedict and
# word2number, which come as source only.
set -euo pipefail
stage=${1:-}
case $stage in tests | overhead | streaming | training | lmeval) ;; *)
    echo "usage: $0 STAGE, one of tests, overhead, streaming, training, lmeval (got '$stage')" >&2
    exit 2
    ;;
esac
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__)" | tee "$out/$stage-device.txt"
shape=(--shape llama-3.2-1b --dtype bfloat16 --device cuda)
case $stage in
tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests-gpu.log"
    python3 -m pytest -q -p no:cacheprovider tests/test_api.py -k "exit or fused" 2>&1 | tee "$out/tests-api.log"
    ;;
overhead)
    for attn in sdpa flex_attention; do
        python3 benchmarks/bench_overhead.py "${shape[@]}" --attn $attn --lengths 4096,16384,32768 \
            --repeats 7,5,3 --json "$out/overhead-$attn.json" 2>&1 | tee "$out/overhead-$attn.log" || true
    done
    ;;
streaming)
    python3 benchmarks/bench_streaming.py throughput "${shape[@]}" --tokens 16384 --no-token-by-token \
        --recompute-tokens 0 2>&1 | tee "$out/streaming-throughput.log"
    python3 benchmarks/bench_streaming.py memory "${shape[@]}" --short 16384 --long 262144 \
        2>&1 | tee "$out/streaming-memory.log"
    python3 benchmarks/bench_streaming.py latency "${shape[@]}" --positions 1024 65536 \
        2>&1 | tee "$out/streaming-latency.log"
    ;;
training)
    python3 benchmarks/bench_lora_step.py --model llama-3.2-1b --device cuda --dtype bfloat16 --length 8192 \
        --batch-size 1 --repeats 15 --json "$out/lora.json" 2>&1 | tee "$out/lora.log"
    ;;
lmeval)
    for device in cuda cpu; do
        for args in "" ",window=1020,sink_tokens=4"; do
            python3 -m hf_attnscale.integrations.lm_eval_harness --model hf-attnscale \
                --model_args "pretrained=builtin:tiny-llama-stdlib,dtype=float32$args" --tasks hfa_stdlib_heldout_1k,hfa_stdlib_heldout_4k \
                --device $device --output_path "$out/lmeval-$device${args:+-streamed}" 2>&1 \
                | tee "$out/lmeval-$device${args:+-streamed}.log"
        done
    done
    ;;
esac
