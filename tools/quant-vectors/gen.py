#!/usr/bin/env python3
"""Generate the ts-quant test vectors from independent references.

For every tensor type ts-quant handles this writes one `<TYPE>.tsqv` file holding
  - raw blocks: llama.cpp's reference quantizer applied to seeded f32 data of several
    scales and shapes, plus edge cases, plus blocks of random bytes with finite scales;
  - the expected dequantized f32 output of those blocks, from the PyPI `gguf` package
    where it dequantizes the type, otherwise from llama.cpp's `dequantize_row_*`;
  - llama.cpp's reference quantizer input and output, for bit-exact quantize tests;
  - a few weight/activation row pairs with llama.cpp's CPU `vec_dot` result;
  - hashes of llama.cpp's quantizer output and of the reference dequantization over bulk data
    that the Rust tests rebuild bit for bit from a seed.

llama.cpp is reached through ctypes on a built libggml-base.so / libggml-cpu.so.
See README.md for the exact commands and the file format.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

MAGIC = b"TSQV0001"

# (elements per block, bytes per block) as ggml defines them, filled from libggml-base.
GGML_QUANT_SIZES_GGML: dict[T, tuple[int, int]] = {}

# Bulk checks: elements per type, and how many blocks each stored hash covers.
BULK_ELEMENTS = {32: 2048 * 32, 256: 256 * 256, 1: 4096}
BULK_CHUNK_BLOCKS = 64

# Types ts-quant implements; the order is only the order of generation.
TYPES = [
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K,
    T.MXFP4,
]

# Types whose expected dequantization comes from gguf-py (everything else: llama.cpp).
GGUF_DEQUANTIZES = {
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4,
}

# Activation type llama.cpp quantizes to for each weight type (ggml-cpu.c type_traits_cpu).
VEC_DOT_TYPE = {
    T.F32: T.F32, T.F16: T.F16, T.BF16: T.BF16,
    T.Q4_0: T.Q8_0, T.Q5_0: T.Q8_0, T.Q8_0: T.Q8_0, T.MXFP4: T.Q8_0,
    T.Q4_1: T.Q8_1, T.Q5_1: T.Q8_1,
    T.Q2_K: T.Q8_K, T.Q3_K: T.Q8_K, T.Q4_K: T.Q8_K, T.Q5_K: T.Q8_K, T.Q6_K: T.Q8_K,
}

# Byte offsets of the f16 scale fields in each block (layouts per ggml-common.h);
# random-byte blocks get finite values written there.
F16_SCALE_OFFSETS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q8_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


class Ggml:
    """The few llama.cpp entry points the generator needs."""

    def __init__(self, lib_dir: Path):
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=mode)

        f = self.base.ggml_quantize_chunk
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_void_p]
        for name in ["quantize_row_q8_1_ref", "quantize_row_q8_K_ref", "dequantize_row_q8_0",
                     "dequantize_row_q8_K", "dequantize_row_q4_0", "dequantize_row_q4_1",
                     "dequantize_row_q5_0", "dequantize_row_q5_1", "dequantize_row_q2_K",
                     "dequantize_row_q3_K", "dequantize_row_q4_K", "dequantize_row_q5_K",
                     "dequantize_row_q6_K", "dequantize_row_mxfp4", "ggml_fp16_to_fp32_row",
                     "ggml_bf16_to_fp32_row"]:
            fn = getattr(self.base, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

        class Traits(ctypes.Structure):
            _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                        ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                        ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                        ("from_float_ref", ctypes.c_void_p)]

        self.base.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
        self.base.ggml_get_type_traits.argtypes = [ctypes.c_int]

        self.cpu.ggml_cpu_init.restype = None
        self.cpu.ggml_cpu_init()

        class TraitsCpu(ctypes.Structure):
            _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                        ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]

        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCpu)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        self.vec_dot_fn = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t,
                                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_int)

    def sizes(self, qtype: T) -> tuple[int, int]:
        """(elements per block, bytes per block) as ggml itself defines them."""
        traits = self.base.ggml_get_type_traits(int(qtype)).contents
        return traits.blck_size, traits.type_size

    def quantize(self, qtype: T, x: np.ndarray) -> np.ndarray:
        """llama.cpp's reference quantizer (no importance matrix), one block per row."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        block_size, type_size = self.sizes(qtype)
        assert x.size % block_size == 0
        out = np.zeros(x.size // block_size * type_size, dtype=np.uint8)
        if qtype == T.Q8_1:
            self.base.quantize_row_q8_1_ref(x.ctypes.data, out.ctypes.data, x.size)
        elif qtype == T.Q8_K:
            self.base.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, x.size)
        else:
            n_per_row = block_size
            written = self.base.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0,
                                                    x.size // n_per_row, n_per_row, None)
            assert written == out.size
        return out

    def dequantize(self, qtype: T, blocks: np.ndarray) -> np.ndarray:
        """llama.cpp's `dequantize_row_*` (Q8_1 has none: its d and qs are read as Q8_0)."""
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        block_size, type_size = self.sizes(qtype)
        n_blocks = blocks.size // type_size
        if qtype == T.Q8_1:
            as_q8_0 = blocks.reshape(n_blocks, type_size)
            blocks = np.ascontiguousarray(np.concatenate([as_q8_0[:, 0:2], as_q8_0[:, 4:]], axis=1))
            qtype = T.Q8_0
        out = np.zeros(n_blocks * block_size, dtype=np.float32)
        name = {T.F16: "ggml_fp16_to_fp32_row", T.BF16: "ggml_bf16_to_fp32_row"}.get(
            qtype, f"dequantize_row_{qtype.name.lower().replace('_k', '_K')}")
        getattr(self.base, name)(blocks.ctypes.data, out.ctypes.data, out.size)
        return out

    def vec_dot(self, qtype: T, n: int, weights: np.ndarray, activations: np.ndarray) -> float:
        traits = self.cpu.ggml_get_type_traits_cpu(int(qtype)).contents
        assert traits.vec_dot_type == int(VEC_DOT_TYPE[qtype]), qtype.name
        fn = self.vec_dot_fn(traits.vec_dot)
        weights = np.ascontiguousarray(weights)
        activations = np.ascontiguousarray(activations)
        result = ctypes.c_float(0.0)
        fn(n, ctypes.byref(result), 0, weights.ctypes.data, 0, activations.ctypes.data, 0, 1)
        return float(np.float32(result.value))


def quantize_float(qtype: T, x: np.ndarray, ggml: Ggml) -> np.ndarray:
    if qtype == T.F32:
        return x.astype(np.float32).view(np.uint8).copy()
    return ggml.quantize(qtype, x)


def input_blocks(rng: np.random.Generator, block_size: int, float_type: bool) -> np.ndarray:
    """Seeded f32 inputs for the reference quantizer: several scales and shapes, then edge cases.

    For 256-element super-blocks the edge cases become 32-element sub-blocks mixed into
    two super-blocks, which also exercises sub-blocks of very different ranges side by side.
    """

    def big(n: int) -> np.ndarray:
        v = rng.choice([-1.0, 1.0], n) * rng.uniform(3e4, 6e4, n)
        v[0] = 65504.0  # the f16 maximum
        return v

    def one_hot(n: int) -> np.ndarray:
        v = np.zeros(n)
        v[n // 3] = -5.0
        return v

    def outliers(n: int) -> np.ndarray:
        v = rng.standard_normal(n)
        v[:: max(1, n // 8)] *= 100.0
        return v

    kinds = [
        lambda n: rng.standard_normal(n),
        lambda n: rng.standard_normal(n) * 1e-3,
        lambda n: rng.standard_normal(n) * 30.0,
        lambda n: rng.standard_normal(n) * 2e3,
        lambda n: rng.uniform(-1.0, 1.0, n),
        lambda n: rng.laplace(0.0, 0.5, n),
        lambda n: rng.uniform(0.5, 2.0, n),  # positive only
        lambda n: -rng.uniform(0.1, 3.0, n),  # negative only
        lambda n: rng.standard_normal(n) * 1e-6,  # f16 scales become subnormal
        lambda n: rng.standard_normal(n) * 1e-20,  # below the k-quants' all-zero threshold
        lambda n: np.zeros(n),
        lambda n: np.full(n, 0.3),
        one_hot,
        big,
        outliers,
        lambda n: rng.standard_normal(n),
    ]
    if block_size <= 32:
        rows = [kind(block_size) for kind in kinds]
    else:
        rows = [kinds[0](block_size), kinds[3](block_size), kinds[9](block_size), kinds[10](block_size),
                big(block_size)]
        chunks = [kind(32) for kind in kinds]
        order = rng.permutation(len(chunks))
        rows += [np.concatenate([chunks[i] for i in order[j:j + block_size // 32]])
                 for j in range(0, len(chunks), block_size // 32)]
    x = np.concatenate(rows).astype(np.float32)
    if float_type:
        # Rounding edge cases for f16/bf16: ties, overflow to infinity, subnormals, a NaN.
        special = np.array([
            1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65519.0, 65520.0, 1e6, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, -0.0, np.inf, -np.inf, np.nan,
        ], dtype=np.float32)
        x = np.concatenate([x, special])
    return x


def random_blocks(rng: np.random.Generator, qtype: T, count: int, type_size: int) -> np.ndarray:
    """Blocks of random bytes whose scale fields hold random finite values."""
    if qtype in (T.F32, T.F16, T.BF16):
        n = count * 32
        if qtype == T.F32:
            bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
            bits = bits[(bits & 0x7F800000) != 0x7F800000]
        else:
            bits = rng.integers(0, 2**16, n, dtype=np.uint32).astype(np.uint16)
            exp_mask = 0x7C00 if qtype == T.F16 else 0x7F80
            bits = bits[(bits & exp_mask) != exp_mask]
        return bits.view(np.uint8).copy()
    raw = rng.integers(0, 256, (count, type_size), dtype=np.uint16).astype(np.uint8)
    if qtype == T.Q8_K:
        # f32 scale with a moderate exponent so products stay finite
        d = (rng.standard_normal(count) * 10.0 ** rng.uniform(-6, 3, count)).astype(np.float32)
        raw[:, 0:4] = d.view(np.uint8).reshape(count, 4)
        # bsums are whatever the bytes say: dequantization ignores them
    for off in F16_SCALE_OFFSETS.get(qtype, []):
        h = finite_f16(rng.integers(0, 2**16, count, dtype=np.uint32).astype(np.uint16))
        raw[:, off:off + 2] = h.view(np.uint8).reshape(count, 2)
    return raw.reshape(-1)


def dot_rows(rng: np.random.Generator, qtype: T, ggml: Ggml):
    """Weight rows and activation rows (quantized by llama.cpp's reference) with llama.cpp's vec_dot."""
    block_size, _ = ggml.sizes(qtype)
    act_type = VEC_DOT_TYPE[qtype]
    n = 1024 if block_size > 1 else 256
    weights, acts, results = [], [], []
    for w_scale, a_scale in [(1.0, 1.0), (0.02, 3.0), (50.0, 1e-2), (1.0, 100.0)]:
        w = (rng.standard_normal(n) * w_scale).astype(np.float32)
        if qtype in (T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K):
            w += np.float32(0.3 * w_scale)  # exercise the min offsets
        a = (rng.standard_normal(n) * a_scale).astype(np.float32)
        wq = quantize_float(qtype, w, ggml)
        aq = quantize_float(act_type, a, ggml)
        weights.append(wq)
        acts.append(aq)
        results.append(ggml.vec_dot(qtype, n, wq, aq))
    return n, np.concatenate(weights), np.concatenate(acts), np.array(results, dtype=np.float32)


MASK64 = (1 << 64) - 1


class SplitMix64:
    """The SplitMix64 generator; the Rust tests carry the same one."""

    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def bulk_input(seed: int, n_elements: int, group: int) -> np.ndarray:
    """Bulk quantizer input the Rust tests rebuild bit for bit: integers below 2^24 times
    powers of two, so no rounding or libm function is involved.

    Per group, one draw p picks the scale 2^((p & 31) - 32), an offset (none, +2^17, -2^17,
    +2^15) from bits 5-6 and a share of zeros (none, 1/2, 7/8, none) from bits 7-8. Per element,
    one draw r gives the sum of its three low 16-bit fields minus 98302 plus the offset, or 0
    when r >> 48 is below the zero threshold.
    """
    rng = SplitMix64(seed)
    out = np.empty(n_elements, dtype=np.float32)
    for start in range(0, n_elements, group):
        p = rng.next()
        scale = np.float32(2.0 ** ((p & 31) - 32))
        offset = [0, 1 << 17, -(1 << 17), 1 << 15][(p >> 5) & 3]
        zero_below = [0, 1 << 15, 7 << 13, 0][(p >> 7) & 3]
        for i in range(start, start + group):
            r = rng.next()
            if (r >> 48) < zero_below:
                v = 0
            else:
                v = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) - 98302 + offset
            out[i] = np.float32(v) * scale
    return out


def finite_f16(h: np.ndarray) -> np.ndarray:
    """Clears the exponent of f16 infinities and NaNs (they become subnormals)."""
    return np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h).astype(np.uint16)


def bulk_random_blocks(seed: int, qtype: T, n_bytes: int) -> np.ndarray:
    """Random bytes from SplitMix64 (little-endian words), made finite where the type has
    float fields: f16 fields as in finite_f16, bf16 and f32 values with an all-ones exponent
    lose its top bit, and the Q8_K f32 scale gets an exponent field in 100..=150
    (100 + e % 51 when outside)."""
    rng = SplitMix64(seed)
    words = np.array([rng.next() for _ in range((n_bytes + 7) // 8)], dtype=np.uint64)
    raw = words.view(np.uint8)[:n_bytes].copy()
    if qtype == T.F32:
        u = raw.view(np.uint32)
        raw = np.where((u & 0x7F800000) == 0x7F800000, u & 0xBFFFFFFF, u).astype(np.uint32).view(np.uint8)
    elif qtype == T.F16:
        raw = finite_f16(raw.view(np.uint16)).view(np.uint8)
    elif qtype == T.BF16:
        h = raw.view(np.uint16)
        raw = np.where((h & 0x7F80) == 0x7F80, h & 0xBFFF, h).astype(np.uint16).view(np.uint8)
    else:
        type_size = GGML_QUANT_SIZES_GGML[qtype][1]
        blocks = raw.reshape(-1, type_size)
        for off in F16_SCALE_OFFSETS.get(qtype, []):
            h = np.ascontiguousarray(blocks[:, off:off + 2]).view(np.uint16)
            blocks[:, off:off + 2] = finite_f16(h).view(np.uint8)
        if qtype == T.Q8_K:
            u = np.ascontiguousarray(blocks[:, 0:4]).view(np.uint32)
            e = (u >> 23) & 0xFF
            e = np.where((e < 100) | (e > 150), 100 + e % 51, e)
            blocks[:, 0:4] = ((u & 0x807FFFFF) | (e << 23)).astype(np.uint32).view(np.uint8)
        raw = blocks.reshape(-1)
    return raw


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK64
    return h


def chunk_hashes(data: np.ndarray, chunk_bytes: int) -> bytes:
    raw = data.tobytes()
    return b"".join(struct.pack("<Q", fnv1a64(raw[i:i + chunk_bytes])) for i in range(0, len(raw), chunk_bytes))


def reference_dequantize(qtype: T, blocks: np.ndarray, ggml: Ggml) -> np.ndarray:
    """gguf-py's dequantization where it has one, cross-checked bit for bit against llama.cpp's
    (NaN payloads aside); llama.cpp's otherwise."""
    if qtype not in GGUF_DEQUANTIZES:
        return ggml.dequantize(qtype, blocks)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = gguf.quants.dequantize(blocks, qtype).astype(np.float32, copy=False).reshape(-1)
    if qtype != T.F32:
        from_ggml = ggml.dequantize(qtype, blocks)
        same = (expected.view(np.uint32) == from_ggml.view(np.uint32)) | (np.isnan(expected) & np.isnan(from_ggml))
        if not same.all():
            sys.exit(f"{qtype.name}: gguf and llama.cpp disagree on {np.count_nonzero(~same)} values")
    return expected


def bulk_records(qtype: T, ggml: Ggml, block_size: int, type_size: int, float_type: bool):
    """Hashes of llama.cpp's quantizer output on bulk_input, and of the reference dequantization
    of bulk_random_blocks, one hash per BULK_CHUNK_BLOCKS blocks (per 2048 values for floats)."""
    seed = 0x7E57_0000 + int(qtype)
    n = BULK_ELEMENTS[block_size]
    chunk_elements = 2048 if float_type else BULK_CHUNK_BLOCKS * block_size
    x = bulk_input(seed, n, max(block_size, 32))
    quantized = quantize_float(qtype, x, ggml)
    random = bulk_random_blocks(seed + 1, qtype, n // block_size * type_size)
    expected = reference_dequantize(qtype, random, ggml)
    return [
        ("bulk_seed", struct.pack("<Q", seed)),
        ("bulk_elements", struct.pack("<I", n)),
        ("bulk_chunk_elements", struct.pack("<I", chunk_elements)),
        ("bulk_quantize_hashes", chunk_hashes(quantized, chunk_elements // block_size * type_size)),
        ("bulk_dequantize_hashes", chunk_hashes(expected.astype("<f4"), chunk_elements * 4)),
    ]


def write_records(path: Path, records: list[tuple[str, bytes]]) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC)
        for name, payload in records:
            encoded = name.encode("ascii")
            f.write(struct.pack("<H", len(encoded)))
            f.write(encoded)
            f.write(struct.pack("<I", len(payload)))
            f.write(payload)


def generate(qtype: T, ggml: Ggml, out_dir: Path) -> None:
    rng = np.random.default_rng(20250 + int(qtype))
    # Block geometry from ggml itself: gguf-py 0.19.0 still lists Q8_1 as 40 bytes (an old
    # layout with f32 scales); ggml's block_q8_1 has f16 scales and takes 36.
    block_size, type_size = ggml.sizes(qtype)
    if qtype in GGUF_DEQUANTIZES:
        assert GGML_QUANT_SIZES[qtype] == (block_size, type_size), qtype.name
    float_type = block_size == 1

    quant_in = input_blocks(rng, 32 if float_type else block_size, float_type)
    quant_out = quantize_float(qtype, quant_in, ggml)
    n_random = 64 if float_type else (6 if block_size == 256 else 24)
    blocks = np.concatenate([quant_out, random_blocks(rng, qtype, n_random, type_size)])

    if qtype in GGUF_DEQUANTIZES:
        source = f"gguf {importlib.metadata.version('gguf')} quants.dequantize"
    else:
        source = f"llama.cpp dequantize_row_{'q8_0 (Q8_1 d and qs read as Q8_0)' if qtype == T.Q8_1 else 'q8_K'}"
    expected = reference_dequantize(qtype, blocks, ggml)
    assert expected.size == blocks.size // type_size * block_size

    records = [
        ("type", qtype.name.encode()),
        ("dequantize_source", source.encode()),
        ("blocks", blocks.tobytes()),
        ("dequantized", expected.astype("<f4").tobytes()),
        ("quantize_input", quant_in.astype("<f4").tobytes()),
        ("quantize_output", quant_out.tobytes()),
    ]
    if qtype in VEC_DOT_TYPE:
        n, weights, acts, results = dot_rows(rng, qtype, ggml)
        records += [
            ("dot_row_len", struct.pack("<I", n)),
            ("dot_weights", weights.tobytes()),
            ("dot_activations", acts.tobytes()),
            ("dot_results", results.astype("<f4").tobytes()),
        ]
    records += bulk_records(qtype, ggml, block_size, type_size, float_type)
    path = out_dir / f"{qtype.name}.tsqv"
    write_records(path, records)
    print(f"{qtype.name:6} {path.stat().st_size:7} bytes  dequantized by {source}")


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib-dir", type=Path, required=True,
                        help="directory holding llama.cpp's libggml-base.so and libggml-cpu.so")
    parser.add_argument("--out", type=Path, default=repo / "crates/ts-quant/tests/data")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ggml = Ggml(args.lib_dir)
    for qtype in TYPES:
        GGML_QUANT_SIZES_GGML[qtype] = ggml.sizes(qtype)
    for qtype in TYPES:
        generate(qtype, ggml, args.out)


if __name__ == "__main__":
    main()
