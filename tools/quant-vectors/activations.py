"""Activation rows quantized by llama.cpp's CPU backend at run time (the
`from_float` of ggml_get_type_traits_cpu: for Q8_0/Q8_1 on x86 a SIMD routine
that rounds half to even with id = 127/amax, unlike the reference quantizer),
for ts-cpu's activation test.

usage: python activations.py LIB_DIR OUT.bin
Format, little-endian: u32 case count; per case: u32 ggml type id, u32 k,
k f32 inputs, then the quantized bytes (k / block * block bytes).
"""
import ctypes
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gen import Ggml, T  # noqa: E402


def rows(rng, k):
    out = [
        np.zeros(k),
        np.array([(i % 255) - 127.0 for i in range(k)]),
        # amax 127 in every block: scale 1, so every x.5 value is a rounding tie.
        np.array([127.0 if i % 32 == 0 else (i % 64) - 31.5 for i in range(k)]),
        np.array([((i % 64) - 32) * 0.5 for i in range(k)]),
    ]
    for scale in [1.0, 1e-3, 30.0, 1e4]:
        for _ in range(2):
            out.append(rng.standard_normal(k) * scale)
    # Heavy-tailed rows like real activations with outlier features.
    for _ in range(4):
        r = rng.standard_normal(k)
        r[rng.integers(0, k, 3)] *= 300.0
        out.append(r)
    return [np.ascontiguousarray(r, dtype=np.float32) for r in out]


def main():
    ggml = Ggml(Path(sys.argv[1]))
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    rng = np.random.default_rng(20261130)
    cases = []
    for qtype in [T.Q8_0, T.Q8_1, T.Q8_K]:
        traits = ggml.cpu.ggml_get_type_traits_cpu(int(qtype)).contents
        from_float = fn(traits.from_float)
        block, size = ggml.sizes(qtype)
        for k in ([256, 1024] if qtype == T.Q8_K else [32, 896]):
            for x in rows(rng, k):
                out = np.zeros(k // block * size, dtype=np.uint8)
                from_float(x.ctypes.data, out.ctypes.data, k)
                cases.append((int(qtype), k, x, out))
    with open(sys.argv[2], "wb") as f:
        f.write(struct.pack("<I", len(cases)))
        for ty, k, x, out in cases:
            f.write(struct.pack("<II", ty, k))
            f.write(x.tobytes())
            f.write(out.tobytes())
    print(f"{len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
