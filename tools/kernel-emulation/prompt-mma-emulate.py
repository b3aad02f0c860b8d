# Lane-level emulation (numpy) of attention_prompt_mma's indexing (ts-cuda kernels): its
# fragments, masks and online softmax, one block at a time, against a plain reference (f16
# rounding where the kernel rounds). Run: python3 prompt-mma-emulate.py (needs numpy).
import numpy as np
rng = np.random.default_rng(1)
def h(x): return np.float16(x).astype(np.float64)
def mma(A_l, B_l):
    # A_l[lane] = (a0,a1,a2,a3) each a pair (lo,hi); B_l[lane] = (b0,b1) pairs. Returns C_l[lane][4].
    A = np.zeros((16,16)); B = np.zeros((16,8))
    for lane in range(32):
        g, s = lane >> 2, lane & 3
        a = A_l[lane]
        A[g, 2*s:2*s+2] = a[0]; A[g+8, 2*s:2*s+2] = a[1]; A[g, 2*s+8:2*s+10] = a[2]; A[g+8, 2*s+8:2*s+10] = a[3]
        b = B_l[lane]
        B[2*s:2*s+2, g] = b[0]; B[2*s+8:2*s+10, g] = b[1]
    C = A @ B
    return [[C[l>>2, 2*(l&3)], C[l>>2, 2*(l&3)+1], C[(l>>2)+8, 2*(l&3)], C[(l>>2)+8, 2*(l&3)+1]] for l in range(32)]

def run(HD, n_head, n_head_kv, m, pos0, window, sinks, softcap, slots):
    group = n_head // n_head_kv
    kv_dim = n_head_kv * HD
    npos = pos0 + m
    Kall = rng.normal(size=(npos, kv_dim)); Vall = rng.normal(size=(npos, kv_dim))
    q = rng.normal(size=(m, n_head * HD)); sink = rng.normal(size=n_head)
    scale = 1 / np.sqrt(HD)
    # ring cache
    Kc = np.zeros((slots, kv_dim)); Vc = np.zeros((slots, kv_dim))
    for p in range(npos): Kc[p % slots] = Kall[p]; Vc[p % slots] = Vall[p]
    info_pos = [pos0 + r for r in range(m)]
    out = np.full((m, n_head * HD), np.nan)
    n_flat = m * group
    for kvh in range(n_head_kv):
        for bx in range((n_flat + 63) // 64):
            flat0 = bx * 64
            rows = range(flat0 // group, (min(flat0 + 64, n_flat) - 1) // group + 1)
            lo = min(max(0, info_pos[r] + 1 - window) if window > 0 else 0 for r in rows)
            hi = max(info_pos[r] for r in rows)
            for warp in range(4):
                st = {}
                for lane in range(32):
                    g, s = lane >> 2, lane & 3
                    qpos, qfirst, qa = [0,0], [0,0], [[None]*4 for _ in range(HD//16)]
                    for hh in range(2):
                        flat = flat0 + warp*16 + g + 8*hh
                        live = flat < n_flat
                        row = flat // group if live else 0; head = kvh*group + (flat % group if live else 0)
                        qpos[hh] = info_pos[row] if live else -1
                        qfirst[hh] = max(0, qpos[hh] + 1 - window) if window > 0 else 0
                        qr = q[row, head*HD:(head+1)*HD]
                        for kb in range(HD//16):
                            lo2 = qr[16*kb+2*s:16*kb+2*s+2] if live else np.zeros(2)
                            hi2 = qr[16*kb+8+2*s:16*kb+8+2*s+2] if live else np.zeros(2)
                            qa[kb][hh] = h(lo2); qa[kb][2+hh] = h(hi2)
                    st[lane] = dict(qpos=qpos, qfirst=qfirst, qa=qa, mx=[-np.inf]*2, sum=[0.0,0.0], o=np.zeros((HD//8,4)))
                wlo = min(min(L['qfirst'][x] if L['qpos'][x] >= 0 else 10**9 for x in range(2)) for L in st.values())
                whi = max(max(L['qpos']) for L in st.values())
                p0 = lo
                while p0 <= hi:
                    ks = np.zeros((64, HD)); vt = np.zeros((HD, 64))
                    for l in range(64):
                        if p0 + l <= hi:
                            ks[l] = h(Kc[(p0+l) % slots, kvh*HD:(kvh+1)*HD]); vt[:, l] = h(Vc[(p0+l) % slots, kvh*HD:(kvh+1)*HD])
                    if not (p0 > whi or p0 + 63 < wlo):
                        sc = {lane: np.zeros((8,4)) for lane in range(32)}
                        for nb in range(8):
                            acc = [[0.0]*4 for _ in range(32)]
                            for kb in range(HD//16):
                                A_l = [st[l]['qa'][kb] for l in range(32)]
                                B_l = [(ks[8*nb+(l>>2), 16*kb+2*(l&3):16*kb+2*(l&3)+2], ks[8*nb+(l>>2), 16*kb+8+2*(l&3):16*kb+8+2*(l&3)+2]) for l in range(32)]
                                C = mma(A_l, B_l)
                                for l in range(32): acc[l] = [acc[l][i] + C[l][i] for i in range(4)]
                            for l in range(32): sc[l][nb] = acc[l]
                        tmax = {l: [-np.inf]*2 for l in range(32)}
                        for l in range(32):
                            s_ = l & 3; L = st[l]
                            for nb in range(8):
                                for i in range(4):
                                    hh = i >> 1; pos = p0 + 8*nb + 2*s_ + (i & 1)
                                    v = sc[l][nb][i] * scale
                                    if softcap > 0: v = softcap * np.tanh(v / softcap)
                                    v = v if (pos >= L['qfirst'][hh] and pos <= L['qpos'][hh]) else -np.inf
                                    sc[l][nb][i] = v; tmax[l][hh] = max(tmax[l][hh], v)
                        for l in range(32):  # quad max
                            quad = [x for x in range(32) if x >> 2 == l >> 2]
                            L = st[l]
                            for hh in range(2):
                                tm = max(tmax[x][hh] for x in quad)
                                nm = max(L['mx'][hh], tm)
                                corr = 1.0 if nm == -np.inf else np.exp(L['mx'][hh] - nm)
                                L['mx'][hh] = nm; L['sum'][hh] *= corr
                                L['o'][:, 2*hh:2*hh+2] *= corr
                        for l in range(32):
                            L = st[l]
                            for nb in range(8):
                                for i in range(4):
                                    hh = i >> 1
                                    e = 0.0 if sc[l][nb][i] == -np.inf else np.exp(sc[l][nb][i] - L['mx'][hh])
                                    sc[l][nb][i] = e; L['sum'][hh] += e
                        for kk in range(4):
                            A_l = [(h(sc[l][2*kk][0:2]), h(sc[l][2*kk][2:4]), h(sc[l][2*kk+1][0:2]), h(sc[l][2*kk+1][2:4])) for l in range(32)]
                            for db in range(HD//8):
                                B_l = [(vt[8*db+(l>>2), 16*kk+2*(l&3):16*kk+2*(l&3)+2], vt[8*db+(l>>2), 16*kk+8+2*(l&3):16*kk+8+2*(l&3)+2]) for l in range(32)]
                                C = mma(A_l, B_l)
                                for l in range(32): st[l]['o'][db] += C[l]
                    p0 += 64
                for l in range(32):
                    g, s_ = l >> 2, l & 3; L = st[l]
                    quad = [x for x in range(32) if x >> 2 == g]
                    for hh in range(2):
                        tot = sum(st[x]['sum'][hh] for x in quad)
                        flat = flat0 + warp*16 + g + 8*hh
                        if flat >= n_flat: continue
                        row = flat // group; head = kvh*group + flat % group
                        top = max(sink[head], L['mx'][hh]) if sinks else L['mx'][hh]
                        keep = np.exp(L['mx'][hh] - top)
                        sc_ = keep / (tot * keep + (np.exp(sink[head] - top) if sinks else 0))
                        for db in range(HD//8):
                            out[row, head*HD + 8*db + 2*s_: head*HD + 8*db + 2*s_ + 2] = L['o'][db][2*hh:2*hh+2] * sc_
    # reference
    ref = np.zeros_like(out)
    for r in range(m):
        p = info_pos[r]; first = max(0, p + 1 - window) if window > 0 else 0
        for head in range(n_head):
            kvh = head // group
            qq = q[r, head*HD:(head+1)*HD]
            K = Kall[first:p+1, kvh*HD:(kvh+1)*HD]; V = Vall[first:p+1, kvh*HD:(kvh+1)*HD]
            sc = K @ qq * scale
            if softcap > 0: sc = softcap * np.tanh(sc / softcap)
            mx = sc.max()
            if sinks: mx = max(mx, sink[head])
            e = np.exp(sc - mx); den = e.sum() + (np.exp(sink[head] - mx) if sinks else 0)
            ref[r, head*HD:(head+1)*HD] = e @ V / den
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"HD {HD} heads {n_head}/{n_head_kv} m {m} pos0 {pos0} window {window} sinks {sinks} softcap {softcap}: rel err {err:.2e}, nan {np.isnan(out).sum()}")
run(64, 8, 2, 20, 0, 0, False, 0, 300)
run(64, 12, 4, 20, 40, 7, True, 30.0, 300)
run(128, 16, 8, 60, 120, 128, True, 0, 300)
run(64, 8, 8, 20, 100, 0, False, 0, 300)
