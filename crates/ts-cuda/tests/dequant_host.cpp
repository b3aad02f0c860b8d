// Host harness for kernels/quant.cuh: decodes rows of one type with the same code the kernels
// run and writes the elements, so tests/dequant_host.rs can compare them with ts-quant.
//
//   dequant_host TYPE K N_ROWS IN OUT MODE OFFSET
//     IN: N_ROWS rows of K elements of TYPE; OUT: N_ROWS*K floats (MODE f32) or their half
//     bits (MODE f16, through ts_f2h). The rows are placed OFFSET bytes past a 16-byte boundary.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant.cuh"

typedef void (*Dequant)(const ts_u8*, int, float*);
typedef ts_u64 (*RowBytes)(int);

int main(int argc, char** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s TYPE K N_ROWS IN OUT f32|f16 OFFSET\n", argv[0]);
        return 2;
    }
    const char* type = argv[1];
    const int k = atoi(argv[2]);
    const int n_rows = atoi(argv[3]);
    const bool half = strcmp(argv[6], "f16") == 0;
    const int offset = atoi(argv[7]);

    Dequant dequant = nullptr;
    RowBytes row_bytes = nullptr;
    int block = 0;
#define TS_PICK(t, blk, bytes)            \
    if (strcmp(type, #t) == 0) {          \
        dequant = dequant32_##t;          \
        row_bytes = ts_row_bytes_##t;     \
        block = (blk) < 32 ? 32 : (blk);  \
    }
    TS_QUANT_TYPES(TS_PICK)
#undef TS_PICK
    if (!dequant || k <= 0 || k % block != 0 || n_rows <= 0 || offset < 0 || offset > 15) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }

    const size_t rb = row_bytes(k);
    const size_t size = rb * n_rows;
    // 16 bytes of slack on each side: loads may touch the aligned words around a row's bytes.
    std::vector<ts_u32> storage((size + 64) / 4);
    ts_u8* data = reinterpret_cast<ts_u8*>(storage.data()) + 16 + offset;
    FILE* in = fopen(argv[4], "rb");
    if (!in || fread(data, 1, size, in) != size || fgetc(in) != EOF) {
        fprintf(stderr, "cannot read %zu bytes from %s\n", size, argv[4]);
        return 1;
    }
    fclose(in);

    std::vector<float> out((size_t)n_rows * k);
    for (int r = 0; r < n_rows; r++) {
        for (int c = 0; c < k / 32; c++) dequant(data + r * rb, c, &out[(size_t)r * k + 32 * c]);
    }

    FILE* f = fopen(argv[5], "wb");
    if (!f) return 1;
    if (half) {
        std::vector<ts_u16> h(out.size());
        for (size_t i = 0; i < out.size(); i++) h[i] = ts_f2h(out[i]);
        fwrite(h.data(), 2, h.size(), f);
    } else {
        fwrite(out.data(), 4, out.size(), f);
    }
    return fclose(f) == 0 ? 0 : 1;
}
