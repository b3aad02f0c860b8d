# Checks attention_prompt_mma's tile loads (attention.cu): every key and value element of a
# 64-position tile is loaded once, and each warp's shared-memory stores of a pass fall in
# distinct banks (keys: 64-bit stores of one row; values: the transposed 32-bit stores).
# Run: python3 prompt-mma-loads-check.py
FA_KEYS, THREADS = 64, 128
for HD in (64, 128):
    ks_row, vt_row = (HD + 8) // 2, (FA_KEYS + 8) // 2  # words
    seen = set()
    for it in range(FA_KEYS * HD // 4 // THREADS):
        for warp in range(THREADS // 32):
            words = []
            for lane in range(32):
                i = it * THREADS + warp * 32 + lane
                l, e = i // (HD // 4), 4 * (i % (HD // 4))
                for t in range(4):
                    assert (l, e + t) not in seen
                    seen.add((l, e + t))
                words += [l * ks_row + e // 2, l * ks_row + e // 2 + 1]
            # A 64-bit store by 32 lanes: two passes of 16 lanes, each over 32 distinct banks.
            for half in (words[:32], words[32:]):
                assert len({w % 32 for w in half}) == 32
    assert len(seen) == FA_KEYS * HD
    seen = set()
    for it in range(FA_KEYS // 2 * HD // 4 // THREADS):
        for warp in range(THREADS // 32):
            for t in range(4):
                banks = set()
                for lane in range(32):
                    i = it * THREADS + warp * 32 + lane
                    j, li = i >> 5, i & 31
                    lp, e = 2 * ((j & 1) * 16 + (li & 15)), 4 * ((j >> 1) * 2 + (li >> 4))
                    for pos in (lp, lp + 1):
                        assert (pos, e + t) not in seen
                        seen.add((pos, e + t))
                    banks.add(((e + t) * vt_row + lp // 2) % 32)
                assert len(banks) == 32, (HD, it, warp, t)
    assert len(seen) == FA_KEYS * HD
    print(f"HD {HD}: keys and values each loaded once, stores conflict-free")
