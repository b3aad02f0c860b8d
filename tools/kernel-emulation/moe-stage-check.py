# Checks the staged activation indices of the grouped expert kernels (moe_mm_q8.cu) against the global ones
# (ts_mma_stage's copy, then ts_mma_chunk's reads). Run: python3 moe-stage-check.py
import random
STAGE, XROW, NT = 8, 32*8+16, 4
for k in (768, 2048, 2880):
    units = k // 32
    P = 8*NT
    xq = [[random.randrange(256) for _ in range(k)] for _ in range(P)]
    xds = [[(random.random(), random.random()) for _ in range(units)] for _ in range(P)]
    for c0 in range(0, units, STAGE):
        n = min(STAGE, units - c0)
        xs = bytearray(P*XROW); ds = [None]*(P*STAGE)
        for i in range(8*NT*n*2):
            pair, part = divmod(i, 2*n)
            xs[pair*XROW+16*part: pair*XROW+16*part+16] = bytes(xq[pair][32*c0+16*part: 32*c0+16*part+16])
        for i in range(8*NT*n):
            pair, c = divmod(i, n)
            ds[pair*STAGE+c] = xds[pair][c0+c]
        for cs in range(n):
            c = c0 + cs
            for lane in range(32):
                g, s = lane >> 2, lane & 3
                for nn in range(NT):
                    a = (8*nn+g)*XROW + 32*cs + 4*s
                    assert bytes(xs[a:a+4]) == bytes(xq[8*nn+g][32*c+4*s: 32*c+4*s+4])
                    assert bytes(xs[a+16:a+20]) == bytes(xq[8*nn+g][32*c+4*s+16: 32*c+4*s+20])
                    assert ds[(8*nn+2*s)*STAGE+cs] == xds[8*nn+2*s][c]
                    assert ds[(8*nn+2*s+1)*STAGE+cs] == xds[8*nn+2*s+1][c]
    print(k, "ok")
