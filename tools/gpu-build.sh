#!/usr/bin/env bash
# Builds, here, what tools/gpu-run.sh runs on the GPU machine: the release
# turbospark binary, the CUDA test binary and the bandwidth probe, in .devbin/
# (ignored by git; name it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devbin
cargo build --release -p turbospark
cargo build --release -p ts-cuda --examples
cp target/release/turbospark target/release/examples/bandwidth .devbin/
test_bin=$(cargo test --release -p ts-cuda --test gpu --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="gpu" and m.get("executable"): print(m["executable"])')
cp "$test_bin" .devbin/gpu-tests
strip .devbin/*
ls -la .devbin
