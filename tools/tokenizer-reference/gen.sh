#!/usr/bin/env bash
# Regenerates the expected token ids the ts-tokenizer tests compare against,
# with llama.cpp's llama-tokenize, for the three real models on the committed
# texts. See README.md next to this script.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tokenize=${LLAMA_TOKENIZE:-llama-tokenize}
models=${TURBOSPARK_MODELS:-$root/models}
data="$root/crates/ts-tokenizer/tests/data"
out="$data/expected"
mkdir -p "$out"

# variant name | llama-tokenize flags. llama-tokenize parses special tokens
# unless told not to, and adds BOS only when the model asks for it.
variants=(
  "plain|--no-bos --no-parse-special"
  "add-special|--no-parse-special"
  "parse-special|--no-bos"
)

for model in smollm2-135m-instruct-q4_1 gemma-3-270m-q4_k_m qwen2.5-coder-0.5b-instruct-q4_k_m; do
  for text in multilingual specials; do
    for entry in "${variants[@]}"; do
      IFS='|' read -r variant flags <<<"$entry"
      # shellcheck disable=SC2086
      "$tokenize" -m "$models/$model.gguf" -f "$data/$text.txt" --ids --no-escape --log-disable $flags \
        >"$out/$model.$text.$variant.ids"
    done
  done
  echo "ok      $model"
done
