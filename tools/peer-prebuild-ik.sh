#!/usr/bin/env bash
# Builds ik_llama.cpp's CUDA llama-bench here (no GPU; tools/peer-prebuild.md §1-3 set up the
# toolkit and sources under $PEERBUILD), resuming an unfinished build, then strips and packs it
# into pieces that each fit a device call: .peer-bin-ik/NNN/ikpart.NNN (git-ignored), which
# `tools/gpu-run.sh peer-unpack` joins on the GPU machine after each piece's call has run
#   mkdir -p /root/peer && cp .peer-bin-ik/NNN/* /root/peer/
# The build takes about 3 hours of 2 cores (nice 19: other work keeps the machine).
#   tools/peer-prebuild-ik.sh [build|pack|all]
set -euo pipefail
cd "$(dirname "$0")/.."
root=${PEERBUILD:-/work/peerbuild}
tk=$root/cudatk
what=${1:-all}
export PATH=/tmp/peer/venv/bin:$PATH
if [[ $what == build || $what == all ]]; then
    [[ -f $root/build-ik/build.ninja ]] || cmake -S "$root/ik_llama.cpp" -B "$root/build-ik" -G Ninja \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CCACHE=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" -DCUDAToolkit_ROOT="$tk" -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++ \
        -DCMAKE_CUDA_RUNTIME_LIBRARY=Static -DCUDA_cudart_LIBRARY="$tk/lib64/libcudart_static.a"
    nice -n 19 cmake --build "$root/build-ik" -j2 --target llama-bench
fi
if [[ $what == pack || $what == all ]]; then
    stage=$(mktemp -d)
    mkdir -p "$stage/ik-cuda-bin"
    strip -o "$stage/ik-cuda-bin/llama-bench" "$root/build-ik/bin/llama-bench"
    # One binary: xz's default dictionary is enough.
    (cd "$stage" && tar -cf - ik-cuda-bin | xz -T2 -6 > ik-cuda-bin.tar.xz)
    # .peer-bin-ik/ stays out of git: its pieces travel to the GPU machine where `carry` names them.
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qsx '/.peer-bin-ik/' "$exclude" || echo '/.peer-bin-ik/' >> "$exclude"
    rm -rf .peer-bin-ik && mkdir -p .peer-bin-ik
    (cd "$stage" && split -b 52000000 -d -a 3 ik-cuda-bin.tar.xz ikpart.)
    for p in "$stage"/ikpart.*; do
        n=${p##*.}
        mkdir -p ".peer-bin-ik/$n" && mv "$p" ".peer-bin-ik/$n/"
    done
    rm -rf "$stage"
    ls -la .peer-bin-ik/*
fi
