#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the CUDA op and fixture tests, then
# benchmarks on synthetic models, from binaries built here by tools/gpu-build.sh
# into .devbin/. Usage there: tools/gpu-run.sh [tests|bench|all|real|profile|before-after|batched|peer-build|peer-profile|side|sweep|ncu-detail|timing|host-timing|spec|wide|misses|cpu-sweep|depth|peer-unpack]
# (`real`: the real models staged by tools/gpu-stage.sh, greedy on GPU vs CPU;
# `before-after [LIKE...]`: .devbin/turbospark-before (an earlier commit's build) beside
# .devbin/turbospark on the same synthetic files; `peer-build` starts building
# llama.cpp's CUDA llama-bench from .peer/llama-cuda.tar.xz (tools/peer-pack.sh), and
# ik_llama.cpp's from .peer/ik-cuda.tar.xz (tools/peer-pack-ik.sh) when packed, in the
# background; `side LIKE...`: synthetic files, ours beside those llama-benches;
# `queue 'CMD'` and `wait [S]`: below.)
set -u
what=${1:-all}
# `queue 'CMD'` runs shell command CMD (e.g. "SWEEP='X=1;A=2' tools/gpu-run.sh sweep
# qwen3-30b-a3b") after the jobs queued before it, one at a time, detached from the call, in a
# copy of the call's tree; its output goes to $QUEUE/N.log. `wait [S]` holds the call (and so
# the machine, which goes back 30 s after a call ends) up to S seconds (50) while jobs run,
# then prints where each stands. Long runs thus never hang on one call's time limit, and the
# next call can come from a quick edit here.
QUEUE=${QUEUE:-/root/queue}
queue_worker_alive() { [[ -f $QUEUE/worker.pid ]] && kill -0 "$(cat "$QUEUE/worker.pid")" 2> /dev/null; }
queue_start_worker() {
    queue_worker_alive && return
    setsid nohup bash "$QUEUE/0.tree/tools/gpu-run.sh" queue-worker > /dev/null 2>&1 < /dev/null &
    echo $! > "$QUEUE/worker.pid"
}
if [[ $what == queue-worker ]]; then
    i=0
    while [[ -f $QUEUE/$i.cmd ]]; do
        if [[ ! -f $QUEUE/$i.exit ]]; then
            # A queued job is held by no call's time limit: it waits for the peers' builds
            # longer (ik_llama.cpp's took about 12 minutes on 2026-12-07; `side` gave up at 420 s).
            (cd "$QUEUE/$i.tree" && OUT=$QUEUE/$i.out PEER_WAIT_S=${PEER_WAIT_S:-1200} bash -c "$(cat "$QUEUE/$i.cmd")") \
                > "$QUEUE/$i.log" 2>&1
            echo $? > "$QUEUE/$i.exit"
        fi
        i=$((i + 1))
    done
    exit 0
fi
if [[ $what == queue ]]; then
    mkdir -p "$QUEUE"
    n=0
    while [[ -e $QUEUE/$n.cmd ]]; do n=$((n + 1)); done
    mkdir -p "$QUEUE/$n.tree" "$QUEUE/$n.out"
    tar -c --exclude=./target --exclude=./models . | tar -x -C "$QUEUE/$n.tree"
    printf '%s\n' "$2" > "$QUEUE/$n.cmd"
    queue_start_worker
    echo "queued job $n: $2"
    what=wait
    set -- wait 1
fi
if [[ $what == wait ]]; then
    end=$((SECONDS + ${2:-50}))
    # A job queued while the worker was leaving finds no worker: start one.
    i=0
    while [[ -f $QUEUE/$i.cmd ]]; do
        [[ -f $QUEUE/$i.exit ]] || { queue_start_worker; break; }
        i=$((i + 1))
    done
    while ((SECONDS < end)) && queue_worker_alive; do sleep 2; done
    i=0
    while [[ -f $QUEUE/$i.cmd ]]; do
        j=$QUEUE/$i
        state="waiting"
        [[ -f $j.log ]] && state="running"
        [[ -f $j.exit ]] && state="exit $(cat "$j.exit")"
        echo "== job $i: $(cat "$j.cmd") ($state)"
        [[ -f $j.log ]] && tail -n "${WAIT_LINES:-6}" "$j.log"
        i=$((i + 1))
    done
    exit 0
fi
export TURBOSPARK_ROOT=$PWD
# gpu-build.sh carries the binaries xz-compressed: unpacked once per machine. DEVBIN names
# another folder of unpacked binaries (an earlier build's turbospark, for `spec` or `depth`).
B=${DEVBIN:-/tmp/devbin}
mkdir -p $B
# Carried once per lease: later calls of a warm machine may leave .devbin out.
shopt -s nullglob
for z in .devbin/*.xz; do
    n=$B/$(basename "$z" .xz)
    # Through a new file: a binary still running elsewhere (a queued job) keeps its old one.
    [[ -x $n && $n -nt $z ]] || { xz -dc "$z" > "$n.new" && chmod +x "$n.new" && mv -f "$n.new" "$n"; }
done
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
failed=0
if [[ $what == tests || $what == all ]]; then
    # These tests are #[ignore]d where there is no GPU (CI); here they run, and fail without one.
    # The real models are staged only for `real`.
    "$B"/gpu-tests --include-ignored --skip real_models --test-threads=1 --nocapture 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -v "^test .* ok$"
    ((PIPESTATUS[0] == 0)) || failed=1
    # Only the ignored ones (NVRTC): the rest of this binary runs on CI.
    "$B"/cuda-host-tests --ignored --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda-host-tests.log"
    ((PIPESTATUS[0] == 0)) || failed=1
fi
if [[ $what == real ]]; then
    "$B"/gpu-tests --include-ignored --test-threads=1 --nocapture real_models 2>&1 | tee "$OUT/gpu-real.log"
    ((PIPESTATUS[0] == 0)) || failed=1
fi
if [[ $what == bench || $what == all ]]; then
    "$B"/bandwidth 2>&1 | tee "$OUT/bandwidth.log"
    for like in gpt-oss-20b qwen3-30b-a3b; do
        f=/tmp/$like.gguf
        [[ -f $f ]] || "$B"/turbospark synth --like "$like" -o "$f" 2>&1 | tail -1
        start=$SECONDS
        "$B"/turbospark bench -m "$f" --device cuda -p 512 -n 128 -r 2 2>&1 | tee "$OUT/bench-$like.log"
        echo "load + bench: $((SECONDS - start)) s"
        # A quarter of the expert bytes in VRAM, the rest in pinned host RAM (prefetch on).
        quarter=$("$B"/turbospark inspect --json "$f" | python3 -c 'import json,sys
d=json.load(sys.stdin); print(sum(t["bytes"] for t in d["tensors"] if "_exps" in t["name"]) // 4)')
        "$B"/turbospark bench -m "$f" --device cuda --expert-cache "$quarter" -p 512 -n 128 -r 2 2>&1 \
            | tee "$OUT/bench-$like-tier.log"
        # The same without copying the next layer's guessed experts early (on by default here).
        "$B"/turbospark bench -m "$f" --device cuda --expert-cache "$quarter" --expert-prefetch off -p 0 -n 128 -r 2 \
            2>&1 | tee "$OUT/bench-$like-no-prefetch.log"
    done
fi
# The 8-layer cut of synthetic model `$1` in /tmp (written once per machine), and Nsight Compute.
synth8() {
    local f=/tmp/$1-8l.gguf
    [[ -f $f ]] || "$B"/turbospark synth --like "$1" --layers 8 -o "$f" 2>&1 | tail -1 >&2
    echo "$f"
}
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [[ $what == profile ]]; then
    # Time per kernel of a few decode steps (Nsight Compute, clocks left alone); PROFILE_BENCH
    # gives other bench flags, PROFILE_NCU more of ncu's and PROFILE_COUNT the launches
    # (1500; several sequences at once, after the single-sequence runs' launches:
    # PROFILE_BENCH="-p 0 -n 4 -r 1 --parallel 16" PROFILE_NCU="-s 8000"; decode attention
    # after 2,048 positions: PROFILE_BENCH="-p 0 -n 4 -r 1 -d 2048" PROFILE_COUNT=96
    # PROFILE_NCU="-k regex:^attention$"). BIN names another build (turbospark-before).
    for like in ${LIKES:-gpt-oss-20b qwen3-30b-a3b}; do
        f=/tmp/$like.gguf
        [[ -f $f ]] || "$B"/turbospark synth --like "$like" -o "$f" 2>&1 | tail -1
        "$ncu" --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel -c ${PROFILE_COUNT:-1500} \
            ${PROFILE_NCU:-} \
            "$B"/${BIN:-turbospark} bench -m "$f" --device cuda ${PROFILE_BENCH:--p 0 -n 8 -r 1} > "$OUT/profile-$like.log" 2>&1
        echo "== $like, ${BIN:-turbospark}: time per kernel over the first ${PROFILE_COUNT:-1500} launches of ${PROFILE_BENCH:-8 decode steps}"
        python3 tools/ncu-summary.py "$OUT/profile-$like.log" | tee "$OUT/profile-$like.txt"
        rm -f "$OUT/profile-$like.log"
    done
fi
if [[ $what == profile-prefill ]]; then
    # `profile-prefill LIKE`: time per kernel of 512-token prompts on the first 8 layers
    # of a synthetic model (every expert in VRAM).
    like=$2
    f=$(synth8 "$like")
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel -c 3000 \
        "$B"/turbospark bench -m "$f" --device cuda -p 512 -n 0 -r 1 > "$OUT/profile-prefill-$like.log" 2>&1
    echo "== $like (8 layers): time per kernel over the first 3000 launches of pp512"
    python3 tools/ncu-summary.py "$OUT/profile-prefill-$like.log" | tee "$OUT/profile-prefill-$like.txt" | head -25
    rm -f "$OUT/profile-prefill-$like.log"
fi
# The synthetic model `$1` in /tmp (written once per machine), or `$1` itself where it is a
# file (a real model staged by tools/gpu-stage.sh).
synth() {
    [[ -f $1 ]] && { echo "$1"; return; }
    local f=/tmp/$1.gguf
    [[ -f $f ]] || "$B"/turbospark synth --like "$1" -o "$f" 2>&1 | tail -1 >&2
    echo "$f"
}
# Waits for every build `peer-build` queued: rows whose work is on the host's CPU are not
# measured beside a compiler (2026-12-03: ours with --expert-misses cpu ran at 10.5 tok/s beside
# ik_llama.cpp's build, 87-89 without). `wait_peer_builds lc` waits for llama.cpp's only (rows
# all on the GPU). At most PEER_WAIT_S (420) seconds in all, so that a call's 600 s limit does
# not cut its output (2026-12-03: `side` lost every peer row so); a peer still building is
# then left out (`peer_ready`), and a later call runs its rows. Queued jobs wait up to 1200 s.
wait_peer_builds() {
    local log logs=(/tmp/lcbuild.log /tmp/ikbuild.log)
    (($#)) && logs=("${@/%/build.log}") && logs=("${logs[@]/#//tmp/}")
    for log in "${logs[@]}"; do
        [[ -f $log ]] || continue
        while ! grep -q "^built" $log && ((peer_waited < ${PEER_WAIT_S:-420})); do
            sleep 10
            peer_waited=$((peer_waited + 10))
        done
        grep -q "^built" $log || echo "gpu-run.sh: $log not built after ${peer_waited} s: its rows are left out"
        grep -q "^built [1-9]" $log && echo "gpu-run.sh: $log: the build failed, its rows are left out"
    done
}
peer_waited=0
# Whether peer `lc` or `ik` was built (its llama-bench there to run) with CUDA; `peer_ready lc
# cpu` also takes a build without it (`PEER_CPU=1 peer-build`).
peer_ready() {
    grep -q "^built 0" /tmp/$1build.log 2>/dev/null || return 1
    [[ ${2:-} == cpu ]] || ! grep -q "^cpu only" /tmp/$1build.log
}
# The LIKEs given, or the two MoE shapes.
likes_or_default() {
    if (($#)); then echo "$@"; else echo gpt-oss-20b qwen3-30b-a3b; fi
}
# Expert bytes over 4: the VRAM cache of the tiered benchmarks.
quarter() {
    "$B"/turbospark inspect --json "$1" | python3 -c 'import json,sys
d=json.load(sys.stdin); print(sum(t["bytes"] for t in d["tensors"] if "_exps" in t["name"]) // 4)'
}
if [[ $what == batched ]]; then
    # `batched LIKE...`: generation of 1, 4 and 16 sequences at once, all in VRAM, beside
    # llama.cpp's llama-batched-bench -npl where `peer-build` built it.
    shift
    for like in "$@"; do
        f=$(synth "$like")
        echo "== $like, turbospark: 1, 4, 16 sequences"
        "$B"/turbospark bench -m "$f" --device cuda -p 128 -n 64 -r 2 --parallel 1,4,16 2>&1 \
            | tee -a "$OUT/batched-$like.log" | grep -E "^\||error"
        wait_peer_builds lc
        if peer_ready lc; then
            echo "== $like, llama.cpp llama-batched-bench: 1, 4, 16 sequences (S_TG t/s is generation)"
            /tmp/lcbuild/bin/llama-batched-bench -m "$f" -ngl 99 -fa 1 -c 4096 -npp 128 -ntg 64 -npl 1,4,16 2>&1 \
                | tee -a "$OUT/batched-$like.log" | grep -E "^\||error"
        fi
    done
fi
if [[ $what == peer-build ]]; then
    # Built in the background from the sources tools/peer-pack*.sh packed, llama.cpp first, then
    # ik_llama.cpp (about 6 minutes each with 16 cores; together about 12). A prebuilt binary
    # cannot travel: xz'd it is over 16 MiB, and the tree's fixtures already take 49 of a call's 64.
    # PEER_CPU=1: without CUDA (a minute or a few instead of 6-13), for `cpu-sweep` alone.
    flags="-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CCACHE=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release"
    cuda="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"
    [[ ${PEER_CPU:-0} == 1 ]] && cuda=""
    chain=""
    for peer in llama ik; do
        dir=/tmp/${peer/llama/lc}build
        src=.peer/$peer-cuda.tar.xz
        # ik_llama.cpp keeps llama-bench among its examples.
        sub=ik_llama.cpp extra=""
        [[ $peer == llama ]] && sub=llama.cpp extra="-DLLAMA_BUILD_APP=OFF"
        # The sources are git-ignored: a call carries them only where `carry` names .peer.
        [[ -f $src ]] || { echo "$peer: no $src here (carry .peer): not built"; continue; }
        # A peer `peer-unpack` already put in place (prebuilt here, tools/peer-prebuild.md) stays.
        grep -qs "^built 0" $dir.log && echo "$peer: already built ($dir)" && continue
        rm -rf /tmp/src-$peer && mkdir -p /tmp/src-$peer && tar -xJf $src -C /tmp/src-$peer
        : > $dir.log
        [[ -z $cuda ]] && echo "cpu only" > $dir.log
        # llama.cpp also builds llama-batched-bench, the peer of `batched`, and llama-speculative,
        # the peer of `spec` with a draft model.
        targets="llama-bench"
        [[ $peer == llama ]] && targets="llama-bench llama-batched-bench llama-speculative"
        chain+="(cmake -S /tmp/src-$peer/$sub -B $dir $flags $cuda $extra && cmake --build $dir -j16 --target $targets) >> $dir.log 2>&1; echo built \$? >> $dir.log; "
        echo "$peer: build queued (log $dir.log)"
    done
    # Niced: our runs beside them keep their host thread.
    [[ -n $chain ]] && setsid nohup nice -n 19 bash -c "$chain" > /dev/null 2>&1 &
fi
if [[ $what == peer-unpack ]]; then
    # `peer-unpack` (a call of its own that carries .peer-bin, the fixtures hidden): llama.cpp's
    # and ik_llama.cpp's CUDA binaries prebuilt on the developers' machine (tools/peer-prebuild.md)
    # unpacked where peer-build's builds go, and marked built, so `side`, `depth` and `spec` run
    # them without the 6-13 minutes of building here.
    # ik_llama.cpp's pack (199 MB) travels in pieces of 52 MB (.peer-bin-ik/NNN), each carried
    # by a call of its own that copies it to /root/peer; they are joined here.
    if compgen -G "/root/peer/ikpart.*" > /dev/null; then cat /root/peer/ikpart.* > /tmp/ik-cuda-bin.tar.xz; fi
    for peer in llama ik; do
        pack=.peer-bin/$peer-cuda-bin.tar.xz
        [[ -f $pack ]] || pack=/tmp/$peer-cuda-bin.tar.xz
        [[ -f $pack ]] || continue
        dir=/tmp/${peer/llama/lc}build
        mkdir -p $dir/bin && tar -xJf $pack -C $dir/bin --strip-components=1
        if $dir/bin/llama-bench --help > /dev/null 2>&1; then echo "built 0" > $dir.log; else echo "built 1" > $dir.log; fi
        echo "$peer: $(tail -1 $dir.log) ($(ls $dir/bin | tr '\n' ' '))"
    done
fi
if [[ $what == timing ]]; then
    # `timing LIKE...`: where a replayed decode step's time goes (TURBOSPARK_STEP_TIMING), with
    # the launches spread over streams or not, dependent launch or not; SM clocks sampled.
    shift
    for like in "$@"; do
        f=$(synth "$like")
        for knob in ${TIMING_KNOBS:-none TURBOSPARK_NO_BRANCHES TURBOSPARK_NO_PDL}; do
            echo "== $like, $knob"
            nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv,noheader -lms 500 > "$OUT/clocks-$like-$knob.log" &
            smi=$!
            env TURBOSPARK_STEP_TIMING=1 ${knob/none/X}=1 "$B"/turbospark bench -m "$f" --device cuda -p 0 -n 128 -r 1 2>&1 \
                | tee -a "$OUT/timing.log" | grep -E "^\||step timing|error"
            kill $smi
            sort "$OUT/clocks-$like-$knob.log" | uniq -c | sort -rn | head -2
        done
    done
fi
if [[ $what == host-timing ]]; then
    # `host-timing LIKE...`: where the host's time goes in steps run op by op
    # (TURBOSPARK_HOST_TIMING): a quarter of the expert bytes in VRAM, then every expert in
    # VRAM with graphs off, then as built (graphs on), decode only (HT_MODES picks among
    # tier, tier-cpu: the quarter with --expert-misses cpu, no-graphs, graphs).
    shift
    for like in "$@"; do
        f=$(synth "$like")
        q=$(quarter "$f")
        for mode in ${HT_MODES:-tier no-graphs graphs}; do
            extra=() envs=(TURBOSPARK_HOST_TIMING=1)
            [[ $mode == tier ]] && extra=(--expert-cache "$q")
            [[ $mode == tier-cpu ]] && extra=(--expert-cache "$q" --expert-misses cpu)
            [[ $mode == no-graphs ]] && envs+=(TURBOSPARK_NO_CUDA_GRAPHS=1)
            echo "== $like, $mode"
            env "${envs[@]}" "$B"/turbospark bench -m "$f" --device cuda "${extra[@]}" -p 0 -n 128 -r 1 2>&1 \
                | tee -a "$OUT/host-timing.log" | grep -E "^\|.*tg|host timing|error"
        done
    done
fi
if [[ $what == misses ]]; then
    # `misses [LIKE...]`: a quarter of the expert bytes in VRAM, decode (tg64) and pp512 with the
    # misses copied in, then computed on the CPU beside the GPU for each share of the next
    # layer's guesses copied ahead (MISS_SHARES: `default`, fractions set by the knob
    # TURBOSPARK_PREFETCH_SHARE, or a knob's NAME=VALUE with the default share, e.g.
    # TURBOSPARK_CPU_TEAM=0), with the cache's counters.
    shift
    for like in $(likes_or_default "$@"); do
        f=$(synth "$like")
        q=$(quarter "$f")
        for setting in copy ${MISS_SHARES:-default}; do
            case $setting in
                copy) misses=copy envs=(X=1) ;;
                default) misses=cpu envs=(X=1) ;;
                *=*) misses=cpu envs=("$setting") ;;
                *) misses=cpu envs=(TURBOSPARK_PREFETCH_SHARE=$setting) ;;
            esac
            echo "== $like, --expert-misses $misses ($setting)"
            env "${envs[@]}" "$B"/turbospark bench -m "$f" --device cuda --expert-cache "$q" \
                --expert-misses "$misses" ${MISS_BENCH:--p 512 -n 64 -r 2} 2>&1 | tee -a "$OUT/misses.log" \
                | grep -E "^\|.*(pp|tg)[0-9]|expert cache|error"
        done
    done
fi
if [[ $what == before-after ]]; then
    # `before-after [LIKE...]` (default: gpt-oss-20b qwen3-30b-a3b).
    shift
    for like in $(likes_or_default "$@"); do
        f=$(synth "$like")
        q=$(quarter "$f")
        # BA_BENCH: the bench flags (default pp512, tg128); BA_TIER=0 skips the quarter-tier
        # runs, BA_VRAM=0 the all-in-VRAM ones.
        for bin in turbospark-before turbospark; do
            if [[ ${BA_VRAM:-1} != 0 ]]; then
                echo "== $like, $bin: every expert in VRAM"
                "$B/$bin" bench -m "$f" --device cuda ${BA_BENCH:--p 512 -n 128 -r 2} 2>&1 | tee -a "$OUT/before-after.log" \
                    | grep -E "^\||tok/s|error"
            fi
            [[ ${BA_TIER:-1} == 0 ]] && continue
            echo "== $like, $bin: a quarter of the expert bytes in VRAM"
            "$B/$bin" bench -m "$f" --device cuda --expert-cache "$q" -p 512 -n 64 -r 2 2>&1 | tee -a "$OUT/before-after.log" \
                | grep -E "^\||tok/s|error"
        done
    done
fi
if [[ $what == side ]]; then
    # `side LIKE...`: ours beside llama.cpp's llama-bench (started by `peer-build` on this
    # machine) on each synthetic model: every expert in VRAM, then ours with a quarter of
    # the expert bytes in VRAM beside llama.cpp with every expert on the CPU (16 threads).
    # A LIKE that is a file (a staged real model) is benchmarked as it is; without experts it
    # has no quarter-tier runs.
    shift
    for like in "$@"; do
        f=$(synth "$like")
        like=$(basename "$like" .gguf)
        q=$(quarter "$f")
        n_layer=$("$B"/turbospark inspect --json "$f" | python3 -c 'import json,sys
d=json.load(sys.stdin); print(max(int(t["name"].split(".")[1]) for t in d["tensors"] if t["name"].startswith("blk.")) + 1)')
        echo "== $like, turbospark: every expert in VRAM"
        "$B"/turbospark bench -m "$f" --device cuda -p 512 -n 128 -r 2 2>&1 | tee -a "$OUT/side-$like.log" | grep -E "^\||tok/s|error|RSS"
        if ((q > 0)); then
            # SIDE_MISSES="copy cpu": the quarter tier with each --expert-misses (default: auto,
            # the engine's default).
            for misses in ${SIDE_MISSES:-auto}; do
                [[ $misses != copy ]] && wait_peer_builds
                echo "== $like, turbospark: a quarter of the expert bytes in VRAM, --expert-misses $misses"
                "$B"/turbospark bench -m "$f" --device cuda --expert-cache "$q" --expert-misses "$misses" -p 512 -n 64 -r 2 \
                    2>&1 | tee -a "$OUT/side-$like.log" | grep -E "^\||tok/s|error|RSS"
            done
        fi
        # Both builds done first: the peers' experts-on-CPU rows need the host's cores.
        wait_peer_builds
        if peer_ready lc; then
            tail -1 /tmp/lcbuild.log
            echo "== $like, llama.cpp: every layer on the GPU"
            /tmp/lcbuild/bin/llama-bench -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r 2 2>&1 | tee -a "$OUT/side-$like.log" \
                | grep -E "^\||error"
            ((q > 0)) && echo "== $like, llama.cpp: every layer's experts on the CPU (16 threads)" &&
            /tmp/lcbuild/bin/llama-bench -m "$f" -ngl 99 -fa 1 -ncmoe "$n_layer" -t 16 -p 512 -n 64 -r 2 2>&1 \
                | tee -a "$OUT/side-$like.log" | grep -E "^\||error"
        fi
        if peer_ready ik; then
            tail -1 /tmp/ikbuild.log
            # Its fused MoE is on by default; -rtr (run-time repack) is for experts on the CPU.
            echo "== $like, ik_llama.cpp: every layer on the GPU"
            /tmp/ikbuild/bin/llama-bench -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r 2 2>&1 | tee -a "$OUT/side-$like.log" \
                | grep -E "^\||error"
            ((q > 0)) && echo "== $like, ik_llama.cpp: every layer's experts on the CPU (16 threads)" &&
            /tmp/ikbuild/bin/llama-bench -m "$f" -ngl 99 -fa 1 --n-cpu-moe "$n_layer" -rtr 1 -t 16 -p 512 -n 64 -r 2 2>&1 \
                | tee -a "$OUT/side-$like.log" | grep -E "^\||error"
        fi
    done
fi
if [[ $what == depth ]]; then
    # `depth MODEL|LIKE...`: decode (tg128) and prompts (pp512) after DEPTHS tokens already in
    # the sequence (default 0,1024,4096; llama-bench's -d), everything in VRAM: the earlier
    # build (turbospark-before, where carried) and this one (DEPTH_BINS names others; empty:
    # none), then llama.cpp (its rows all on the GPU: its build alone is waited for).
    shift
    depths=${DEPTHS:-0,1024,4096}
    for like in "$@"; do
        f=$(synth "$like")
        like=$(basename "$like" .gguf)
        for bin in ${DEPTH_BINS-turbospark-before turbospark}; do
            [[ -x $B/$bin ]] || continue
            echo "== $like, $bin, depths $depths"
            "$B/$bin" bench -m "$f" --device cuda -p ${DEPTH_P:-512} -n 128 -d "$depths" -r 2 2>&1 \
                | tee -a "$OUT/depth-$like.log" | grep -E "^\|.*(pp|tg)|error"
        done
        wait_peer_builds lc
        if peer_ready lc; then
            echo "== $like, llama.cpp, depths $depths"
            /tmp/lcbuild/bin/llama-bench -m "$f" -ngl 99 -fa 1 -p ${DEPTH_P:-512} -n 128 -d "$depths" -r 2 2>&1 \
                | tee -a "$OUT/depth-$like.log" | grep -E "^\|.*(pp|tg)|error"
        fi
    done
fi
if [[ $what == peer-profile ]]; then
    # `peer-profile LIKE`: llama.cpp's time per kernel over a few decode steps (started by
    # `peer-build`), to set beside `profile`'s of ours.
    like=$2
    f=$(synth "$like")
    wait_peer_builds lc
    peer_ready lc || { echo "gpu-run.sh: llama.cpp's llama-bench is not built"; exit 1; }
    tail -1 /tmp/lcbuild.log
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel -c ${LAUNCHES:-3000} \
        /tmp/lcbuild/bin/llama-bench -m "$f" -ngl 99 -fa 1 -p 0 -n 8 -r 1 > "$OUT/peer-profile-$like.log" 2>&1
    echo "== $like, llama.cpp: time per kernel over the first ${LAUNCHES:-3000} launches of 8 decode steps"
    python3 tools/ncu-summary.py "$OUT/peer-profile-$like.log" | tee "$OUT/peer-profile-$like.txt" | head -30
    rm -f "$OUT/peer-profile-$like.log"
fi
if [[ $what == sweep ]]; then
    # `sweep LIKE|FILE.gguf...` with SWEEP="A=1 B=2;A=3": pp512 (every expert in VRAM;
    # SWEEP_BENCH gives other bench flags) under each setting of a build's measurement knobs,
    # one process each.
    shift
    for like in "$@"; do
        f=$(synth "$like")
        like=$(basename "$like" .gguf)
        IFS=';' read -ra settings <<< "${SWEEP:-}"
        for setting in "${settings[@]}"; do
            echo "== $like, ${SWEEP_BENCH:-pp512} with $setting"
            env $setting "$B"/turbospark bench -m "$f" --device cuda ${SWEEP_BENCH:--p 512 -n 0 -r 3} 2>&1 \
                | tee -a "$OUT/sweep-$like.log" | grep -E "^\|.*(pp|tg)[0-9]|error"
        done
    done
fi
if [[ $what == cpu-sweep ]]; then
    # `cpu-sweep LIKE|FILE.gguf...` with SWEEP="A=1;A=0" and THREADS="4 8 16": the machine's CPU alone (GPU
    # hidden), experts resident, under each setting of a build's measurement knobs, one process
    # each running every thread count (`bench -t 4,8,16`; CPU_BENCH gives other bench flags),
    # then the peers `peer-build` built (CUDA builds, the GPU hidden) with the same flags,
    # ik_llama.cpp with its run-time repack, as issue 16 measures it. A setting of
    # TURBOSPARK_CPU_TIMING=1 adds where each step's time goes (printed every 64 decode steps and
    # every 8 prompt batches: CPU_BENCH="-p 128 -n 0 -r 8" for a prompt's). First the host's read
    # bandwidth at each thread count (tools/membw.c, the best of its four passes), which issue 16
    # reports beside the engines' rates (MEMBW_MIB: the sizes of the set read); and the cost of
    # one of the team's parallel regions.
    # CPU_PEERS="" leaves the peers out (default "lc ik").
    shift
    wait_peer_builds
    counts=$(echo ${THREADS:-16} | tr ' ' ',')
    if gcc -O2 -fopenmp -march=native tools/membw.c -o /tmp/membw 2> /dev/null; then
        # MEMBW_MIB="1024 96": each set's size too (a model's bytes a token: what the caches give).
        for mib in ${MEMBW_MIB:-1024}; do
            for t in ${THREADS:-16}; do
                echo "membw, $mib MiB, $t threads: $(OMP_NUM_THREADS=$t /tmp/membw $mib | sort -k2 -n | tail -1)"
            done
        done
    else
        echo "gpu-run.sh: no gcc here, the host's bandwidth left out"
    fi
    # What a parallel region of the step's team costs (4 small items a thread), this build's
    # and, where carried, an earlier one's.
    for tr in "$B"/team_regions "$B"/team_regions-before; do
        [[ -x $tr ]] && echo "== $(basename "$tr")" && "$tr" "$counts" 4 200 | tail -n +3
    done
    for like in "$@"; do
        f=$(synth "$like")
        like=$(basename "$like" .gguf)
        IFS=';' read -ra settings <<< "${SWEEP:-X=1}"
        for setting in "${settings[@]}"; do
            # Earlier builds carried as turbospark-before (and turbospark-pre, an earlier one
            # still) run after this one, same flags (before it in a setting that names
            # BEFORE_FIRST=1; CPU_BEFORE=0 leaves them out).
            order="turbospark turbospark-before turbospark-pre"
            [[ $setting == *BEFORE_FIRST=1* ]] && order="turbospark-pre turbospark-before turbospark"
            [[ ${CPU_BEFORE:-1} == 0 ]] && order=turbospark
            for ts in $order; do
                ts=$B/$ts
                [[ -x $ts ]] || continue
                echo "== $like, $(basename "$ts"), -t $counts, ${CPU_BENCH:--p 128 -n 32 -r 2} with $setting"
                env CUDA_VISIBLE_DEVICES= $setting "$ts" bench -m "$f" -t "$counts" --experts resident \
                    ${CPU_BENCH:--p 128 -n 32 -r 2} 2>&1 | tee -a "$OUT/cpu-sweep-$like.log" \
                    | grep -E "^\|.*(pp|tg)[0-9]|error|cpu timing"
            done
        done
        for peer in ${CPU_PEERS-lc ik}; do
            peer_ready $peer cpu || continue
            extra=""
            [[ $peer == ik ]] && extra="-rtr 1"
            echo "== $like, -t $counts, ${peer/lc/llama.cpp} llama-bench $extra"
            env CUDA_VISIBLE_DEVICES= /tmp/${peer}build/bin/llama-bench -m "$f" -t "$counts" -ngl 0 $extra \
                ${CPU_BENCH:--p 128 -n 32 -r 2} 2>&1 | tee -a "$OUT/cpu-sweep-$like.log" | grep -E "^\|.*(pp|tg)[0-9]|error"
        done
    done
fi
if [[ $what == ncu-detail ]]; then
    # `ncu-detail LIKE REGEX`: Nsight Compute's speed-of-light, occupancy and warp-stall
    # sections for the first DETAIL_COUNT (2) launches of the kernels matching REGEX in a pp512 of the
    # 8-layer synthetic model (DETAIL_BENCH: other bench flags, "-p 0 -n 4 -r 1" for decode).
    like=$2
    f=$(synth8 "$like")
    "$ncu" --clock-control none -k "regex:$3" -c ${DETAIL_COUNT:-2} --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
        "$B"/turbospark bench -m "$f" --device cuda ${DETAIL_BENCH:--p 512 -n 0 -r 1} 2>&1 | tee "$OUT/ncu-detail-$like.log" \
        | grep -vE "^ *-+ *$|^ *$|^==PROF==" | grep -E "Duration|Throughput|Occupancy|Registers|Stall|Warp Cycles|Issued|Eligible|Active Warps|Block Limit|Executed Ipc|OPT|sec|^  [a-z_]" | head -${LINES_MAX:-80}
fi
if [[ $what == wide ]]; then
    # `wide MODEL...`: steps of several rows with the 8-bit matvec's passes of up to 8 rows
    # (`matvec_q8_wide_<t>`) and with earlier builds' two-row passes, 8 rows a launch
    # (TURBOSPARK_Q8_WIDE_ROWS=32 TURBOSPARK_Q8_LAUNCH_ROWS=8), interleaved, two rounds:
    # generation of 1, 4 and 16 sequences at once.
    shift
    for f in "$@"; do
        for round in 1 2; do
            for mode in wide two-row; do
                knobs=(TURBOSPARK_Q8_WIDE_ROWS=3)
                [[ $mode == two-row ]] && knobs=(TURBOSPARK_Q8_WIDE_ROWS=32 TURBOSPARK_Q8_LAUNCH_ROWS=8)
                echo "== $(basename "$f"), $mode passes, round $round"
                env "${knobs[@]}" "$B"/turbospark bench -m "$f" --device cuda -p 128 -n 64 -r 2 --parallel 1,4,16 2>&1 \
                    | tee -a "$OUT/wide-$(basename "$f" .gguf).log" | grep -E "tg|error"
                ((PIPESTATUS[0] == 0)) || failed=1
            done
        done
    done
fi
if [[ $what == spec ]]; then
    # `spec MODEL PROMPT_FILE [FLAGS]`: greedy generation of 256 tokens on the GPU without and
    # with prompt lookup (or FLAGS, e.g. "--spec-mtp"), two interleaved rounds: the speed and
    # acceptance lines `run` writes on stderr, and whether the texts are the same.
    # SPEC_OURS=0 / SPEC_PEER=0 leave out our runs / llama.cpp's.
    flags=${4:---spec-ngram}
    for round in 1 2; do
        [[ ${SPEC_OURS:-1} == 0 ]] && break
        for with in plain spec; do
            extra=""
            [[ $with == spec ]] && extra=$flags
            echo "== round $round, $with $extra"
            "$B"/turbospark run -m "$2" --device cuda -f "$3" -n 256 --temp 0 $extra \
                2> "$OUT/spec-$with-$round.err" > "$OUT/spec-$with-$round.txt"
            grep -E "generation:|speculative:" "$OUT/spec-$with-$round.err"
        done
        cmp -s "$OUT/spec-plain-$round.txt" "$OUT/spec-spec-$round.txt" && echo "round $round: same text" \
            || { echo "round $round: the texts differ"; failed=1; }
    done
    # With a draft model: llama.cpp's plain decode (llama-bench tg128) and llama-speculative on
    # the same pair and prompt, every layer of both on the GPU, greedy.
    draft=$(sed -n 's/.*--draft-model \([^ ]*\).*/\1/p' <<< "$flags")
    [[ -n $draft && ${SPEC_PEER:-1} != 0 ]] && wait_peer_builds lc
    if [[ -n $draft && ${SPEC_PEER:-1} != 0 ]] && peer_ready lc; then
        # Every row on the GPU: ik_llama.cpp's build beside them is not waited for (2026-12-03:
        # waiting for it took a 300 s call).
        echo "== llama.cpp llama-bench -p 0 -n 128 -r 2 (no draft)"
        /tmp/lcbuild/bin/llama-bench -m "$2" -ngl 99 -fa 1 -p 0 -n 128 -r 2 2>&1 | grep -E "^\||error"
        for round in 1 2; do
            echo "== round $round, llama.cpp llama-speculative -md $(basename "$draft")"
            /tmp/lcbuild/bin/llama-speculative -m "$2" -md "$draft" -ngl 99 -ngld 99 -fa on -f "$3" -n 256 \
                --temp 0 > "$OUT/lc-spec-$round.txt" 2> "$OUT/lc-spec-$round.err"
            grep -E "decoded|accept|n_drafted|error" "$OUT/lc-spec-$round.err"
        done
    fi
fi
if ((failed)); then
    echo "gpu-run.sh: tests failed (logs in $OUT)" >&2
    exit 1
fi
