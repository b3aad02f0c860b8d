#!/usr/bin/env bash
# Runs the cargo-fuzz targets, each for SECONDS (default 1800), with a corpus
# seeded from the real models. Works on the stable toolchain through
# RUSTC_BOOTSTRAP (cargo-fuzz needs nightly-only sanitizer flags).
# usage: tools/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-1800}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf_parse tokenizer_load)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
tools/fetch-models.sh
tools/fetch-vocab-corpus.sh
(cd fuzz && cargo run --release --bin make_seeds -- corpus ../models/*.gguf ../models/vocab/*.gguf)
mkdir -p fuzz/logs
for t in "${targets[@]}"; do
  echo "fuzzing $t for ${secs}s"
  (cd fuzz && cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 \
     -print_final_stats=1) 2>&1 | tee "fuzz/logs/$t.log" | grep -E "^#[0-9]+.*(DONE|pulse)|stat::|SUMMARY|panicked|ERROR" || true
done
