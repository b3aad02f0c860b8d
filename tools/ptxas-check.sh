#!/usr/bin/env bash
# Compiles every CUDA kernel here as the backend does at run time (NVRTC, sm_90) and assembles
# the PTX with ptxas, printing each kernel's registers and spills: catches what NVRTC passes
# through unchecked (inline asm) before a device lease. No GPU needed; NVRTC and ptxas come
# from PyPI's nvidia-cuda-nvrtc / nvidia-cuda-nvcc wheels, unpacked under /tmp once.
# TURBOSPARK_NVRTC_DEFINES="A=1 B" checks a kernel variant, as the backend compiles it.
#   tools/ptxas-check.sh [KERNEL_REGEX]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=/tmp/ts-cuda-tools
if [[ ! -x $dir/nvidia/cu13/bin/ptxas || ! -d $dir/nvidia/cu13/lib ]]; then
    mkdir -p $dir/whl
    python3 -m pip download -q --no-deps -d $dir/whl nvidia-cuda-nvcc nvidia-cuda-nvrtc
    for w in $dir/whl/*.whl; do (cd $dir && unzip -qo "$w"); done
fi
ptx=$dir/kernels.ptx
LD_LIBRARY_PATH=$dir/nvidia/cu13/lib TS_PTX_OUT=$ptx \
    cargo test --release -p ts-cuda --test dequant_host -- --ignored nvrtc_compiles 2>&1 | grep -E "test result|panicked"
$dir/nvidia/cu13/bin/ptxas -arch=sm_90 -v "$ptx" -o $dir/kernels.cubin 2>&1 \
    | grep -A2 "Function properties for ${1:-}" | grep -E "Function properties|spill|registers" || true
echo "ptxas: the PTX assembles for sm_90"
