// Host harness for kernels/vdot.cuh: the integer dot products of weight rows with 8-bit
// activations, with the same code the kernels run, one lane taking every unit in order.
//
//   vdot_host TYPE K N_ROWS W XQ XDS OUT OFFSET FRAGS
//     W: N_ROWS rows of K elements of TYPE, placed OFFSET bytes past a 16-byte boundary;
//     XQ: 2 rows of K int8; XDS: 2 rows of K/32 (d, sum) f32 pairs. OUT: per weight row eleven
//     floats: its dot with activation row 0 alone (dot<1>), then with rows 0 and 1 (dot<2>),
//     then with rows 0, 1, 0, 1, ... (dot<8>, as the kernels' passes of eight rows).
//     FRAGS: the weights as the tensor-core fragments give them (frag: d[h] * q + m), K floats
//     per row.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vdot.cuh"

typedef void (*Dot1)(const ts_u8*, int, const TsQ8&, float (&)[1]);
typedef void (*Dot2)(const ts_u8*, int, const TsQ8&, float (&)[2]);
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
    Dot8 dot8 = nullptr;
    Frag frag = nullptr;
    ts_u64 (*row_bytes)(int) = nullptr;
#define TS_PICK(t)                        \
    if (strcmp(type, #t) == 0) {          \
        dot1 = vdot_##t::dot<1>;          \
        dot2 = vdot_##t::dot<2>;          \
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
    std::vector<signed char> xq(2 * (size_t)k);
    std::vector<ts_f2> xds(2 * (size_t)k / 32);
    if (!read_exact(argv[4], w, size) || !read_exact(argv[5], xq.data(), xq.size()) ||
        !read_exact(argv[6], xds.data(), xds.size() * sizeof(ts_f2))) {
        fprintf(stderr, "cannot read the inputs\n");
        return 1;
    }
    const TsQ8 x{xq.data(), xds.data(), k};
    // Eight rows: rows 0 and 1 four times over.
    std::vector<signed char> xq8;
    std::vector<ts_f2> xds8;
    for (int r = 0; r < 4; r++) {
        xq8.insert(xq8.end(), xq.begin(), xq.end());
        xds8.insert(xds8.end(), xds.begin(), xds.end());
    }
    const TsQ8 x8{xq8.data(), xds8.data(), k};

    const int per_row = 11;
    std::vector<float> out(per_row * (size_t)n_rows);
    for (int o = 0; o < n_rows; o++) {
        float a1[1] = {0.0f}, a2[2] = {0.0f, 0.0f}, a8[8] = {};
        for (int u = 0; u < k / 32; u++) {
            dot1(w + o * rb, u, x, a1);
            dot2(w + o * rb, u, x, a2);
            dot8(w + o * rb, u, x8, a8);
        }
        float* row = &out[per_row * (size_t)o];
        row[0] = a1[0];
        row[1] = a2[0];
        row[2] = a2[1];
        for (int r = 0; r < 8; r++) row[3 + r] = a8[r];
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
