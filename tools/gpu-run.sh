#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the CUDA op and fixture tests, then
# benchmarks on synthetic models, from binaries built here by tools/gpu-build.sh
# into .devbin/. Usage there: tools/gpu-run.sh [tests|bench|all|real]
# (`real`: the real models staged by tools/gpu-stage.sh, greedy on GPU vs CPU.)
set -u
what=${1:-all}
export TURBOSPARK_ROOT=$PWD
B=$PWD/.devbin
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
if [[ $what == tests || $what == all ]]; then
    "$B"/gpu-tests --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "^test .* ok$"
fi
if [[ $what == real ]]; then
    "$B"/gpu-tests --test-threads=1 --nocapture real_models 2>&1 | tee "$OUT/gpu-real.log"
fi
if [[ $what == bench || $what == all ]]; then
    "$B"/bandwidth 2>&1 | tee "$OUT/bandwidth.log"
    for like in gpt-oss-20b qwen3-30b-a3b; do
        f=/tmp/$like.gguf
        [[ -f $f ]] || "$B"/turbospark synth --like "$like" -o "$f" 2>&1 | tail -1
        start=$SECONDS
        "$B"/turbospark bench -m "$f" --device cuda -p 512 -n 128 -r 2 2>&1 | tee "$OUT/bench-$like.log"
        echo "load + bench: $((SECONDS - start)) s"
        # A quarter of the expert bytes in VRAM, the rest in pinned host RAM.
        quarter=$("$B"/turbospark inspect --json "$f" | python3 -c 'import json,sys
d=json.load(sys.stdin); print(sum(t["bytes"] for t in d["tensors"] if "_exps" in t["name"]) // 4)')
        "$B"/turbospark bench -m "$f" --device cuda --expert-cache "$quarter" -p 512 -n 128 -r 2 2>&1 \
            | tee "$OUT/bench-$like-tier.log"
    done
fi
