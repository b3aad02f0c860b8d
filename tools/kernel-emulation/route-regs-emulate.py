# Emulates ts_route_regs (ts-cuda kernels) warp by warp in Python and checks its ids
# and weights against the shared-memory algorithm it replaces, ties included. Run: python3 route-regs-emulate.py
import math, random
def old(l, k, gating, renorm, scale):
    n=len(l); v=list(l); mx=max(v)
    if gating==0:
        e=[math.exp(x-mx) for x in v]; s=sum(e); v=[x/s for x in e]
    ids=[]; w=[]
    for j in range(k):
        best=-math.inf; bi=None
        bi=0x7fffffff
        for i in range(n):
            if v[i]>best or (v[i]==best and i<bi): best=v[i]; bi=i
        ids.append(bi); w.append(best); v[bi]=-math.inf
    if gating==1:
        m0=w[0]; e=[math.exp(x-m0) for x in w]; s=sum(e); w=[x/s for x in e]
    if renorm:
        s=max(sum(w), 6.103515625e-5); w=[x/s for x in w]
    return ids, [x*(scale[i] if scale else 1) for x,i in zip(w,ids)]
def regs(l, k, gating, renorm, scale, PL):
    n=len(l); INF=math.inf
    v=[[l[lane+32*j] if lane+32*j<n else -INF for j in range(PL)] for lane in range(32)]
    mx=max(max(r) for r in v)
    if gating==0:
        s=0.0
        for lane in range(32):
            for j in range(PL):
                if lane+32*j<n: v[lane][j]=math.exp(v[lane][j]-mx); s+=v[lane][j]
        for lane in range(32):
            for j in range(PL):
                if lane+32*j<n: v[lane][j]/=s
    my_w=[0.0]*32; my_id=[0]*32
    for sel in range(k):
        cand=[]
        for lane in range(32):
            best=-INF; bi=0x7fffffff
            for j in range(PL):
                if lane+32*j<n and (v[lane][j]>best or (v[lane][j]==best and bi==0x7fffffff)): best=v[lane][j]; bi=lane+32*j
            cand.append((best,bi))
        # butterfly reduce
        for o in (16,8,4,2,1):
            new=[]
            for lane in range(32):
                b,i=cand[lane]; ob,oi=cand[lane^o]
                if ob>b or (ob==b and oi<i): b,i=ob,oi
                new.append((b,i))
            cand=new
        assert len(set(cand))==1
        best,bi=cand[0]
        my_w[sel]=best; my_id[sel]=bi
        v[bi%32][bi//32]=-INF
    if gating==1:
        m0=my_w[0]; e=[math.exp(my_w[l]-m0) if l<k else 0 for l in range(32)]; s=sum(e); my_w=[x/s for x in e]
    if renorm:
        s=max(sum(my_w[l] for l in range(k)),6.103515625e-5); my_w=[x/s for x in my_w]
    return my_id[:k], [my_w[l]*(scale[my_id[l]] if scale else 1) for l in range(k)]
random.seed(3)
for n,k,PL in [(128,8,4),(32,4,1),(60,4,2),(256,8,8),(20,2,1)]:
    for trial in range(200):
        l=[round(random.gauss(0,1),1) for _ in range(n)]  # rounding makes ties
        if trial % 4 == 0:  # fewer finite logits than k: the rest are taken at -inf
            l=[x if random.random() < k/n/4 else -math.inf for x in l]
            l[random.randrange(n)]=0.0
        gating=random.choice([0,1]); renorm=random.choice([0,1])
        scale=[0.5+i/n for i in range(n)] if random.random()<0.5 else None
        a=old(l,k,gating,renorm,scale); b=regs(l,k,gating,renorm,scale,PL)
        assert a[0]==b[0], (a[0],b[0])
        assert all(abs(x-y)<1e-9 for x,y in zip(a[1],b[1]))
    print(n,k,'ok')
