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

# Pre-tokenizers no shipped vocabulary uses: the qwen2 test vocabulary
# (tools/fetch-vocab-corpus.sh) relabelled with each, on the multilingual text.
vocab="$models/vocab/ggml-vocab-qwen2.gguf"
if [ ! -f "$vocab" ]; then
  echo "skip    pre-tokenizer variants: $vocab is absent (run tools/fetch-vocab-corpus.sh)"
  exit 0
fi
pres=(
  default gpt-2 llama-bpe qwen2 qwen35 smollm starcoder refact command-r falcon mpt deepseek-llm deepseek-coder
  deepseek-v3 spark2_5 youtu jais-2 gemma4 sarvam-moe stablelm2 dbrx poro-chat bloom viking chatglm-bpe glm4
  tekken chameleon gpt-4o minimax-m2 granite-embed-multi-97m bailingmoe seed-coder ufakzeka laguna exaone-moe
  minicpm5 trillion grok-2 hunyuan
)
# Every test vocabulary on the committed texts, including those llama.cpp
# ships without .inp/.out vectors.
mkdir -p "$out/vocab"
for gguf in "$models"/vocab/ggml-vocab-*.gguf; do
  name=$(basename "$gguf" .gguf)
  name=${name#ggml-vocab-}
  "$tokenize" -m "$gguf" -f "$data/multilingual.txt" --ids --no-escape --log-disable --no-bos --no-parse-special \
    >"$out/vocab/$name.multilingual.plain.ids"
  "$tokenize" -m "$gguf" -f "$data/specials.txt" --ids --no-escape --log-disable --no-bos \
    >"$out/vocab/$name.specials.parse-special.ids"
done
echo "ok      vocabularies on the committed texts"

mkdir -p "$out/pre"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$root" && cargo build -q --release -p ts-tokenizer --example with_pre)
with_pre="${CARGO_TARGET_DIR:-$root/target}/release/examples/with_pre"
for pre in "${pres[@]}"; do
  "$with_pre" "$vocab" "$pre" "$tmp/vocab.gguf"
  "$tokenize" -m "$tmp/vocab.gguf" -f "$data/multilingual.txt" --ids --no-escape --log-disable --no-bos --no-parse-special \
    >"$out/pre/$pre.ids"
done
echo "ok      ${#pres[@]} pre-tokenizer variants"
