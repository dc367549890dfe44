#!/usr/bin/env bash
# The measurements that need a CUDA machine, in stages that each fit one call of 10 minutes:
#
#   bash benchmarks/gpu_session.sh tests       # the gpu suite (-m gpu) and the exit's tests
#   bash benchmarks/gpu_session.sh rerope      # ReRoPE + logn (flex bands, and public) against unpatched at 16k and
#                                              # 32k, Llama-3.2-1B's shape; then at 16k, SmolLM2's shape; bf16, sdpa
#   bash benchmarks/gpu_session.sh decode      # the same at 16k with the decode steps compiled, as users run them
#   bash benchmarks/gpu_session.sh overhead    # patched/unpatched at 4k/16k/32k, Llama-3.2-1B's shapes, bf16, sdpa
#   bash benchmarks/gpu_session.sh memory      # the exit with a learnable sink under a padding mask, 16k and 32k
#   bash benchmarks/gpu_session.sh streaming   # throughput, memory at 16k against 256k, generate() at 1k against 64k
#   bash benchmarks/gpu_session.sh training    # LoRA step time at 8k tokens
#   bash benchmarks/gpu_session.sh lmeval      # lm-eval on the held-out corpus, dense and streamed (needs lm-eval)
#   bash benchmarks/gpu_session.sh tests overhead memory    # several in one call, in that order
#
# Seen on an H200 (2026-11-27, the first session; benchmarks/RESULTS.md, "On a GPU"): the machine starts in
# under a minute; tests took 153 s (the gpu suite 64 s of it), rerope 186 s, and overhead more than 5 minutes
# (4k alone about 100 s with every variant). At 32k, a forward and backward with ReRoPE does not fit in 139 GiB,
# so overhead times only the forward there. A session with 15 minutes of device time fits tests, rerope and part
# of overhead; name the stages in the order you need them. The second session (same day, same kind of machine) ran
# `pytest -m gpu -k "rerope or flex"` (67 s) and the rerope stage, which needs about 5 minutes whole (its
# bench_overhead part took about 100 s; a 290 s limit stopped bench_rerope after 2 of its 3 repeats).
#
# A failing stage is recorded and the next one runs; the exit status is that of the last failure. Results
# accumulate in $RESULTS (default gpu-out/, ignored by git, kept on a warm machine between calls): each stage's
# log and JSON, and summary.md, one line per stage run (device, status, seconds). When $OUT is set (the device
# tool's folder that comes back), the results are copied there at the end, as one tarball and summary.md.
# Memory is measured in process (torch.cuda.max_memory_allocated after a reset), never in fresh processes.
#
# The package runs from this checkout (PYTHONPATH); transformers, peft and accelerate are the machine's own.
# Packages the machine lacks (lm-eval and its needs, gguf) travel as wheels in .whl, ignored by git and carried
# with the call: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` for lm_eval, datasets,
# evaluate, dill, multiprocess, more-itertools, pytablewriter and its five helpers, chardet, nltk and gguf, at the
# versions of a local `pip install -e ".[all]"`; `pip wheel --no-deps` for rouge_score, sqlitedict and
# word2number, which come as source only.
set -uo pipefail
stages=("$@")
valid="tests rerope decode overhead memory streaming training lmeval"
for stage in "${stages[@]:-}"; do
    if [[ " $valid " != *" $stage "* ]]; then
        echo "usage: $0 STAGE..., each one of: $valid (got '$stage')" >&2
        exit 2
    fi
done
results=${RESULTS:-gpu-out}
mkdir -p "$results"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
device=$(python3 -c "import torch, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__)")
echo "$device"
shape=(--shape llama-3.2-1b --dtype bfloat16 --device cuda)

run_stage() {
    case $1 in
    tests)
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$results/tests-gpu.log"
        local gpu=$?
        python3 -m pytest -q -p no:cacheprovider tests/core/test_exit.py tests/test_api.py -k "exit" 2>&1 |
            tee "$results/tests-exit.log"
        return $((gpu || $?))
        ;;
    rerope)
        python3 benchmarks/bench_overhead.py "${shape[@]}" --lengths 16384,32768 --repeats 3,2 \
            --backward-max-length 16384 --variants "unpatched,rerope+logn,rerope+logn public" \
            --json "$results/overhead-rerope.json" 2>&1 | tee "$results/overhead-rerope.log" &&
            python3 benchmarks/bench_rerope.py --device cuda --shape smollm2-135m-shape --dtype bfloat16 \
                --tokens 16384 --repeats 3 --variants "ReRoPE + logn" 2>&1 | tee "$results/rerope.log"
        ;;
    decode)
        python3 benchmarks/bench_rerope.py --device cuda --shape smollm2-135m-shape --dtype bfloat16 \
            --tokens 16384 --repeats 3 --variants "ReRoPE + logn" --compile 2>&1 | tee "$results/rerope-compiled.log"
        ;;
    overhead)
        python3 benchmarks/bench_overhead.py "${shape[@]}" --lengths 4096,16384,32768 --repeats 7,5,3 \
            --backward-max-length 16384 --json "$results/overhead-sdpa.json" 2>&1 | tee "$results/overhead-sdpa.log"
        ;;
    memory)
        python3 benchmarks/bench_overhead.py "${shape[@]}" --lengths 16384,32768 --repeats 3 --padded \
            --no-backward --variants unpatched,logn+sink --json "$results/memory-padded.json" 2>&1 |
            tee "$results/memory-padded.log"
        ;;
    streaming)
        python3 benchmarks/bench_streaming.py throughput "${shape[@]}" --tokens 16384 --no-token-by-token \
            --recompute-tokens 0 2>&1 | tee "$results/streaming-throughput.log" &&
            python3 benchmarks/bench_streaming.py memory "${shape[@]}" --short 16384 --long 262144 \
                2>&1 | tee "$results/streaming-memory.log" &&
            python3 benchmarks/bench_streaming.py latency "${shape[@]}" --positions 1024 65536 \
                2>&1 | tee "$results/streaming-latency.log"
        ;;
    training)
        python3 benchmarks/bench_lora_step.py --model llama-3.2-1b --device cuda --dtype bfloat16 --length 8192 \
            --batch-size 1 --repeats 15 --json "$results/lora.json" 2>&1 | tee "$results/lora.log"
        ;;
    lmeval)
        local failed=0 dev args name
        for dev in cuda cpu; do
            for args in "" ",window=1020,sink_tokens=4"; do
                name="lmeval-$dev${args:+-streamed}"
                python3 -m hf_attnscale.integrations.lm_eval_launcher --model hf-attnscale \
                    --model_args "pretrained=builtin:tiny-llama-stdlib,dtype=float32$args" \
                    --tasks hfa_stdlib_heldout_1k,hfa_stdlib_heldout_4k --device $dev \
                    --output_path "$results/$name" 2>&1 | tee "$results/$name.log" || failed=1
            done
        done
        return $failed
        ;;
    esac
}

status=0
for stage in "${stages[@]}"; do
    start=$SECONDS
    if run_stage "$stage"; then outcome=ok; else outcome=FAILED status=1; fi
    line="$(date -u +%FT%TZ) | $stage | $outcome | $((SECONDS - start)) s | $device"
    echo "$line" | tee -a "$results/summary.md"
done
if [ -n "${OUT:-}" ]; then
    cp "$results/summary.md" "$OUT/"
    tar -czf "$OUT/gpu-results.tar.gz" -C "$results" .
fi
exit $status
