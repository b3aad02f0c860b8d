#!/usr/bin/env bash
# Packs llama.cpp's sources (from the llama-cpp-python sdist, ../shared/llama-cpp-peer.md)
# pruned to the CPU and CUDA backends into .peer/llama-cuda.tar.xz, small enough to carry to
# the GPU machine, where `tools/gpu-run.sh peer-build` builds its llama-bench.
# Usage: tools/peer-pack.sh [SDIST_DIR]   (default /tmp/peer: downloads the sdist there)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/tmp/peer}
src=$dir/llama_cpp_python-0.3.36/vendor/llama.cpp
if [[ ! -d $src ]]; then
    mkdir -p "$dir"
    [[ -d $dir/venv ]] || python3 -m venv "$dir/venv"
    "$dir/venv/bin/pip" install -q scikit-build-core cmake ninja
    "$dir/venv/bin/pip" download -q --no-deps --no-build-isolation llama-cpp-python==0.3.36 -d "$dir/dl"
    tar -xzf "$dir/dl/llama_cpp_python-0.3.36.tar.gz" -C "$dir"
fi
stage=$(mktemp -d)
mkdir -p "$stage/llama.cpp/ggml/src"
(cd "$src" && cp -r src common include vendor cmake licenses LICENSE CMakeLists.txt "$stage/llama.cpp/")
(cd "$src" && cp -r tools "$stage/llama.cpp/" && rm -rf "$stage/llama.cpp/tools/ui" "$stage/llama.cpp/tools/server/public"*)
# The examples, for llama-speculative (the peer of `--draft-model`), less the phone apps.
(cd "$src" && cp -r examples pocs "$stage/llama.cpp/" \
    && rm -rf "$stage/llama.cpp/examples/"{llama.android,llama.swiftui,model-conversion,sycl})
(cd "$src/ggml" && cp -r CMakeLists.txt cmake include "$stage/llama.cpp/ggml/")
(cd "$src/ggml/src" && find . -maxdepth 1 -type f -exec cp {} "$stage/llama.cpp/ggml/src/" \; \
    && cp -r ggml-cpu ggml-cuda "$stage/llama.cpp/ggml/src/")
# The sdist's files can carry future timestamps.
find "$stage" -newermt now -exec touch {} +
# .peer/ stays out of git: it travels to the GPU machine where `carry` names it.
exclude=$(git rev-parse --git-path info/exclude)
grep -qsx '/.peer/' "$exclude" || echo '/.peer/' >> "$exclude"
mkdir -p .peer
tar -cJf .peer/llama-cuda.tar.xz -C "$stage" llama.cpp
rm -rf "$stage"
ls -la .peer/llama-cuda.tar.xz
