// Host harness for kernels/vdot.cuh: the integer dot products of weight rows with 8-bit
// activations, with the same code the kernels run, one lane taking every unit in order.
//
//   vdot_host TYPE K N_ROWS W XQ XDS OUT OFFSET FRAGS
//     W: N_ROWS rows of K elements of TYPE, placed OFFSET bytes past a 16-byte boundary;
//     XQ: 8 rows of K int8; XDS: 8 rows of K/32 (d, sum) f32 pairs. OUT: per weight row, for
//     M = 1, 2, 4 and 8, its dots with the 8 activation rows taken M at a time (dot<M>, as the
//     kernels' passes of M rows): 32 floats.
//     FRAGS: the weights as the tensor-core fragments give them (frag: d[h] * q + m), K floats
//     per row.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vdot.cuh"

typedef void (*Dot1)(const ts_u8*, int, const TsQ8&, float (&)[1]);
typedef void (*Dot2)(const ts_u8*, int, const TsQ8&, float (&)[2]);
typedef void (*Dot4)(const ts_u8*, int, const TsQ8&, float (&)[4]);
typedef void (*Dot8)(const ts_u8*, int, const TsQ8&, float (&)[8]);
typedef TsFrag (*Frag)(const ts_u8*, int, int);

static bool read_exact(const char* path, void* dst, size_t size) {
    FILE* f = fopen(path, "rb");
    if (!f) return false;
    const bool ok = fread(dst, 1, size, f) == size && fgetc(f) == EOF;
    fclose(f);
    return ok;
}

int main(int argc, char** argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s TYPE K N_ROWS W XQ XDS OUT OFFSET FRAGS\n", argv[0]);
        return 2;
    }
    const char* type = argv[1];
    const int k = atoi(argv[2]);
    const int n_rows = atoi(argv[3]);
    const int offset = atoi(argv[8]);

    Dot1 dot1 = nullptr;
    Dot2 dot2 = nullptr;
    Dot4 dot4 = nullptr;
    Dot8 dot8 = nullptr;
    Frag frag = nullptr;
    ts_u64 (*row_bytes)(int) = nullptr;
#define TS_PICK(t)                        \
    if (strcmp(type, #t) == 0) {          \
        dot1 = vdot_##t::dot<1>;          \
        dot2 = vdot_##t::dot<2>;          \
        dot4 = vdot_##t::dot<4>;          \
        dot8 = vdot_##t::dot<8>;          \
        frag = vdot_##t::frag;            \
        row_bytes = vdot_##t::row_bytes;  \
    }
    TS_Q8_TYPES(TS_PICK)
#undef TS_PICK
    if (!dot1 || k <= 0 || k % 32 != 0 || n_rows <= 0 || offset < 0 || offset > 15) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }

    const size_t rb = row_bytes(k);
    const size_t size = rb * n_rows;
    // Slack on each side: loads may touch the aligned words around a row's bytes.
    std::vector<ts_u32> storage((size + 64) / 4);
    ts_u8* w = reinterpret_cast<ts_u8*>(storage.data()) + 16 + offset;
    const int n_x = 8;
    std::vector<signed char> xq(n_x * (size_t)k);
    std::vector<ts_f2> xds(n_x * (size_t)k / 32);
    if (!read_exact(argv[4], w, size) || !read_exact(argv[5], xq.data(), xq.size()) ||
        !read_exact(argv[6], xds.data(), xds.size() * sizeof(ts_f2))) {
        fprintf(stderr, "cannot read the inputs\n");
        return 1;
    }
    // Activation rows r0 .. r0 + M - 1.
    auto rows_at = [&](int r0) {
        return TsQ8{xq.data() + (size_t)r0 * k, xds.data() + (size_t)r0 * (k / 32), k};
    };
    const int per_row = 4 * n_x;
    std::vector<float> out(per_row * (size_t)n_rows);
    for (int o = 0; o < n_rows; o++) {
        const ts_u8* row = w + o * rb;
        float* got = &out[per_row * (size_t)o];
        for (int r0 = 0; r0 < n_x; r0++) {
            float a[1] = {};
            for (int u = 0; u < k / 32; u++) dot1(row, u, rows_at(r0), a);
            got[r0] = a[0];
        }
        for (int r0 = 0; r0 < n_x; r0 += 2) {
            float a[2] = {};
            for (int u = 0; u < k / 32; u++) dot2(row, u, rows_at(r0), a);
            for (int r = 0; r < 2; r++) got[n_x + r0 + r] = a[r];
        }
        for (int r0 = 0; r0 < n_x; r0 += 4) {
            float a[4] = {};
            for (int u = 0; u < k / 32; u++) dot4(row, u, rows_at(r0), a);
            for (int r = 0; r < 4; r++) got[2 * n_x + r0 + r] = a[r];
        }
        float a[8] = {};
        for (int u = 0; u < k / 32; u++) dot8(row, u, rows_at(0), a);
        for (int r = 0; r < 8; r++) got[3 * n_x + r] = a[r];
    }
    FILE* f = fopen(argv[7], "wb");
    if (!f) return 1;
    fwrite(out.data(), 4, out.size(), f);
    if (fclose(f) != 0) return 1;

    // Lane s of a fragment holds elements 4s.. (half 0) and 16 + 4s.. (half 1) of the chunk.
    std::vector<float> weights((size_t)n_rows * k);
    for (int o = 0; o < n_rows; o++)
        for (int c = 0; c < k / 32; c++)
            for (int s = 0; s < 4; s++) {
                const TsFrag fr = frag(w + o * rb, c, s);
                for (int h = 0; h < 2; h++)
                    for (int i = 0; i < 4; i++)
                        weights[(size_t)o * k + 32 * c + 16 * h + 4 * s + i] =
                            fr.d[h] * (float)(signed char)(fr.q[h] >> (8 * i)) + fr.m;
            }
    f = fopen(argv[9], "wb");
    if (!f) return 1;
    fwrite(weights.data(), 4, weights.size(), f);
    return fclose(f) == 0 ? 0 : 1;
}
