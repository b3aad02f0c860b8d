#!/usr/bin/env bash
# Ours beside llama.cpp's and ik_llama.cpp's llama-bench on the CPU, one file after the other,
# same flags (`-p 128 -n 64 -r 3`; the MoE cuts `-n 32 -r 2`, ours with `--experts resident`;
# ik with `-rtr 1`). Peers built as ../shared/llama-cpp-peer.md says; an engine whose binary
# is missing is left out.
#   LLAMA_BENCH=... IK_BENCH=... tools/cpu-three.sh FILE[:moe] ... (THREADS="2 1")
set -u
cd "$(dirname "$0")/.."
ts=${TURBOSPARK:-target/release/turbospark}
lb=${LLAMA_BENCH:-/tmp/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench}
ik=${IK_BENCH:-/tmp/peer/ik/build/bin/llama-bench}
for arg in "$@"; do
    f=${arg%:moe}
    flags="-p 128 -n 64 -r 3" ours=""
    [[ $arg == *:moe ]] && flags="-p 128 -n 32 -r 2" ours="--experts resident"
    for t in ${THREADS:-2 1}; do
        echo "== $(basename "$f"), $t threads"
        "$ts" bench -m "$f" -t "$t" $flags $ours 2>&1 | grep -E "^\| .*(pp|tg)[0-9]|error"
        [[ -x $lb ]] && "$lb" -m "$f" -t "$t" $flags 2>&1 | grep -E "^\| .*(pp|tg)[0-9]|error"
        [[ -x $ik ]] && "$ik" -m "$f" -t "$t" $flags -rtr 1 2>&1 | grep -E "^\| .*(pp|tg)[0-9]|error"
    done
done
