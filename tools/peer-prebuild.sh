#!/usr/bin/env bash
# Builds a peer's CUDA binaries here (no GPU; tools/peer-prebuild.md §1-3 set up the toolkit and
# sources under $PEERBUILD), resuming an unfinished build, then strips and packs them for
# `tools/gpu-run.sh peer-unpack` on the GPU machine:
#   llama: llama-bench, llama-batched-bench, llama-speculative -> .peer-bin/llama-cuda-bin.tar.xz
#          (44 MB: carried by a call of its own, the fixtures hidden)
#   ik:    llama-bench -> pieces .peer-bin-ik/NNN/ikpart.NNN of 52 MB, each carried by a call of
#          its own that runs `mkdir -p /root/peer && cp .peer-bin-ik/NNN/* /root/peer/`
# Both directories are git-ignored. A build takes about 1 (llama) and 1.5-3 (ik) hours of 2
# cores at nice 19, so other work keeps the machine.
#   tools/peer-prebuild.sh llama|ik [build|pack|all]
set -euo pipefail
cd "$(dirname "$0")/.."
peer=${1:?llama or ik}
what=${2:-all}
root=${PEERBUILD:-/work/peerbuild}
tk=$root/cudatk
export PATH=/tmp/peer/venv/bin:$PATH
case $peer in
llama)
    src=$root/src-llama/llama.cpp build=$root/build-llama
    targets=(llama-bench llama-batched-bench llama-speculative)
    extra=(-DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_BMI2=ON)
    ;;
ik)
    src=$root/ik_llama.cpp build=$root/build-ik
    targets=(llama-bench)
    extra=()
    ;;
*) echo "peer-prebuild.sh: llama or ik, not $peer" >&2; exit 2 ;;
esac
if [[ $what == build || $what == all ]]; then
    [[ -f $build/build.ninja ]] || cmake -S "$src" -B "$build" -G Ninja \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CCACHE=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DCMAKE_BUILD_TYPE=Release "${extra[@]}" \
        -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" -DCUDAToolkit_ROOT="$tk" -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++ \
        -DCMAKE_CUDA_RUNTIME_LIBRARY=Static -DCUDA_cudart_LIBRARY="$tk/lib64/libcudart_static.a"
    nice -n 19 cmake --build "$build" -j2 --target "${targets[@]}"
fi
if [[ $what == pack || $what == all ]]; then
    stage=$(mktemp -d)
    mkdir -p "$stage/$peer-cuda-bin"
    for t in "${targets[@]}"; do strip -o "$stage/$peer-cuda-bin/$t" "$build/bin/$t"; done
    # llama.cpp's three binaries embed the same fatbin: a 256 MiB dictionary keeps one copy.
    (cd "$stage" && tar -cf - "$peer-cuda-bin" | xz -T1 --lzma2=preset=6,dict=256MiB > "$peer-cuda-bin.tar.xz")
    exclude=$(git rev-parse --git-path info/exclude)
    if [[ $peer == llama ]]; then
        grep -qsx '/.peer-bin/' "$exclude" || echo '/.peer-bin/' >> "$exclude"
        mkdir -p .peer-bin && mv "$stage/llama-cuda-bin.tar.xz" .peer-bin/
        ls -la .peer-bin
    else
        grep -qsx '/.peer-bin-ik/' "$exclude" || echo '/.peer-bin-ik/' >> "$exclude"
        rm -rf .peer-bin-ik && mkdir -p .peer-bin-ik
        (cd "$stage" && split -b 52000000 -d -a 3 ik-cuda-bin.tar.xz ikpart.)
        for p in "$stage"/ikpart.*; do
            n=${p##*.}
            mkdir -p ".peer-bin-ik/$n" && mv "$p" ".peer-bin-ik/$n/"
        done
        ls -la .peer-bin-ik/*
    fi
    rm -rf "$stage"
fi
